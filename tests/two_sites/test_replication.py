"""Two sites end to end: unchanged pika clients on the active, the standby's
database mirrors the active's live state row for row."""

from __future__ import annotations

import pika

from plugin.devtools import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.two_sites import (
    assert_same_state,
    caught_up,
    live,
    live_caught_up,
    replicating,
    until,
)


def test_standby_mirrors_publishes_and_acks(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    conn, ch = replicating(vpnrepl_a, node_a, node_b)
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

    caught_up(node_a, node_b)
    live_caught_up(site_a)
    a_rows, b_rows = live(site_a), live(site_b)
    assert len(a_rows) == 600 + 999
    assert a_rows == b_rows  # (queue, id) for (queue, id), bodies and properties identical
    va, vb = node_a.status()["vpns"][0], node_b.status()["vpns"][0]
    assert va["queues"] == vb["queues"] == {"orders.q1": 600, "orders.q2": 999}
    assert (va["role"], vb["role"]) == ("active", "standby")
    assert va["bridge"] == vb["bridge"] == "connected"
    assert node_b.stop() == 0 and node_a.stop() == 0


def test_purge_and_delete_empty_the_standby_too_except_unsettled_deliveries(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    """RabbitMQ's purge leaves delivered, unacked messages in the queue (and a
    requeue puts them back); a delete takes everything. The standby must end
    with exactly what the active's broker still holds."""
    conn, ch = replicating(vpnrepl_a, node_a, node_b)
    for i in range(100):
        persistent = pika.BasicProperties(delivery_mode=2)
        ch.basic_publish("events", "order.created", b"m%d" % i, persistent)
    held = [ch.basic_get("orders.q1")[0].delivery_tag for _ in range(10)]
    admin = conn.channel()
    assert admin.queue_purge("orders.q1").method.message_count == 90
    for tag in held[5:]:
        ch.basic_ack(tag)
    ch.basic_nack(held[4], multiple=True, requeue=True)  # the first five go back
    admin.queue_delete("orders.q2")
    conn.close()

    rows = assert_same_state(node_a, node_b)
    assert sorted(bytes(r[6]) for r in rows) == sorted(b"m%d" % i for i in range(5))
    assert {r[0] for r in rows} == {"orders.q1"}
    check = pika.BlockingConnection(pika.URLParameters(site_a.rabbit.amqp_url("orders")))
    assert check.channel().queue_declare("orders.q1", passive=True).method.message_count == 5
    check.close()
    assert node_b.stop() == 0 and node_a.stop() == 0


def test_a_queue_deleted_at_the_broker_directly_goes_on_the_standby_too(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    """The node notices at its next definitions re-read; an exclusive queue,
    which the definitions leave out, is checked with the broker and kept."""
    text = node_a.config.read_text()
    node_a.config.write_text(text.replace("[broker]\n", "[broker]\ntopology_refresh_seconds = 1\n"))
    conn, ch = replicating(vpnrepl_a, node_a, node_b)
    ch.queue_declare("orders.mine", exclusive=True)
    ch.queue_bind("orders.mine", "events", "order.#")
    for i in range(20):
        persistent = pika.BasicProperties(delivery_mode=2)
        ch.basic_publish("events", "order.created", b"m%d" % i, persistent)
    site_a.rabbit.api("DELETE", "queues/orders/orders.q2")
    until(lambda: {r[0] for r in live(site_b)} == {"orders.q1", "orders.mine"}, "q2 gone on B")
    rows = assert_same_state(node_a, node_b)
    assert sorted(r[0] for r in rows) == ["orders.mine"] * 20 + ["orders.q1"] * 20
    conn.close()
    assert node_b.stop() == 0 and node_a.stop() == 0


def test_rejected_messages_dead_lettered_by_the_broker_are_moved_on_the_standby_too(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    conn, ch = replicating(vpnrepl_a, node_a, node_b)
    ch.exchange_declare("orders.dlx", "fanout")
    ch.queue_declare("orders.dead", durable=True)
    ch.queue_bind("orders.dead", "orders.dlx")
    ch.queue_declare(
        "orders.work", durable=True, arguments={"x-dead-letter-exchange": "orders.dlx"}
    )
    ch.queue_bind("orders.work", "events", "work.*")
    for i in range(10):
        persistent = pika.BasicProperties(delivery_mode=2)
        ch.basic_publish("events", "work.x", b"w%d" % i, persistent)
    tags = [ch.basic_get("orders.work")[0].delivery_tag for _ in range(6)]
    for tag in tags[:3]:
        ch.basic_reject(tag, requeue=False)
    ch.basic_nack(tags[4], multiple=True, requeue=False)  # tags 4 and 5
    ch.basic_ack(tags[5])

    def dead() -> int:
        return ch.queue_declare("orders.dead", passive=True).method.message_count

    until(lambda: dead() == 5, "the broker dead-lettered five")
    method, props, body = ch.basic_get("orders.dead")
    assert body == b"w0" and props.headers["x-death"][0]["queue"] == "orders.work"
    ch.basic_ack(method.delivery_tag)
    conn.close()

    rows = assert_same_state(node_a, node_b)
    by_queue = sorted((r[0], bytes(r[6])) for r in rows)
    assert by_queue == [("orders.dead", b"w%d" % i) for i in range(1, 5)] + [
        ("orders.work", b"w%d" % i) for i in range(6, 10)
    ]
    assert node_b.stop() == 0 and node_a.stop() == 0
