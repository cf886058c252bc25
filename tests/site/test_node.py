"""``vpnrepl node`` on an active site: listener, ledger, confirms, status."""

from __future__ import annotations

import time

import pika
import psycopg
import pytest
from pika.exceptions import NackError

from bridge import EVENT_KINDS, INCARNATION_LIMIT
from plugin.devtools import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.prometheus import value

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _setup_vhost(site: LocalSite) -> None:
    site.rabbit.add_vhost("orders")
    conn = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url("orders")))
    ch = conn.channel()
    ch.exchange_declare("events", "topic", durable=True)
    for q in ("orders.q1", "orders.q2", "audit"):
        ch.queue_declare(q, durable=True)
        ch.queue_bind(q, "events", "order.#" if q != "audit" else "#")
    conn.close()


def _enable_orders(vpnrepl: Vpnrepl, *options: str) -> None:
    result = vpnrepl("vpn", "enable", "orders", *options)
    assert result.returncode == 0, result.stderr


def _client(site: LocalSite) -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{site.amqp_port}/orders")
    )


def test_confirmed_publishes_are_in_the_ledger_and_consumption_is_mirrored(
    site_a: LocalSite, vpnrepl_a: Vpnrepl, node_a: NodeProcess
) -> None:
    _setup_vhost(site_a)
    _enable_orders(vpnrepl_a, "--role", "active", "--queues", r"orders\..*")
    node_a.start()
    conn = _client(site_a)
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(200):
        ch.basic_publish("events", "order.created", f"m{i}".encode(), PERSISTENT)
    ch.basic_qos(prefetch_count=100)
    for _ in range(80):
        method, _, _ = ch.basic_get("orders.q1")
        ch.basic_ack(method.delivery_tag)
    conn.close()

    with psycopg.connect(site_a.pg.dsn()) as db:
        published = db.execute(
            "SELECT count(*) FROM ledger WHERE vpn = 'orders' AND kind = 'published'"
        ).fetchone()[0]
        assert published == 200  # every confirmed publish is durable in the ledger
    # consumption events are durable shortly after the ack: status shows it
    queues = {}
    for _ in range(100):
        queues = node_a.status()["vpns"][0]["queues"]
        if queues.get("orders.q1") == 120:
            break
        time.sleep(0.05)
    assert queues == {"orders.q1": 120, "orders.q2": 200}
    cli = vpnrepl_a("status", "--json")
    assert '"orders.q1": 120' in cli.stdout
    metrics = node_a.get("/metrics")
    assert value(metrics, "vpnrepl_events_total", vpn="orders", kind="published") == 200
    assert node_a.stop() == 0


def test_the_events_metric_counts_every_ledger_entry_once_local_transactions_included(
    site_a: LocalSite, vpnrepl_a: Vpnrepl, node_a: NodeProcess
) -> None:
    """``vpnrepl_events_total`` is what entered the ledger, by kind: the
    publishes and acks of a committed local transaction (tx_select,
    tx_commit through the listener) count as the plain ones do, once; a
    rolled-back transaction's count nothing."""
    _setup_vhost(site_a)
    _enable_orders(vpnrepl_a, "--role", "active", "--queues", r"orders\..*")
    node_a.start()
    conn = _client(site_a)
    plain = conn.channel()
    plain.confirm_delivery()
    for i in range(5):
        plain.basic_publish("events", "order.created", f"plain {i}".encode(), PERSISTENT)
    tx = conn.channel()
    tx.tx_select()
    for i in range(4):
        tx.basic_publish("events", "order.created", f"tx {i}".encode(), PERSISTENT)
    for _ in range(3):
        method, _, _ = tx.basic_get("orders.q1")
        tx.basic_ack(method.delivery_tag)
    tx.tx_commit()
    tx.basic_publish("events", "order.created", b"rolled back", PERSISTENT)
    tx.tx_rollback()
    method, _, _ = plain.basic_get("orders.q2")
    plain.basic_ack(method.delivery_tag)
    conn.close()

    def ledger() -> dict[str, int]:
        with psycopg.connect(site_a.pg.dsn()) as db:
            rows = db.execute(
                "SELECT kind, count(*) FROM ledger WHERE vpn = 'orders' GROUP BY kind"
            ).fetchall()
        return {kind: int(n) for kind, n in rows}

    def metric() -> dict[str, int]:
        text = node_a.get("/metrics")
        kinds = EVENT_KINDS.values()
        counts = {k: value(text, "vpnrepl_events_total", vpn="orders", kind=k) for k in kinds}
        return {k: int(n) for k, n in counts.items() if n}

    deadline = time.monotonic() + 10
    while ledger() != {"published": 9, "consumed": 4} and time.monotonic() < deadline:
        time.sleep(0.05)  # the last ack is durable shortly after it
    assert ledger() == {"published": 9, "consumed": 4}
    assert metric() == ledger()
    assert node_a.stop() == 0


def test_sync_mode_without_a_standby_degrades_after_the_timeout(
    site_a: LocalSite, vpnrepl_a: Vpnrepl, node_a: NodeProcess
) -> None:
    _setup_vhost(site_a)
    _enable_orders(
        vpnrepl_a,
        "--role",
        "active",
        "--mode",
        "sync",
        "--sync-timeout-ms",
        "300",
        "--on-sync-timeout",
        "degrade",
    )
    node_a.start()
    conn = _client(site_a)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("events", "order.created", b"waits", PERSISTENT)  # confirmed after 300 ms
    ch.basic_publish("events", "order.created", b"ineligible", PERSISTENT)
    conn.close()
    vpn = node_a.status()["vpns"][0]
    assert vpn["sync_eligible"] is False
    assert "did not acknowledge" in node_a.log_text()
    # the window opened before either confirm went out, and stays open: no
    # standby caught up
    assert _windows(site_a) == [(1, 1, None)]
    assert [(w["first_index"], w["last_index"]) for w in vpn["sync_windows"]] == [(1, None)]
    assert vpn["sync_windows_total"] == 1
    assert node_a.stop() == 0
    with psycopg.connect(site_a.pg.dsn()) as db:
        row = db.execute("SELECT ledger_index FROM vpn_state WHERE vpn = 'orders'").fetchone()
    assert row is not None and row[0] >= 2
    # the next start closes it where the ledger ended: nothing was confirmed past it
    node_a.start()
    assert _windows(site_a) == [(1, 1, row[0])]
    assert "left open by a crash; closed at the ledger index" in node_a.log_text()
    assert node_a.stop() == 0


def _windows(site: LocalSite) -> list[tuple[int, int, int | None]]:
    with psycopg.connect(site.pg.dsn()) as db:
        return db.execute(
            "SELECT epoch, first_index, last_index FROM sync_window WHERE vpn = 'orders'"
            " ORDER BY epoch, first_index"
        ).fetchall()


def test_sync_mode_reject_nacks_without_a_standby(
    site_a: LocalSite, vpnrepl_a: Vpnrepl, node_a: NodeProcess
) -> None:
    _setup_vhost(site_a)
    _enable_orders(
        vpnrepl_a,
        "--role",
        "active",
        "--mode",
        "sync",
        "--sync-timeout-ms",
        "200",
        "--on-sync-timeout",
        "reject",
        "--queues",
        r"orders\..*",
    )
    node_a.start()
    conn = _client(site_a)
    ch = conn.channel()
    ch.confirm_delivery()
    with pytest.raises(NackError):
        ch.basic_publish("events", "order.created", b"rejected", PERSISTENT)
    ch.basic_publish("events", "invoice.x", b"out of scope: not held", PERSISTENT)
    conn.close()
    assert node_a.stop() == 0


def test_node_without_schema_fails_with_one_clear_line(vpnrepl_a: Vpnrepl, site_a: LocalSite):
    site_a.pg.reset()
    result = vpnrepl_a("node")
    assert result.returncode == 1
    assert "run `vpnrepl init`" in result.stderr


def test_a_site_out_of_incarnations_refuses_to_start_rather_than_repeat_ids(
    vpnrepl_a: Vpnrepl, site_a: LocalSite
) -> None:
    assert vpnrepl_a("init").returncode == 0
    with psycopg.connect(site_a.pg.dsn(), autocommit=True) as db:
        db.execute(
            "SELECT setval('node_incarnation_incarnation_seq', %s)", (INCARNATION_LIMIT - 1,)
        )
    result = vpnrepl_a("node")
    assert result.returncode == 1
    assert f"have room for {INCARNATION_LIMIT - 1}" in result.stderr
