"""The listener (plugin/listener/_server.py) in front of a real RabbitMQ: relay,
interception, refusal."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable

import aiormq
import pika
import pytest
from pika.exceptions import (
    ChannelClosedByBroker,
    ProbableAccessDeniedError,
    ProbableAuthenticationError,
)

from bridge import (
    MARKER_QUEUE,
    Consumed,
    LocalTransaction,
    Published,
    Purged,
    Role,
    TransactionRefused,
)
from plugin.devtools import LocalSite, free_port
from plugin.listener import MemorySink
from tests.fix_listener import ListenerThread, enable_vpn
from tests.support.markers import marker_bodies
from tests.support.two_sites import setup_vpn
from txn.local import MARKER_ARGUMENTS

PERSISTENT = pika.BasicProperties(delivery_mode=2)
TRANSIENT = pika.BasicProperties(delivery_mode=1)


def _events(sink: MemorySink, kind: type) -> list:
    return [e for e in sink.events if isinstance(e, kind)]


def test_unreplicated_vhost_is_relayed_untouched(site_a: LocalSite, listener_a: ListenerThread):
    site_a.rabbit.add_vhost("plain")
    conn = pika.BlockingConnection(pika.URLParameters(listener_a.url("plain")))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("q", durable=True)
    for i in range(50):
        ch.basic_publish("", "q", f"m{i}".encode(), PERSISTENT)
    bodies = []
    for _ in range(50):
        _, props, body = ch.basic_get("q", auto_ack=True)
        bodies.append(body)
        assert props.headers is None  # no replication header outside replicated VPNs
    conn.close()
    assert bodies == [f"m{i}".encode() for i in range(50)]
    assert listener_a.sink.events == []


def test_sink_sees_one_event_per_persistent_in_scope_publish(
    site_a: LocalSite, listener_a: ListenerThread
):
    setup_vpn(site_a)
    enable_vpn(listener_a, site_a, "orders", queues=(r"orders\..*",))
    conn = pika.BlockingConnection(pika.URLParameters(listener_a.url("orders")))
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(20):
        ch.basic_publish("events", "order.created", f"p{i}".encode(), PERSISTENT)
    for i in range(5):
        ch.basic_publish("events", "order.created", f"t{i}".encode(), TRANSIENT)
    for i in range(5):  # reaches only `audit`, which is out of scope
        ch.basic_publish("events", "invoice.sent", f"a{i}".encode(), PERSISTENT)
    conn.close()
    published = _events(listener_a.sink, Published)
    assert [e.body for e in published] == [f"p{i}".encode() for i in range(20)]
    assert {e.queues for e in published} == {("orders.q1", "orders.q2")}
    assert len({e.repl_id for e in published}) == 20
    assert all(e.vpn == "orders" and e.exchange == "events" for e in published)


def test_consumption_events_for_acks_nacks_and_no_ack_but_not_requeues(
    site_a: LocalSite, listener_a: ListenerThread
):
    setup_vpn(site_a)
    enable_vpn(listener_a, site_a, "orders", queues=(r"orders\.q1",))
    conn = pika.BlockingConnection(pika.URLParameters(listener_a.url("orders")))
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(10):
        ch.basic_publish("events", "order.x", f"m{i}".encode(), PERSISTENT)
    ids = {e.body: e.repl_id for e in _events(listener_a.sink, Published)}

    got = []
    for _ in range(6):
        method, props, body = ch.basic_get("orders.q1")
        assert props.headers is None  # as published: our id header is cut out
        got.append((method.delivery_tag, body))
    ch.basic_ack(got[1][0], multiple=True)  # m0, m1
    ch.basic_nack(got[2][0], requeue=False)  # m2 consumed (dropped)
    ch.basic_reject(got[4][0], requeue=False)  # m4 consumed
    _, _, body = ch.basic_get("orders.q1", auto_ack=True)  # no-ack get: m6
    assert body == b"m6"
    ch.basic_nack(got[3][0], requeue=True)  # m3 back to the queue
    ch.basic_reject(got[5][0], requeue=True)  # m5 back
    _, _, body = ch.basic_get("orders.q1")  # the requeued m3, redelivered
    assert body == b"m3"
    conn.close()  # unacked redeliveries return to the queue: no event

    consumed = _events(listener_a.sink, Consumed)
    assert [(c.repl_id, c.queue) for c in consumed] == [
        (ids[b], "orders.q1") for b in (b"m0", b"m1", b"m2", b"m4", b"m6")
    ]


def test_consumer_with_manual_and_auto_ack(site_a: LocalSite, listener_a: ListenerThread):
    setup_vpn(site_a)
    enable_vpn(listener_a, site_a, "orders")  # no filters: every queue in scope
    conn = pika.BlockingConnection(pika.URLParameters(listener_a.url("orders")))
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(30):
        ch.basic_publish("events", "order.y", f"m{i}".encode(), PERSISTENT)
    published = _events(listener_a.sink, Published)
    assert {e.queues for e in published} == {("audit", "orders.q1", "orders.q2")}

    seen = []

    def on_msg(channel, method, props, body):
        seen.append(body)
        if len(seen) % 10 == 0:
            channel.basic_ack(method.delivery_tag, multiple=True)

    ch.basic_qos(prefetch_count=50)
    ch.basic_consume("orders.q1", on_msg)
    ch.basic_consume("audit", lambda *a: seen.append(a[3]), auto_ack=True)
    deadline = time.monotonic() + 10
    while len(seen) < 60 and time.monotonic() < deadline:
        conn.process_data_events(0.1)
    conn.close()
    consumed = Counter((c.queue) for c in _events(listener_a.sink, Consumed))
    assert consumed == {"orders.q1": 30, "audit": 30}


def test_transaction_events_reach_the_sink_only_on_commit(
    site_a: LocalSite, listener_a: ListenerThread
):
    setup_vpn(site_a)
    enable_vpn(listener_a, site_a, "orders", queues=(r"orders\.q1",))
    sink = listener_a.sink
    conn = pika.BlockingConnection(pika.URLParameters(listener_a.url("orders")))
    ch = conn.channel()
    ch.tx_select()
    ch.basic_publish("events", "order.a", b"rolled-back", PERSISTENT)
    ch.tx_rollback()
    ch.basic_publish("events", "order.a", b"c1", PERSISTENT)
    ch.basic_publish("events", "order.a", b"c2", PERSISTENT)
    ch.tx_commit()
    assert [e.body for e in _events(sink, Published)] == [b"c1", b"c2"]
    assert len(sink.committed) == 1 and len(sink.prepared) == 1

    method, _, body = ch.basic_get("orders.q1")
    ch.basic_ack(method.delivery_tag)
    ch.tx_rollback()  # the ack is undone: still unacked
    assert _events(sink, Consumed) == []
    ch.basic_ack(method.delivery_tag)  # acking again after rollback is legal
    ch.tx_commit()
    conn.close()
    assert [c.repl_id for c in _events(sink, Consumed)] == [_events(sink, Published)[0].repl_id]


class RefusingSink(MemorySink):
    """Refuses every prepare: at the call (as a fenced VPN's sink does) or
    from the awaitable (as the coordinator does when the standby did not
    vote in time)."""

    def __init__(self, at_call: bool) -> None:
        super().__init__()
        self.at_call = at_call

    @property
    def reason(self) -> str:
        if self.at_call:
            return "VPN 'orders' is fenced: a standby was promoted"
        return "the standby did not prepare in time (5 ms); nothing was applied"

    def prepare(self, txn: LocalTransaction) -> Awaitable[None]:
        if self.at_call:
            raise TransactionRefused(self.reason)
        return self._refuse()

    async def _refuse(self) -> None:
        raise TransactionRefused(self.reason)


@pytest.mark.parametrize("at_call", [True, False], ids=["at the call", "when awaited"])
def test_a_refused_prepare_closes_the_channel_and_commits_nothing(
    site_a: LocalSite, at_call: bool
) -> None:
    setup_vpn(site_a)
    lt = ListenerThread(site_a.rabbit.amqp_port, RefusingSink(at_call))
    try:
        enable_vpn(lt, site_a, "orders", queues=(r"orders\.q1",))
        conn = pika.BlockingConnection(pika.URLParameters(lt.url("orders")))
        ch = conn.channel()
        ch.queue_purge("orders.q1")
        ch.tx_select()
        ch.basic_publish("events", "order.a", b"not-committed", PERSISTENT)
        with pytest.raises(ChannelClosedByBroker) as refused:
            ch.tx_commit()
        assert refused.value.reply_code == 406
        reason = RefusingSink(at_call).reason
        assert refused.value.reply_text == f"transaction not committed: {reason}"
        ch = conn.channel()  # the connection stays open
        assert ch.queue_declare("orders.q1", passive=True).method.message_count == 0
        conn.close()
    finally:
        lt.stop()
    sink = lt.sink
    assert isinstance(sink, RefusingSink)
    assert sink.committed == [] and _events(sink, Published) == []


async def _nowait_purge_then_refused_nowait_delete(url: str) -> tuple[str, int]:
    """aiormq (which sends nowait when asked) through the listener: a nowait
    purge, a publish, then a nowait delete if-empty the broker refuses.
    Returns the refusal (aiormq's exception for a 406) and the queue's
    depth afterwards."""
    persistent = aiormq.spec.Basic.Properties(delivery_mode=2)
    conn = await aiormq.connect(url)
    try:
        ch = await conn.channel()
        await ch.basic_publish(b"before", routing_key="orders.q1", properties=persistent)
        assert await ch.queue_purge("orders.q1", nowait=True) is None
        await ch.basic_publish(b"after", routing_key="orders.q1", properties=persistent)
        assert await ch.queue_delete("orders.q1", if_empty=True, nowait=True) is None
        try:
            await ch.queue_declare("orders.q1", passive=True)
            refusal = "none"
        except aiormq.exceptions.AMQPError as e:
            refusal = type(e).__name__
        check = await conn.channel()  # the connection stays open
        depth = (await check.queue_declare("orders.q1", passive=True)).message_count
        return refusal, depth
    finally:
        await conn.close()


def test_a_nowait_purge_and_a_refused_nowait_delete_replicate_what_the_broker_did(
    site_a: LocalSite, listener_a: ListenerThread
) -> None:
    """The broker refused the delete (the queue is not empty): the standby
    must not drop the queue's messages either. The purge came before the
    second publish at the broker, and comes before it in the events."""
    setup_vpn(site_a)
    enable_vpn(listener_a, site_a, "orders", queues=(r"orders\.q1",))
    code, depth = asyncio.run(_nowait_purge_then_refused_nowait_delete(listener_a.url("orders")))
    assert (code, depth) == ("ChannelPreconditionFailed", 1)
    events = [e for e in listener_a.sink.events if isinstance(e, Published | Purged)]
    assert [(type(e).__name__, getattr(e, "body", None)) for e in events] == [
        ("Published", b"before"),
        ("Purged", None),
        ("Published", b"after"),
    ]
    purged = events[1]
    assert isinstance(purged, Purged) and purged.queue == "orders.q1" and not purged.deleted


def test_standby_vhost_refuses_clients_with_530(site_a: LocalSite, listener_a: ListenerThread):
    site_a.rabbit.add_vhost("orders")
    enable_vpn(listener_a, site_a, "orders", role=Role.STANDBY)
    with pytest.raises(ProbableAccessDeniedError, match=r"\(530\) .*replication standby"):
        pika.BlockingConnection(pika.URLParameters(listener_a.url("orders")))


def test_broker_down_gives_a_clean_close_not_a_hang(site_a: LocalSite):
    lt = ListenerThread(free_port())  # nothing listens there
    try:
        # pika files a close during the handshake under "probable authentication
        # error"; what matters is the reply code and text, not a socket timeout
        with pytest.raises(ProbableAuthenticationError, match=r"\(320\) .*broker unavailable"):
            pika.BlockingConnection(pika.URLParameters(lt.url("/", socket_timeout="10")))
    finally:
        lt.stop()


def test_a_client_cannot_read_or_write_the_commit_markers(
    site_a: LocalSite, listener_a: ListenerThread
):
    setup_vpn(site_a)
    enable_vpn(listener_a, site_a, "orders", queues=("orders.q1",))
    admin = pika.BlockingConnection(pika.URLParameters(site_a.rabbit.amqp_url("orders")))
    admin.channel().queue_declare(MARKER_QUEUE, durable=True, arguments=MARKER_ARGUMENTS)
    admin.close()
    conn = pika.BlockingConnection(pika.URLParameters(listener_a.url("orders")))
    try:
        with pytest.raises(ChannelClosedByBroker) as refused:
            conn.channel().basic_get(MARKER_QUEUE)
        assert refused.value.reply_code == 403
        assert "vpn-replication's own" in refused.value.reply_text
        forger = conn.channel()
        forger.basic_publish(
            "",
            "orders.q1",
            b"forged marker",
            pika.BasicProperties(delivery_mode=2, headers={"CC": [MARKER_QUEUE]}),
        )
        with pytest.raises(ChannelClosedByBroker) as refused:
            forger.basic_get("orders.q1")  # the refusal arrives on the next round trip
        assert refused.value.reply_code == 403
        assert conn.channel().queue_declare("orders.q1", durable=True)  # the rest works
    finally:
        conn.close()
    admin = pika.BlockingConnection(pika.URLParameters(site_a.rabbit.amqp_url("orders")))
    try:
        ch = admin.channel()
        assert ch.queue_declare("orders.q1", passive=True).method.message_count == 0
    finally:
        admin.close()
    assert marker_bodies(site_a.rabbit.amqp_url("orders")) == []


def test_past_max_connections_a_client_is_refused_with_320_and_no_broker_connection(
    site_a: LocalSite, listener_a: ListenerThread
):
    listener_a.listener.max_connections = 1
    first = pika.BlockingConnection(pika.URLParameters(listener_a.url("/")))
    try:
        with pytest.raises(ProbableAuthenticationError, match=r"\(320\) .*max_connections"):
            pika.BlockingConnection(pika.URLParameters(listener_a.url("/", socket_timeout="10")))
        assert listener_a.listener.stats.connections_refused == 1
        assert first.is_open
    finally:
        first.close()
    pika.BlockingConnection(pika.URLParameters(listener_a.url("/"))).close()  # room again


def test_metrics_count_connections_and_protocol_closes(
    site_a: LocalSite, listener_a: ListenerThread
):
    import socket
    import struct

    from plugin.admin import Metrics
    from tests.support.prometheus import value

    setup_vpn(site_a)
    enable_vpn(listener_a, site_a, "orders", queues=(r"orders\.q1",))
    conn = pika.BlockingConnection(pika.URLParameters(listener_a.url("orders")))
    ch = conn.channel()
    ch.confirm_delivery()
    for _ in range(3):
        ch.basic_publish("events", "order.z", b"x", PERSISTENT)
    conn.close()
    with socket.create_connection(("127.0.0.1", listener_a.port), timeout=10) as raw:
        raw.sendall(
            b"AMQP\x00\x00\x09\x01" + struct.pack(">BHI", 1, 0, 4) + b"\x00\x0a\x00\x0b\x00"
        )
        while raw.recv(4096):  # the listener closes after its connection.close
            pass
    metrics = Metrics()
    metrics.observe_listener(listener_a.listener.stats)
    text = metrics.render().decode()
    # vpnrepl_events_total counts ledger entries (the writer's; see tests/site/test_node.py)
    assert value(text, "vpnrepl_protocol_closes_total", reply_code="501") == 1
    assert value(text, "vpnrepl_client_connections_total") == 2
    # the three confirms were held for the ledger commit, and counted
    assert value(text, "vpnrepl_confirm_delay_seconds_count", vpn="orders", mode="async") == 3


def test_stopping_the_listener_closes_clients_with_320_not_a_dropped_socket(
    site_a: LocalSite,
):
    lt = ListenerThread(site_a.rabbit.amqp_port)
    conn = pika.BlockingConnection(pika.URLParameters(lt.url("/")))
    conn.channel().queue_declare("still.open")
    lt.stop()
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as info:
        conn.process_data_events(1)
        conn.channel()
    assert info.value.reply_code == 320
    assert "shutting down" in info.value.reply_text
