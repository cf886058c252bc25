"""Two sites end to end: unchanged pika clients on the active, the standby's
database mirrors the active's live state row for row."""

from __future__ import annotations

import time

import pika
import psycopg

from plugin._localsites import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess

PERSISTENT = pika.BasicProperties(delivery_mode=2)
LIVE = (
    "SELECT queue, repl_id, publish_index, exchange, routing_key, properties, body "
    "FROM live_message WHERE vpn = 'orders' ORDER BY queue, publish_index"
)


def _setup(site: LocalSite) -> None:
    site.rabbit.add_vhost("orders")
    conn = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url("orders")))
    ch = conn.channel()
    ch.exchange_declare("events", "topic", durable=True)
    for q, key in (("orders.q1", "order.*"), ("orders.q2", "order.#"), ("audit", "#")):
        ch.queue_declare(q, durable=True)
        ch.queue_bind(q, "events", key)
    conn.close()


def _live(site: LocalSite) -> list[tuple]:
    with psycopg.connect(site.pg.dsn()) as db:
        return db.execute(LIVE).fetchall()


def _live_applied(site: LocalSite) -> bool:
    """The active's live state reflects its whole ledger (it is applied after
    the ledger commit, in a transaction of its own)."""
    with psycopg.connect(site.pg.dsn()) as db:
        row = db.execute(
            "SELECT s.ledger_index = l.live_index FROM vpn_state s"
            " JOIN vpn_live_state l USING (vpn) WHERE s.vpn = 'orders'"
        ).fetchone()
    return bool(row and row[0])


def _wait_caught_up(a: NodeProcess, b: NodeProcess, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        va, vb = a.status()["vpns"], b.status()["vpns"]
        if (
            va
            and vb
            and va[0]["ledger_index"] == vb[0]["applied_index"] == va[0]["applied_index"]
            and _live_applied(a.site)
        ):
            return
        time.sleep(0.1)
    raise AssertionError(f"standby not caught up: {a.status()} / {b.status()}")


def test_standby_mirrors_publishes_and_acks(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    _setup(site_a)
    assert (
        vpnrepl_a(
            "vpn", "enable", "orders", "--role", "active", "--queues", r"orders\..*"
        ).returncode
        == 0
    )
    node_a.start()
    node_b.start()
    conn = pika.BlockingConnection(
        pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{site_a.amqp_port}/orders")
    )
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(1000):
        ch.basic_publish(
            "events",
            "order.created",
            b"m%d" % i,
            pika.BasicProperties(delivery_mode=2, message_id=f"id-{i}"),
        )
    tags = []
    for i in range(400):
        method, _, _ = ch.basic_get("orders.q1")
        tags.append(method.delivery_tag)
        if i % 4 == 3:
            ch.basic_ack(method.delivery_tag, multiple=True)
    ch.basic_nack(ch.basic_get("orders.q2")[0].delivery_tag, requeue=False)
    requeued = ch.basic_get("orders.q2")[0]
    ch.basic_nack(requeued.delivery_tag, requeue=True)
    conn.close()

    _wait_caught_up(node_a, node_b)
    a_rows, b_rows = _live(site_a), _live(site_b)
    assert len(a_rows) == 600 + 999
    assert a_rows == b_rows  # (queue, id) for (queue, id), bodies and properties identical
    va, vb = node_a.status()["vpns"][0], node_b.status()["vpns"][0]
    assert va["queues"] == vb["queues"] == {"orders.q1": 600, "orders.q2": 999}
    assert (va["role"], vb["role"]) == ("active", "standby")
    assert va["bridge"] == vb["bridge"] == "connected"
    assert node_b.stop() == 0 and node_a.stop() == 0
