"""``/metrics`` for Prometheus: every metric an operator alerts on, present
during a sync workload and equal to what ``status --json`` shows once the
workload has settled; read with Prometheus's own text-format parser; the
Grafana dashboard in the repository uses only metrics the node exposes."""

from __future__ import annotations

import json
import re

from plugin.admin import Buckets, Metrics
from tests import REPO
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.prometheus import families, sample_names, value
from tests.support.two_sites import VPN, Publisher, caught_up, cli_status, enable, setup_vpn, until

PER_VPN = (
    "vpnrepl_replication_lag_events",
    "vpnrepl_replication_lag_seconds",
    "vpnrepl_ledger_index",
    "vpnrepl_applied_index",
    "vpnrepl_sync_eligible",
    "vpnrepl_fenced",
    "vpnrepl_bridge_connected",
    "vpnrepl_in_doubt_transactions",
    "vpnrepl_unknown_acks_total",
    "vpnrepl_sync_degraded_total",
    "vpnrepl_sync_confirms_nacked_unrecorded_total",
    "vpnrepl_sync_windows_total",
)
COUNTERS = (
    "vpnrepl_events_total",
    "vpnrepl_client_connections_total",
    "vpnrepl_client_connections_open",
    "vpnrepl_store_up",
)
DASHBOARD = REPO / "grafana" / "vpn-replication.json"


def test_metrics_during_a_sync_workload_then_equal_to_status(
    vpnrepl_a: Vpnrepl, node_a: NodeProcess, node_b: NodeProcess
) -> None:
    setup_vpn(node_a.site)
    enable(vpnrepl_a, "--mode", "sync")
    node_a.start()
    node_b.start()
    until(lambda: cli_status(node_a)["bridge"] == "connected", "the bridge to connect")
    publisher = Publisher(node_a.site, range(1, 4001), window=200).start()
    until(lambda: publisher.settled >= 500, "the workload to get going")
    during = node_a.get("/metrics")
    publisher.join()
    assert publisher.error is None and len(publisher.confirmed) == 4000

    names = sample_names(during)
    for metric in PER_VPN + COUNTERS:
        assert metric in names, f"{metric} missing from /metrics during the workload"
    assert value(during, "vpnrepl_store_up") == 1
    assert value(during, "vpnrepl_node_leads", site="a", node="node") == 1  # its one node
    assert value(during, "vpnrepl_vpn_info", vpn=VPN, role="active", mode="sync") == 1
    # the histograms: confirms held for the standby, group commits
    held = value(during, "vpnrepl_confirm_delay_seconds_count", vpn=VPN, mode="sync")
    assert held is not None and held > 0
    assert value(during, "vpnrepl_ledger_commit_entries_count") > 0
    fams = families(during)
    assert fams["vpnrepl_confirm_delay_seconds"].type == "histogram"
    assert fams["vpnrepl_ledger_commit_entries"].type == "histogram"
    assert fams["vpnrepl_events"].type == "counter"
    assert fams["vpnrepl_replication_lag_events"].type == "gauge"

    caught_up(node_a, node_b)
    settled = node_a.get("/metrics")
    status = cli_status(node_a)
    for key, metric in (
        ("lag_events", "vpnrepl_replication_lag_events"),
        ("lag_seconds", "vpnrepl_replication_lag_seconds"),
        ("ledger_index", "vpnrepl_ledger_index"),
        ("applied_index", "vpnrepl_applied_index"),
        ("in_doubt_txns", "vpnrepl_in_doubt_transactions"),
        ("epoch", "vpnrepl_epoch"),
    ):
        assert value(settled, metric, vpn=VPN) == status[key], metric
    assert value(settled, "vpnrepl_sync_eligible", vpn=VPN) == int(status["sync_eligible"]) == 1
    assert value(settled, "vpnrepl_fenced", vpn=VPN) == 0
    assert value(settled, "vpnrepl_bridge_connected", vpn=VPN) == 1
    assert value(settled, "vpnrepl_sync_degraded_total", vpn=VPN) == 0
    assert value(settled, "vpnrepl_sync_confirms_nacked_unrecorded_total", vpn=VPN) == 0
    assert value(settled, "vpnrepl_sync_windows_total", vpn=VPN) == 0
    assert value(settled, "vpnrepl_ledger_index", vpn=VPN) == 4000  # one entry per publish
    assert value(settled, "vpnrepl_confirm_delay_seconds_count", vpn=VPN, mode="sync") == 4000
    # the standby's view of the same VPN
    standby = node_b.get("/metrics")
    assert value(standby, "vpnrepl_vpn_info", vpn=VPN, role="standby", mode="sync") == 1
    assert value(standby, "vpnrepl_applied_index", vpn=VPN) == status["applied_index"]

    # a degradation is counted: the standby stops, sync times out
    node_b.stop()
    until(lambda: cli_status(node_a)["bridge"] == "disconnected", "the bridge to drop")
    Publisher(node_a.site, range(5001, 5003), window=1).run()
    degraded = node_a.get("/metrics")
    assert value(degraded, "vpnrepl_sync_degraded_total", vpn=VPN) == 1
    # the window was recorded before the confirm: the scrape reads it from the store
    assert value(degraded, "vpnrepl_sync_windows_total", vpn=VPN) == 1
    assert cli_status(node_a)["sync_windows_total"] == 1
    assert value(degraded, "vpnrepl_sync_eligible", vpn=VPN) == 0
    assert value(degraded, "vpnrepl_bridge_connected", vpn=VPN) == 0
    assert value(degraded, "vpnrepl_replication_lag_events", vpn=VPN) > 0


def test_without_its_database_the_scrape_still_answers_with_store_down() -> None:
    metrics = Metrics()
    text = metrics.render(None).decode()
    assert value(text, "vpnrepl_store_up") == 0
    assert "vpnrepl_ledger_index{" not in text


def test_a_plain_tcp_bridge_shows_as_not_authenticated() -> None:
    metrics = Metrics()
    doc = {"site": "a", "bridge_authenticated": False, "vpns": []}
    assert value(metrics.render(doc).decode(), "vpnrepl_bridge_authenticated") == 0
    doc["bridge_authenticated"] = True
    assert value(metrics.render(doc).decode(), "vpnrepl_bridge_authenticated") == 1


def test_buckets_are_cumulative_as_prometheus_reads_them() -> None:
    b = Buckets((0.01, 0.1, 1.0))
    for v in (0.005, 0.01, 0.05, 2.0):
        b.observe(v)
    assert b.cumulative() == [("0.01", 2), ("0.1", 3), ("1.0", 3), ("+Inf", 4)]
    assert abs(b.total - 2.065) < 1e-9


def test_the_grafana_dashboard_uses_only_metrics_the_node_exposes() -> None:
    board = json.loads(DASHBOARD.read_text())
    exprs = [
        t["expr"] for panel in board["panels"] for t in panel.get("targets", []) if "expr" in t
    ]
    assert len(exprs) >= 8
    used = {m for e in exprs for m in re.findall(r"\bvpnrepl_[a-z_]+", e)}
    # every family the node can expose, with its sample suffixes
    exposed = set(PER_VPN + COUNTERS) | {
        "vpnrepl_epoch",
        "vpnrepl_vpn_info",
        "vpnrepl_txn_total",
        "vpnrepl_txn_applied_ahead_total",
        "vpnrepl_protocol_closes_total",
        "vpnrepl_node_leads",
    }
    for hist in ("vpnrepl_confirm_delay_seconds", "vpnrepl_ledger_commit_entries"):
        exposed |= {f"{hist}_bucket", f"{hist}_count", f"{hist}_sum"}
    assert used <= exposed, used - exposed
    for needed in ("vpnrepl_replication_lag_seconds", "vpnrepl_confirm_delay_seconds_bucket"):
        assert needed in used
