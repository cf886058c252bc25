"""A long standby outage does not fill the active's disk: past
``[replication] ledger_max_bytes`` the ledger is pruned anyway, and the
standby comes back through a checkpoint with nothing lost."""

from __future__ import annotations

import psycopg

from plugin.devtools import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.prometheus import value
from tests.support.two_sites import (
    VPN,
    Publisher,
    assert_same_state,
    enable,
    expected_rows,
    number,
    scalar,
    setup_vpn,
    until,
    vpn_status,
)

BOUND = 200_000


def ledger_bytes(site: LocalSite) -> int:
    with psycopg.connect(site.pg.dsn(), autocommit=True) as db:
        row = db.execute("SELECT coalesce(sum(octet_length(event)), 0) FROM ledger").fetchone()
    return int(row[0]) if row else 0


def test_the_ledger_is_pruned_past_the_bound_and_the_standby_resyncs(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    setup_vpn(site_a)
    with open(vpnrepl_a.config, "a") as f:
        f.write(f"\n[replication]\nledger_max_bytes = {BOUND}\nledger_check_seconds = 1\n")
    enable(vpnrepl_a)
    node_a.start()
    node_b.start()
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "the standby to connect")
    assert Publisher(site_a, range(1, 101)).run().error is None
    assert_same_state(node_a, node_b)

    node_b.kill()  # a long outage: the ledger keeps everything B has not acknowledged
    b_at = scalar(site_b, "SELECT applied_index FROM vpn_state WHERE vpn = %s", VPN)
    assert Publisher(site_a, range(101, 3_001)).run().error is None
    # the bound holds the ledger's events: pruned back under it, past B's index
    until(lambda: ledger_bytes(site_a) <= BOUND, "the ledger to be pruned under the bound")
    oldest = scalar(site_a, "SELECT min(idx) FROM ledger WHERE vpn = %s", VPN)
    assert oldest > b_at + 1
    metrics = node_a.get("/metrics")
    assert value(metrics, "vpnrepl_ledger_pruned_unacknowledged_total", vpn=VPN) > 0
    assert "over [replication] ledger_max_bytes" in node_a.log_text()

    # B comes back: behind the ledger, it gets a checkpoint; nothing is lost
    node_b.start()
    rows = assert_same_state(node_a, node_b)
    assert {(number(bytes(r[6])), r[0]) for r in rows} == expected_rows(range(1, 3_001))
    assert "installed a checkpoint" in node_b.log_text()
