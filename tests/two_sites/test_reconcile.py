"""``vpnrepl reconcile`` on the two-site harness: divergence injected into
the standby's store is found exactly, per kind; ``--repair`` makes the sites
identical, which a second run confirms; a live workload causes no reported
difference; publishes that bypass the listener show as broker drift."""

from __future__ import annotations

import json
from typing import Any

import pika
import psycopg
import pytest

from plugin.devtools import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.fix_sites import role_dsn
from tests.support.prometheus import value
from tests.support.two_sites import (
    VPN,
    ConsumerThread,
    Publisher,
    assert_same_state,
    enable,
    live,
    setup_vpn,
    until,
)

#: the harness's RabbitMQ refreshes its statistics every second
DRIFT = "\n[reconcile]\ndrift_interval = 2\n"


def _reconcile(vpnrepl: Vpnrepl, *args: str) -> tuple[int, dict[str, Any], str]:
    done = vpnrepl("reconcile", VPN, "--json", "--segments", "64", *args)
    doc = json.loads(done.stdout) if done.stdout.strip() else {}
    return done.returncode, doc, done.stderr


def _inject(site: LocalSite) -> dict[str, int]:
    """Divergence on the standby: rows deleted, extra rows, bodies altered,
    across both queues; returns the counts per kind."""
    with psycopg.connect(site.pg.dsn(), autocommit=True) as db:
        gone = db.execute(
            "DELETE FROM live_message WHERE ctid IN (SELECT ctid FROM live_message"
            " WHERE vpn = %s AND queue = %s ORDER BY publish_index LIMIT %s)",
            (VPN, "orders.q1", 5),
        ).rowcount
        gone += db.execute(
            "DELETE FROM live_message WHERE ctid IN (SELECT ctid FROM live_message"
            " WHERE vpn = %s AND queue = %s ORDER BY publish_index DESC LIMIT %s)",
            (VPN, "orders.q2", 3),
        ).rowcount
        extra = 0
        for n, queue in enumerate(("orders.q1", "orders.q2", "orders.q2", "orders.q1")):
            db.execute(
                "INSERT INTO live_message (vpn, queue, repl_id, publish_index, exchange,"
                " routing_key, properties, body) VALUES (%s, %s, %s, 1, 'events', 'x', '', 'y')",
                (VPN, queue, bytes(15) + bytes([n + 1])),
            )
            extra += 1
        altered = db.execute(
            "UPDATE live_message SET body = body || 'tampered' WHERE ctid IN (SELECT ctid"
            " FROM live_message WHERE vpn = %s ORDER BY publish_index OFFSET 100 LIMIT 6)",
            (VPN,),
        ).rowcount
    return {"missing_on_standby": gone, "extra_on_standby": extra, "differs": altered}


def _bypass(site: LocalSite, n: int) -> None:
    """``n`` persistent publishes to orders.q1 straight at site's broker,
    not through the listener: never replicated, so the broker holds more
    than the site replicated (broker drift)."""
    conn = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url(VPN)))
    ch = conn.channel()
    for i in range(n):
        ch.basic_publish("", "orders.q1", b"bypass %d" % i, pika.BasicProperties(delivery_mode=2))
    conn.close()


def _reader_dsn(site: LocalSite) -> str:
    """A role on ``site``'s store with the README's grants for reconcile
    (nothing else: not the password hashes in ``vpn_config.definitions``)."""
    return role_dsn(
        site,
        "vpnrepl_reader",
        "SELECT ON live_message, vpn_state TO {role}",
        "SELECT (name, enabled, role, epoch, queue_patterns, topic_filters) ON vpn_config"
        " TO {role}",
    )


@pytest.fixture
def two_sites(
    vpnrepl_a: Vpnrepl, node_a: NodeProcess, node_b: NodeProcess
) -> tuple[Vpnrepl, NodeProcess, NodeProcess]:
    setup_vpn(node_a.site)
    enable(vpnrepl_a)
    vpnrepl_a.set_peer_store(_reader_dsn(node_b.site))  # the standby's store, read-only
    with open(vpnrepl_a.config, "a") as f:
        f.write(DRIFT)
    node_a.start()
    node_b.start()
    return vpnrepl_a, node_a, node_b


#: the default suite compares with the default method (each run is a Spark
#: job of about 20 s on 2 cores); -m fault adds the JDBC one and a last run
#: that finds nothing left after the repair
METHODS = [
    pytest.param(("pushdown",), id="pushdown"),
    pytest.param(("pushdown", "jdbc"), id="both-methods-and-a-check", marks=pytest.mark.fault),
]


@pytest.mark.parametrize("methods", METHODS)
def test_injected_divergence_and_broker_drift_are_found_exactly_and_the_divergence_repaired(
    two_sites: tuple[Vpnrepl, NodeProcess, NodeProcess], methods: tuple[str, ...]
) -> None:
    vpnrepl, node_a, node_b = two_sites
    published = Publisher(node_a.site, range(1, 401)).run()
    assert published.error is None and len(published.confirmed) == 400
    assert_same_state(node_a, node_b)

    injected = _inject(node_b.site)
    assert injected == {"missing_on_standby": 8, "extra_on_standby": 4, "differs": 6}
    _bypass(node_a.site, 7)
    drift = {"orders.q1": {"broker": 320 + 7, "replicated": 320}}
    for method in methods:
        code, doc, err = _reconcile(vpnrepl, "--method", method)
        assert code == 3, err
        found = {k: doc[k] for k in injected}
        assert found == injected, (method, doc)
        assert doc["rows_active"] == 720  # 400 publishes, 320 of them routed to both queues
        assert doc["rows_standby"] == 720 - 8 + 4
        assert 0 < doc["dirty_segments"] <= 18
        assert doc["broker_drift"] == drift, doc

    code, doc, err = _reconcile(vpnrepl, "--repair")
    assert code == 0, err  # the sites agree again: drift is not part of the exit status
    assert doc["repaired"] == 18 and not any(doc["remaining"].values()), doc
    assert doc["broker_drift"] == drift, doc  # a repair copies sites, not the broker's extras
    assert "reconcile repair applied" in node_b.log_text()
    runs = [("differ", 8, 4, 6, 0)] * len(methods) + [("agree", 0, 0, 0, 18)]
    if len(methods) > 1:
        code, doc, err = _reconcile(vpnrepl)
        assert code == 0 and all(doc[k] == 0 for k in injected), doc
        runs.append(("agree", 0, 0, 0, 0))
    assert live(node_a.site) == live(node_b.site)

    with psycopg.connect(node_a.site.pg.dsn()) as db:
        assert (
            runs
            == db.execute(
                "SELECT outcome, missing_on_standby, extra_on_standby, differs, repaired"
                " FROM reconcile_run WHERE vpn = %s ORDER BY id",
                (VPN,),
            ).fetchall()
        )


@pytest.mark.fault  # 47 s; the divergence test reconciles under no load, by default
def test_a_live_workload_is_not_reported_as_divergence(
    two_sites: tuple[Vpnrepl, NodeProcess, NodeProcess],
) -> None:
    vpnrepl, node_a, node_b = two_sites
    Publisher(node_a.site, range(1, 3001)).run()
    publisher = Publisher(node_a.site, range(3001, 10**6), window=100).start()
    consumer = ConsumerThread(node_a.site, "orders.q1", remove=2000)
    consumer.start()
    try:
        code, doc, err = _reconcile(vpnrepl)
    finally:
        publisher.stop()
        publisher.join()
    consumer.finish()
    assert publisher.error is None
    assert code == 0, (doc, err)
    assert all(doc[k] == 0 for k in ("missing_on_standby", "extra_on_standby", "differs"))
    assert_same_state(node_a, node_b)


def test_reconcile_on_the_standby_or_of_an_unknown_vpn_says_what_to_do(
    two_sites: tuple[Vpnrepl, NodeProcess, NodeProcess],
) -> None:
    vpnrepl, node_a, node_b = two_sites
    Publisher(node_a.site, range(1, 11)).run()
    assert_same_state(node_a, node_b)
    on_b = Vpnrepl(node_b.config)  # its peer's store_dsn is site a's store
    code, _, err = _reconcile(on_b)
    assert code == 1 and "is standby at" in err and "run reconcile with the active" in err
    unknown = vpnrepl("reconcile", "nope")
    assert unknown.returncode == 1 and "VPN 'nope' is not enabled" in unknown.stderr
    bad = vpnrepl("reconcile", VPN, "--segments", "0")
    assert bad.returncode == 2 and "expected 1 to 65536 segments" in bad.stderr


def test_the_node_reconciles_on_its_schedule_and_exports_the_result(
    vpnrepl_a: Vpnrepl, node_a: NodeProcess, node_b: NodeProcess
) -> None:
    setup_vpn(node_a.site)
    enable(vpnrepl_a)
    with open(vpnrepl_a.config, "a") as f:  # (its peer's store_dsn is site b's)
        f.write("\n[reconcile]\ninterval = 10\nsegments = 32\ndrift_interval = 2\n")
    node_a.start()
    node_b.start()
    Publisher(node_a.site, range(1, 51)).run()
    assert_same_state(node_a, node_b)
    with psycopg.connect(node_b.site.pg.dsn(), autocommit=True) as db:
        db.execute("DELETE FROM live_message WHERE ctid IN (SELECT ctid FROM live_message LIMIT 2)")

    def ran() -> bool:
        with psycopg.connect(node_a.site.pg.dsn()) as db:
            row = db.execute("SELECT count(*) FROM reconcile_run WHERE vpn = %s", (VPN,)).fetchone()
        return bool(row and row[0])

    until(ran, "a scheduled reconcile run", 120)
    metrics = node_a.get("/metrics")
    assert value(metrics, "vpnrepl_reconcile_differences", vpn=VPN, kind="missing_on_standby") == 2
    assert value(metrics, "vpnrepl_reconcile_agree", vpn=VPN) == 0
    assert value(metrics, "vpnrepl_reconcile_last_run_timestamp_seconds", vpn=VPN) > 0
    line = "scheduled reconcile of VPN orders: the sites DIFFER (missing on standby 2"
    until(lambda: line in node_a.log_text(), "the node to log the run", 30)
    table = vpnrepl_a("status").stdout
    assert "last reconcile" in table and "2 differences left" in table
