"""The listener's session state machine, fed scripted byte streams (no servers)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings, strategies as st
from pamqp import commands, frame, header
from pamqp.body import ContentBody

from bridge import (
    COUNTER_LIMIT,
    INCARNATION_LIMIT,
    MARKER_QUEUE,
    Consumed,
    DeadLettered,
    IdSource,
    Published,
    Purged,
    ReplicationId,
    Role,
    TopologyChanged,
    amqp,
    binding_item,
    exchange_item,
    name_item,
    queue_item,
)
from plugin.listener import MemorySink, ReplicationSink
from plugin.session import Session
from plugin.topology import Policy, ReplicationScope, Topology, VpnDirectory, VpnView
from txn import MarkerKey

C = commands


def m(method, channel: int = 0) -> bytes:
    return frame.marshal(method, channel)


def content(channel: int, body: bytes, **props) -> bytes:
    hdr = header.ContentHeader(body_size=len(body), properties=C.Basic.Properties(**props))
    out = frame.marshal(hdr, channel)
    if body:
        out += frame.marshal(ContentBody(body), channel)
    return out


def publish(channel: int, body: bytes, queue: str = "q", mode: int = 2, **props) -> bytes:
    return m(C.Basic.Publish(exchange="", routing_key=queue), channel) + content(
        channel, body, delivery_mode=mode, **props
    )


def decode_all(chunks: list[bytes]) -> list[tuple[int, object]]:
    data = b"".join(chunks)
    out = []
    while data:
        n, channel, value = frame.unmarshal(data)
        out.append((channel, value))
        data = data[n:]
    return out


#: the site's commit-marker key the sessions of :func:`make_session` tag with
MARKERS = MarkerKey(bytes(32))


def make_session(role: Role = Role.ACTIVE, vhost: str = "orders") -> Session:
    topology = Topology(vhost)
    topology.declare_queue("q", {})
    topology.declare_queue("other", {})
    directory = VpnDirectory()
    directory.put(VpnView(vhost, role, ReplicationScope((r"q",)), topology))
    return Session(directory, IdSource(1), marker_key=MARKERS)


def open_session(session: Session, vhost: str = "orders") -> None:
    session.client_data(amqp.PROTOCOL_HEADER)
    session.broker_data(m(C.Connection.Start(mechanisms="PLAIN", locales="en_US")))
    session.client_data(m(C.Connection.StartOk(response="\0guest\0guest")))
    session.broker_data(m(C.Connection.Tune(channel_max=2047, frame_max=131072, heartbeat=60)))
    session.client_data(m(C.Connection.TuneOk(channel_max=2047, frame_max=131072, heartbeat=60)))
    out = session.client_data(m(C.Connection.Open(virtual_host=vhost)))
    assert out.to_client == []
    session.broker_data(m(C.Connection.OpenOk()))
    session.client_data(m(C.Channel.Open(), 1))
    session.broker_data(m(C.Channel.OpenOk(), 1))


@pytest.fixture
def confirming() -> Session:
    s = make_session()
    open_session(s)
    s.client_data(m(C.Confirm.Select(), 1))
    s.broker_data(m(C.Confirm.SelectOk(), 1))
    return s


def acks(out) -> list[tuple[str, int, bool]]:
    return [
        (type(v).__name__, v.delivery_tag, v.multiple)
        for _, v in decode_all(out.to_client)
        if isinstance(v, C.Basic.Ack | C.Basic.Nack)
    ]


def test_relayed_bytes_are_the_clients_own(confirming: Session) -> None:
    data = publish(1, b"x", queue="other", mode=2)
    out = confirming.client_data(data)
    assert b"".join(out.to_broker) == data
    assert out.events == []  # `other` is out of scope


def test_replicated_publish_carries_an_id_and_yields_one_event(confirming: Session) -> None:
    out = confirming.client_data(publish(1, b"hello", app_id="shop"))
    [(event, key)] = out.events
    assert isinstance(event, Published)
    assert (event.vpn, event.exchange, event.routing_key, event.queues, event.body) == (
        "orders",
        "",
        "q",
        ("q",),
        b"hello",
    )
    assert key == (1, 1)
    sent = decode_all(out.to_broker)
    hdr = sent[1][1]
    assert isinstance(hdr, header.ContentHeader)
    # the publisher sent no headers: the table is ours alone, and the value
    # (the id's wire form complemented) says so
    assert hdr.properties.headers == {"x-vpnrepl-id": ~event.repl_id.wire}
    assert hdr.properties.app_id == "shop"
    assert (
        event.properties
        == b"".join(out.to_broker)[
            len(m(C.Basic.Publish(exchange="", routing_key="q"), 1)) + 7 + 12 : -len(
                frame.marshal(ContentBody(b"hello"), 1)
            )
            - 1
        ]
    )


def test_transient_publish_is_not_replicated(confirming: Session) -> None:
    out = confirming.client_data(publish(1, b"t", mode=1))
    assert out.events == []


def test_confirms_wait_for_the_broker_and_the_sink(confirming: Session) -> None:
    s = confirming
    for i in range(3):
        s.client_data(publish(1, b"m%d" % i))
    # broker confirms all three at once: all still held for replication
    assert acks(s.broker_data(m(C.Basic.Ack(delivery_tag=3, multiple=True), 1))) == []
    # seq 2 durable first: released alone, seq 1 still held
    assert acks(s.replicated_done([((1, 2), True)])) == [("Ack", 2, False)]
    assert acks(s.replicated_done([((1, 1), True)])) == [("Ack", 1, False)]
    assert acks(s.replicated_done([((1, 3), True)])) == [("Ack", 3, False)]
    # nothing is ever released twice
    assert acks(s.replicated_done([((1, 3), True)])) == []


def test_a_ready_prefix_is_released_as_one_multiple_ack(confirming: Session) -> None:
    s = confirming
    for i in range(4):
        s.client_data(publish(1, b"m%d" % i))
    for seq in (1, 2, 3, 4):
        assert acks(s.replicated_done([((1, seq), True)])) == []  # broker not yet
    assert acks(s.broker_data(m(C.Basic.Ack(delivery_tag=4, multiple=True), 1))) == [
        ("Ack", 4, True)
    ]


def test_unreplicated_confirms_pass_a_held_one_individually(confirming: Session) -> None:
    s = confirming
    s.client_data(publish(1, b"held"))  # seq 1, replicated
    s.client_data(publish(1, b"free", queue="other"))  # seq 2, out of scope
    s.client_data(publish(1, b"transient", mode=1))  # seq 3, not persistent
    out = s.broker_data(m(C.Basic.Ack(delivery_tag=3, multiple=True), 1))
    # multiple=true must not span the held tag 1
    assert acks(out) == [("Ack", 2, False), ("Ack", 3, False)]
    assert acks(s.replicated_done([((1, 1), True)])) == [("Ack", 1, False)]


def test_sink_failure_and_broker_nack_become_nacks(confirming: Session) -> None:
    s = confirming
    s.client_data(publish(1, b"a"))
    s.client_data(publish(1, b"b"))
    s.broker_data(m(C.Basic.Ack(delivery_tag=1), 1))
    assert acks(s.replicated_done([((1, 1), False)])) == [("Nack", 1, False)]
    s.replicated_done([((1, 2), True)])
    assert acks(s.broker_data(m(C.Basic.Nack(delivery_tag=2), 1))) == [("Nack", 2, False)]


def test_unreplicated_connection_relays_confirm_frames_unchanged() -> None:
    s = Session(VpnDirectory(), IdSource(1))
    open_session(s, vhost="plain")
    s.client_data(m(C.Confirm.Select(), 1))
    s.client_data(publish(1, b"x"))
    frame_bytes = m(C.Basic.Ack(delivery_tag=1, multiple=True), 1)
    assert s.broker_data(frame_bytes).to_client == [frame_bytes]


def deliver(
    s: Session,
    tag: int,
    consumer: str,
    repl: ReplicationId | str | int | None,
    channel: int = 1,
    routing_key: str = "q",
):
    """A delivery whose id header holds ``repl``: an id (its int64 wire form,
    appended to the publisher's own empty table), or a raw header value (an
    earlier version's hex digits, a foreign value)."""
    value = repl.wire if isinstance(repl, ReplicationId) else repl
    headers = {"x-vpnrepl-id": value} if value is not None else None
    method = m(
        C.Basic.Deliver(
            consumer_tag=consumer, delivery_tag=tag, exchange="", routing_key=routing_key
        ),
        channel,
    )
    data = method + content(channel, b"body", headers=headers, delivery_mode=2)
    out = s.broker_data(data)
    ours = isinstance(repl, ReplicationId) or (
        isinstance(repl, str) and len(repl) == 32 and set(repl) <= set("0123456789abcdef")
    )
    # our header is cut out, so the consumer gets the publisher's (empty)
    # table; any other value is relayed untouched
    expected = method + content(channel, b"body", headers={}, delivery_mode=2) if ours else data
    assert b"".join(out.to_client) == expected
    return out


def test_acks_map_deliveries_to_consumption_events() -> None:
    s = make_session()
    open_session(s)
    s.client_data(m(C.Basic.Consume(queue="q", consumer_tag=""), 1))
    s.broker_data(m(C.Basic.ConsumeOk(consumer_tag="ctag-1"), 1))
    ids = [ReplicationId.from_parts(3, i) for i in range(1, 6)]
    for tag, rid in enumerate(ids, start=1):
        deliver(s, tag, "ctag-1", rid)
    deliver(s, 6, "ctag-1", None)  # predates replication: no id, no event
    events = []
    events += s.client_data(m(C.Basic.Ack(delivery_tag=2, multiple=True), 1)).events
    events += s.client_data(m(C.Basic.Nack(delivery_tag=3, requeue=True), 1)).events
    events += s.client_data(m(C.Basic.Reject(delivery_tag=4, requeue=False), 1)).events
    events += s.client_data(m(C.Basic.Ack(delivery_tag=6), 1)).events
    assert [(e.repl_id, e.queue) for e, _ in events] == [
        (ids[0], "q"),
        (ids[1], "q"),
        (ids[3], "q"),
    ]
    assert all(isinstance(e, Consumed) for e, _ in events)
    # closing the channel returns delivery 5 to the queue: no event
    out = s.client_data(
        m(C.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0), 1)
    )
    assert out.events == []


def test_no_ack_consumer_consumes_on_delivery() -> None:
    s = make_session()
    open_session(s)
    s.client_data(m(C.Basic.Consume(queue="q", consumer_tag="mine", no_ack=True), 1))
    s.broker_data(m(C.Basic.ConsumeOk(consumer_tag="mine"), 1))
    rid = ReplicationId.from_parts(INCARNATION_LIMIT - 1, COUNTER_LIMIT - 1)  # the largest
    out = deliver(s, 1, "mine", rid)
    [(event, _)] = out.events
    assert isinstance(event, Consumed) and event.repl_id == rid


def test_ids_in_an_earlier_versions_hex_form_still_map_to_consumptions() -> None:
    s = make_session()
    open_session(s)
    s.client_data(m(C.Basic.Consume(queue="q", consumer_tag="mine", no_ack=True), 1))
    s.broker_data(m(C.Basic.ConsumeOk(consumer_tag="mine"), 1))
    out = deliver(s, 1, "mine", "ab" * 16)
    [(event, _)] = out.events
    assert isinstance(event, Consumed) and event.repl_id.hex == "ab" * 16


@pytest.mark.parametrize("value", [-5, "not-an-id", "ab" * 15, "zz" * 16, 1.5])
def test_id_headers_that_are_not_ours_make_no_event(value: object) -> None:
    s = make_session()
    open_session(s)
    s.client_data(m(C.Basic.Consume(queue="q", consumer_tag="mine", no_ack=True), 1))
    s.broker_data(m(C.Basic.ConsumeOk(consumer_tag="mine"), 1))
    assert deliver(s, 1, "mine", value).events == []  # type: ignore[arg-type]


def test_external_authentication_is_refused_with_403() -> None:
    s = make_session()
    s.client_data(amqp.PROTOCOL_HEADER)
    s.broker_data(m(C.Connection.Start(mechanisms="PLAIN EXTERNAL", locales="en_US")))
    out = s.client_data(m(C.Connection.StartOk(mechanism="EXTERNAL", response="")))
    assert out.to_broker == [] and out.drop_broker  # the broker never sees it
    [(_, close)] = decode_all(out.to_client)
    assert isinstance(close, C.Connection.Close) and close.reply_code == 403
    assert "EXTERNAL" in close.reply_text and "PLAIN" in close.reply_text


def test_standby_vhost_is_refused_with_530() -> None:
    s = make_session(role=Role.STANDBY)
    s.client_data(amqp.PROTOCOL_HEADER)
    s.broker_data(m(C.Connection.Start(mechanisms="PLAIN", locales="en_US")))
    s.client_data(m(C.Connection.StartOk(response="\0guest\0guest")))
    s.broker_data(m(C.Connection.Tune(frame_max=131072)))
    s.client_data(m(C.Connection.TuneOk(frame_max=131072)))
    out = s.client_data(m(C.Connection.Open(virtual_host="orders")))
    assert out.to_broker == [] and out.drop_broker
    [(_, close)] = decode_all(out.to_client)
    assert isinstance(close, C.Connection.Close) and close.reply_code == 530
    assert "replication standby" in close.reply_text


def closing_code_to_client(out) -> int:
    closes = [v for _, v in decode_all(out.to_client) if isinstance(v, C.Connection.Close)]
    assert len(closes) == 1, out.to_client
    return closes[0].reply_code


def closing_code(out) -> int:
    to_broker = [v for _, v in decode_all(out.to_broker) if isinstance(v, C.Connection.Close)]
    assert len(to_broker) == 1  # upstream closed cleanly too
    return closing_code_to_client(out)


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (content(1, b"orphan"), 505),  # header without a publish
        (frame.marshal(ContentBody(b"orphan"), 1), 505),  # body without a header
        (
            m(C.Basic.Publish(exchange="", routing_key="q"), 1)
            + frame.marshal(header.ContentHeader(body_size=2), 1)
            + frame.marshal(ContentBody(b"too long"), 1),
            501,
        ),
        (
            m(C.Basic.Publish(exchange="", routing_key="q"), 1) + m(C.Basic.Ack(delivery_tag=1), 1),
            505,
        ),  # method while content expected
        (struct.pack(">BHI", 1, 1, 4) + struct.pack(">HH", 77, 7) + b"\xce", 503),
        (struct.pack(">BHI", 8, 1, 0) + b"\xce", 501),  # heartbeat on channel 1
        (struct.pack(">BHI", 3, 1, 300_000), 501),  # oversize
        (struct.pack(">BHI", 1, 1, 5) + b"\x00\x3c\x00\x28\x00" + b"\xce", 502),  # truncated
    ],
)
def test_bad_client_frames_close_with_the_right_code(data: bytes, code: int) -> None:
    s = make_session()
    open_session(s)
    assert closing_code(s.client_data(data)) == code
    # the client's close-ok and the broker's close-ok end the session
    s.client_data(m(C.Connection.CloseOk()))
    s.broker_data(m(C.Connection.CloseOk()))
    assert s.client_done and s.broker_done


def test_frames_before_a_fault_are_still_relayed() -> None:
    s = make_session()
    open_session(s)
    good = m(C.Basic.Ack(delivery_tag=1), 1)
    out = s.client_data(good + struct.pack(">BHI", 3, 1, 300_000))
    assert out.to_broker[0] == good


def test_wrong_protocol_header_gets_ours_back() -> None:
    s = make_session()
    out = s.client_data(b"AMQP\x01\x01\x00\x0a")
    assert out.to_client == [amqp.PROTOCOL_HEADER] and out.drop_broker


def test_transactions_hold_commit_until_prepared_and_commit_ok_until_committed() -> None:
    s = make_session()
    open_session(s)
    s.client_data(m(C.Tx.Select(), 1))
    s.broker_data(m(C.Tx.SelectOk(), 1))
    out = s.client_data(publish(1, b"a") + publish(1, b"b"))
    assert out.events == []  # buffered until commit
    out = s.client_data(m(C.Tx.Commit(), 1))
    assert out.to_broker == [] and len(out.prepare) == 1
    txn = out.prepare[0]
    assert [e.body for e in txn.events] == [b"a", b"b"]
    out = s.transaction_prepared(1)
    sent = decode_all(out.to_broker)
    # the commit marker goes inside the broker transaction, then the commit
    names = [v.name for _, v in sent]
    assert names == ["Basic.Publish", "ContentHeader", "ContentBody", "Tx.Commit"]
    assert sent[0][1].routing_key == MARKER_QUEUE and sent[0][1].exchange == ""
    assert sent[1][1].properties.delivery_mode == 2
    assert sent[2][1].value == MARKERS.body("orders", txn.txid)  # tagged with the site's key
    assert MARKERS.name_of("orders", sent[2][1].value) == txn.txid
    assert all(channel == 1 for channel, _ in sent)
    out = s.broker_data(m(C.Tx.CommitOk(), 1))
    assert out.to_client == [] and out.commit == [txn]
    out = s.transaction_committed(1)
    assert decode_all(out.to_client)[0][1].name == "Tx.CommitOk"


def test_refused_prepare_closes_the_channel_on_both_sides_with_406() -> None:
    s = make_session()
    open_session(s)
    s.client_data(m(C.Tx.Select(), 1))
    s.client_data(publish(1, b"a"))
    s.client_data(m(C.Tx.Commit(), 1))
    out = s.transaction_prepared(1, refused="the standby did not prepare in time")
    upstream = decode_all(out.to_broker)
    assert not any(isinstance(v, C.Tx.Commit | C.Basic.Publish) for _, v in upstream)
    [(ch_up, broker_close)] = upstream  # the broker rolls the transaction back
    assert ch_up == 1 and isinstance(broker_close, C.Channel.Close)
    [(ch_down, close)] = decode_all(out.to_client)
    assert ch_down == 1
    assert isinstance(close, C.Channel.Close) and close.reply_code == 406
    assert "the standby did not prepare in time" in close.reply_text
    # both close-oks are ours to swallow; the connection stays open
    assert s.client_data(m(C.Channel.CloseOk(), 1)).to_broker == []
    assert s.broker_data(m(C.Channel.CloseOk(), 1)).to_client == []
    assert not s.closing
    out = s.client_data(m(C.Channel.Open(), 1))  # the client may reopen the channel
    assert decode_all(out.to_broker)[0][1].name == "Channel.Open"


def refused_on_channel_1() -> Session:
    """A session whose transaction on channel 1 was refused at prepare: we
    are closing the channel on both sides."""
    s = make_session()
    open_session(s)
    s.client_data(m(C.Tx.Select(), 1))
    s.client_data(publish(1, b"a") + m(C.Tx.Commit(), 1))
    s.transaction_prepared(1, refused="no")
    return s


def test_a_channel_reopened_before_the_broker_closed_it_waits_for_the_broker() -> None:
    """pika reuses the channel number as soon as it has sent its close-ok;
    the broker may not have answered our close yet. The reopening (and what
    follows it) goes to the broker once it has, not before (a channel.open
    on a channel the broker is closing is a connection error) and not never
    (the client would wait for its open-ok for ever)."""
    s = refused_on_channel_1()
    out = s.client_data(
        m(C.Channel.CloseOk(), 1) + m(C.Channel.Open(), 1) + m(C.Queue.Declare(queue="q"), 1)
    )
    assert out.to_broker == []  # the broker is still closing channel 1
    out = s.broker_data(m(C.Channel.CloseOk(), 1))
    assert out.to_client == []
    assert [v.name for _, v in decode_all(out.to_broker)] == ["Channel.Open", "Queue.Declare"]
    out = s.broker_data(m(C.Channel.OpenOk(), 1))
    assert [v.name for _, v in decode_all(out.to_client)] == ["Channel.OpenOk"]


def test_a_fault_in_a_held_reopening_closes_the_connection_with_its_code() -> None:
    """The held frames are checked when they go, inside the broker's bytes:
    a fault among them closes both sides with AMQP like any client fault."""
    s = refused_on_channel_1()
    orphan = content(1, b"orphan")  # a content header without its publish
    held = s.client_data(m(C.Channel.CloseOk(), 1) + m(C.Channel.Open(), 1) + orphan)
    assert held.to_broker == [] and held.to_client == []
    out = s.broker_data(m(C.Channel.CloseOk(), 1))
    assert closing_code(out) == 505
    assert [v.name for _, v in decode_all(out.to_broker)] == ["Channel.Open", "Connection.Close"]


def test_a_reopening_held_while_we_close_the_connection_is_dropped() -> None:
    """Once we have sent connection.close, the client's held frames must not
    follow it to the broker (nothing may go after a close)."""
    s = refused_on_channel_1()
    s.client_data(m(C.Channel.CloseOk(), 1) + m(C.Channel.Open(), 1))
    s.shutdown("stopping")
    out = s.broker_data(m(C.Channel.CloseOk(), 1))
    assert out.to_broker == [] and out.to_client == []


def test_a_client_closing_while_we_close_gets_its_close_ok() -> None:
    s = refused_on_channel_1()
    out = s.client_data(
        m(C.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0), 1)
    )
    assert out.to_broker == []
    assert [v.name for _, v in decode_all(out.to_client)] == ["Channel.CloseOk"]


@pytest.mark.parametrize("vhost", ["orders", "plain"])
def test_a_fault_after_the_clients_connection_close_sends_the_broker_no_second_close(
    vhost: str,
) -> None:
    """The client's connection.close went to the broker; a fault in what
    follows it closes the client with its code, but the broker gets no second
    close: RabbitMQ answers each close with a close-ok, and the listener hangs
    up at the first, so the second close-ok met a closed socket and RabbitMQ
    logged a client that vanished ("unexpectedly closed TCP connection")."""
    s = make_session()
    open_session(s, vhost=vhost)
    bye = m(C.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
    out = s.client_data(bye + content(1, b"orphan"))  # a header without its publish
    assert closing_code_to_client(out) == 505
    assert [v.name for _, v in decode_all(out.to_broker)] == ["Connection.Close"]
    assert decode_all(out.to_broker)[0][1].reply_text == "bye"  # the client's, not ours
    assert not s.broker_done
    s.broker_data(m(C.Connection.CloseOk()))
    assert s.broker_done


def test_a_client_gone_before_the_broker_commit_aborts_and_one_gone_after_is_resolved() -> None:
    s = make_session()
    open_session(s)
    s.client_data(m(C.Tx.Select(), 1))
    s.client_data(publish(1, b"a") + m(C.Tx.Commit(), 1))
    s.client_data(m(C.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0), 1))
    out = s.transaction_prepared(1)  # prepared after the client closed the channel
    assert out.to_broker == [] and [t.channel for t in out.abort] == [1]

    s = make_session()
    open_session(s)
    s.client_data(m(C.Tx.Select(), 1))
    s.client_data(publish(1, b"a") + m(C.Tx.Commit(), 1))
    s.transaction_prepared(1)  # marker and tx.commit are on their way
    out = s.connection_lost()
    assert [t.channel for t in out.unresolved] == [1] and out.abort == []


def test_a_commit_ok_after_the_client_closed_the_channel_still_commits() -> None:
    s = make_session()
    open_session(s)
    s.client_data(m(C.Tx.Select(), 1))
    s.client_data(publish(1, b"a") + m(C.Tx.Commit(), 1))
    s.transaction_prepared(1)
    s.client_data(m(C.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0), 1))
    out = s.broker_data(m(C.Tx.CommitOk(), 1) + m(C.Channel.CloseOk(), 1))
    assert len(out.commit) == 1 and out.unresolved == []


def test_transaction_ids_carry_the_incarnation() -> None:
    topology = Topology("orders")
    topology.declare_queue("q", {})
    directory = VpnDirectory()
    directory.put(VpnView("orders", Role.ACTIVE, ReplicationScope((r"q",)), topology))
    s = Session(directory, IdSource(77))
    open_session(s)
    s.client_data(m(C.Tx.Select(), 1))
    [txn] = s.client_data(publish(1, b"a") + m(C.Tx.Commit(), 1)).prepare
    assert txn.txid.startswith("77.")


def test_topology_changes_apply_on_ok_only() -> None:
    s = make_session()
    open_session(s)
    vpn = s.vpn
    assert vpn is not None
    s.client_data(m(C.Queue.Declare(queue=""), 1))
    s.client_data(m(C.Queue.Declare(queue="passive", passive=True), 1))
    s.broker_data(m(C.Queue.DeclareOk(queue="amq.gen-1", message_count=0, consumer_count=0), 1))
    s.broker_data(m(C.Queue.DeclareOk(queue="passive", message_count=0, consumer_count=0), 1))
    assert "amq.gen-1" in vpn.topology.queues
    assert "passive" not in vpn.topology.queues  # a passive declare changes nothing
    s.client_data(m(C.Queue.Bind(queue="amq.gen-1", exchange="amq.topic", routing_key="a.*"), 1))
    assert vpn.topology.route("amq.topic", "a.b", None) == frozenset()
    s.broker_data(m(C.Queue.BindOk(), 1))
    assert vpn.topology.route("amq.topic", "a.b", None) == {"amq.gen-1"}


def test_many_durable_notices_release_in_one_pass(confirming: Session) -> None:
    s = confirming
    for _ in range(500):
        s.client_data(publish(1, b"m"))
    s.broker_data(m(C.Basic.Ack(delivery_tag=500, multiple=True), 1))
    out = s.replicated_done([((1, seq), True) for seq in range(500, 0, -1)])
    # released in one pass: one multiple ack for the whole window, nothing twice
    assert acks(out) == [("Ack", 500, True)]


def test_unreplicated_connection_only_checks_client_frames_after_open_ok() -> None:
    s = Session(VpnDirectory(), IdSource(1))
    open_session(s, vhost="plain")
    assert s.passthrough
    data = publish(1, b"x")
    out = s.client_data(data)
    assert out.to_broker == [data] and out.events == []
    # whatever the broker sends is relayed as is: an id header is not cut
    deliver = C.Basic.Deliver(consumer_tag="c", delivery_tag=1, exchange="", routing_key="q")
    broker_bytes = m(deliver, 1) + content(1, b"x", headers={"x-vpnrepl-id": 5})
    assert s.broker_data(broker_bytes).to_client == [broker_bytes]
    # the checks RabbitMQ itself does not make still close with a reply code
    unknown = struct.pack(">BHI", 1, 1, 4) + struct.pack(">HH", 999, 10) + b"\xce"
    assert closing_code(s.client_data(unknown)) == 503


def _delivery(channel: int, body: bytes) -> bytes:
    deliver = C.Basic.Deliver(consumer_tag="c", delivery_tag=1, exchange="", routing_key="q")
    return m(deliver, channel) + content(channel, body)


#: where a read of the broker's bytes ends, from the start of the first
#: delivery's body frame: in its header, in its payload, in the next frame's header
_CUTS = (3, 7 + 2000, 7 + 5000 + 1 + 2)


@pytest.mark.parametrize("cut", _CUTS, ids=["in-a-frame-header", "in-a-body", "in-the-next-header"])
def test_our_close_in_passthrough_finds_the_brokers_close_ok_behind_a_frame_cut_by_a_read(
    cut: int,
) -> None:
    """On a vhost that is not replicated the broker's bytes are relayed as
    they come: a read may end inside a frame. When we then close the
    connection (a client fault), the rest of that frame still reaches the
    client, whole, before our close, and the broker's close-ok behind it
    ends the broker's side (not the listener's 5 s close timer)."""
    s = Session(VpnDirectory(), IdSource(1))
    open_session(s, vhost="plain")
    first = _delivery(1, b"x" * 5000)
    stream = first + _delivery(1, b"y" * 10)
    split = len(first) - (7 + 5000 + 1) + cut
    to_client = list(s.broker_data(stream[:split]).to_client)
    unknown = struct.pack(">BHI", 1, 1, 4) + struct.pack(">HH", 999, 10) + b"\xce"
    out = s.client_data(unknown)
    assert [v for _, v in decode_all(out.to_broker) if isinstance(v, C.Connection.Close)]
    to_client += out.to_client
    out = s.broker_data(stream[split:] + m(C.Connection.CloseOk()))
    to_client += out.to_client
    assert s.broker_done
    frames = decode_all(to_client)  # whole frames only, our close last
    assert isinstance(frames[-1][1], C.Connection.Close) and frames[-1][1].reply_code == 503
    assert b"".join(to_client).startswith(stream[:split])


def test_body_longer_than_declared_is_refused_on_unreplicated_vhosts_too() -> None:
    s = Session(VpnDirectory(), IdSource(1))
    open_session(s, vhost="plain")
    data = (
        m(C.Basic.Publish(exchange="", routing_key="q"), 1)
        + frame.marshal(header.ContentHeader(body_size=3), 1)
        + frame.marshal(ContentBody(b"12345"), 1)
    )
    assert closing_code(s.client_data(data)) == 501


def test_a_broker_nack_takes_a_replicated_publish_back(confirming: Session) -> None:
    s = confirming
    [(published, _)] = s.client_data(publish(1, b"refused")).events
    s.replicated_done([((1, 1), True)])
    out = s.broker_data(m(C.Basic.Nack(delivery_tag=1), 1))
    assert acks(out) == [("Nack", 1, False)]
    [(taken_back, key)] = out.events
    assert isinstance(taken_back, Consumed) and key is None
    assert (taken_back.repl_id, taken_back.queue) == (published.repl_id, "q")


def test_close_ok_in_the_same_read_as_other_frames_ends_the_session() -> None:
    s = make_session()
    open_session(s)
    unknown = struct.pack(">BHI", 1, 1, 4) + struct.pack(">HH", 999, 10) + b"\xce"
    s.client_data(unknown)
    s.client_data(publish(1, b"late") + m(C.Connection.CloseOk()))
    assert s.client_done


def test_content_header_of_another_class_is_refused() -> None:
    s = make_session()
    open_session(s)
    bad = struct.pack(">HHQH", 61, 0, 0, 0x1000) + b"\x02"
    data = m(C.Basic.Publish(exchange="", routing_key="q"), 1) + amqp.frame_bytes(2, 1, bad)
    out = s.client_data(data)
    assert closing_code(out) == 505 and out.events == []


def test_close_ok_is_found_after_a_framing_fault_lost_the_frame_boundaries() -> None:
    s = make_session()
    open_session(s)
    s.client_data(struct.pack(">BHI", 3, 1, 300_000))  # oversize: framing is lost
    padding = b"\x00" * 5000
    s.client_data(padding + m(C.Connection.CloseOk())[:5])
    assert not s.client_done
    s.client_data(m(C.Connection.CloseOk())[5:])
    assert s.client_done


# -- the fused publish path gives the same result as the frame-by-frame one --


def _publish_with_table(table: bytes, mode: int) -> bytes:
    """A publish whose content header carries ``table`` as raw headers bytes."""
    flags = 0x2000 | 0x1000  # headers, delivery mode
    payload = struct.pack(">HHQH", 60, 0, 4, flags) + struct.pack(">I", len(table)) + table
    payload += bytes([mode])
    return (
        m(C.Basic.Publish(exchange="", routing_key="q"), 1)
        + struct.pack(">BHI", 2, 1, len(payload))
        + payload
        + b"\xce"
        + frame.marshal(ContentBody(b"body"), 1)
    )


@pytest.mark.parametrize("mode", [1, 2])
def test_a_headers_table_that_does_not_parse_closes_with_502_persistent_or_not(mode: int) -> None:
    """RabbitMQ 3.10 crashes the channel on it instead of answering."""
    s = make_session()
    open_session(s)
    assert closing_code(s.client_data(_publish_with_table(b"\x03BCC", mode))) == 502


_PIECES = [
    publish(1, b"body"),  # replicated
    publish(1, b"body", queue="other"),  # out of scope
    publish(1, b"body", mode=1),  # transient
    publish(1, b"", app_id="empty"),  # no body frame
    publish(1, b"with headers", headers={"k": "v", "x-vpnrepl-id": "old"}),
    publish(1, b"id-like", message_id="#" * 32, headers={"a": 1}, priority=3),
    publish(1, b"typed", content_type="text/plain", correlation_id="c-1"),
    m(C.Basic.Publish(exchange="", routing_key="q"), 1)  # body in two frames
    + frame.marshal(
        header.ContentHeader(body_size=4, properties=C.Basic.Properties(delivery_mode=2)), 1
    )
    + frame.marshal(ContentBody(b"ab"), 1)
    + frame.marshal(ContentBody(b"cd"), 1),
    publish(2, b"channel two"),  # channel 2 is never opened: RabbitMQ's 504 is its own
    m(C.Basic.Publish(exchange="", routing_key="q"), 1)  # body longer than declared
    + frame.marshal(
        header.ContentHeader(body_size=2, properties=C.Basic.Properties(delivery_mode=2)), 1
    )
    + frame.marshal(ContentBody(b"too long"), 1),
    struct.pack(">BHI", 1, 1, 5) + b"\x00\x3c\x00\x28\x00" + b"\xce",  # truncated publish
    m(C.Basic.Publish(exchange="", routing_key="q"), 1)  # header for another class
    + struct.pack(">BHI", 2, 1, 14)
    + struct.pack(">HHQH", 50, 0, 0, 0)
    + b"\xce",
    m(C.Basic.Ack(delivery_tag=1), 1),
    m(C.Basic.Publish(exchange="", routing_key="q"), 1)  # header on another channel
    + frame.marshal(
        header.ContentHeader(body_size=4, properties=C.Basic.Properties(delivery_mode=2)), 2
    )
    + frame.marshal(ContentBody(b"body"), 1),
    m(C.Basic.Publish(exchange="", routing_key="q"), 1)  # an empty body frame after size 0
    + frame.marshal(
        header.ContentHeader(body_size=0, properties=C.Basic.Properties(delivery_mode=2)), 1
    )
    + struct.pack(">BHI", 3, 1, 0)
    + b"\xce",
    _publish_with_table(b"\x03BCC", mode=1),  # a transient publish, headers table cut short
    m(C.Basic.Publish(exchange="", routing_key="q"), 1)  # a method where the body belongs
    + frame.marshal(
        header.ContentHeader(body_size=13, properties=C.Basic.Properties(delivery_mode=2)), 1
    )
    + m(C.Basic.Ack(delivery_tag=1), 1),
]


@pytest.mark.parametrize("vhost", ["orders", "plain"])  # replicated, not replicated
@settings(max_examples=150, deadline=None)
@given(picks=st.lists(st.sampled_from(range(len(_PIECES))), min_size=1, max_size=12))
def test_whole_reads_and_frame_by_frame_reads_agree(vhost: str, picks: list[int]) -> None:
    """The fused path (publish, header and body in one read) must be
    indistinguishable from the frame-by-frame path it shortcuts: same bytes
    upstream, same replies, same events, same confirms."""
    data = b"".join(_PIECES[i] for i in picks)
    results = []
    for whole in (True, False):
        s = make_session()
        open_session(s, vhost=vhost)
        s.client_data(m(C.Confirm.Select(), 1))
        s.broker_data(m(C.Confirm.SelectOk(), 1))
        outs = [s.client_data(data)] if whole else [s.client_data(c) for c in _frames_of(data)]
        sent = b"".join(b"".join(o.to_broker) for o in outs)
        replies = b"".join(b"".join(o.to_client) for o in outs)
        events = [e for o in outs for e in o.events]
        confirms = s.broker_data(amqp.encode_ack(1, 10_000, True))
        done = s.replicated_done([(key, True) for _, key in events if key])
        results.append((sent, replies, events, confirms.to_client, done.to_client))
    assert results[0] == results[1]


def _frames_of(data: bytes) -> list[bytes]:
    """``data`` cut at frame boundaries while they can be told (a broken
    frame length ends the cutting: the rest goes as one piece)."""
    out, pos = [], 0
    while len(data) - pos >= 7:
        size = struct.unpack_from(">I", data, pos + 3)[0]
        end = pos + 8 + size
        if end > len(data):
            break
        out.append(data[pos:end])
        pos = end
    if pos < len(data):
        out.append(data[pos:])
    return out


def test_a_binding_made_after_a_publish_applies_to_the_next_one(confirming: Session) -> None:
    """The fused path memoises routes per connection; a topology change must
    still apply to the very next publish with the same exchange and key."""
    topology = confirming.vpn.topology
    topology.declare_exchange("x", "direct")
    data = m(C.Basic.Publish(exchange="x", routing_key="k"), 1) + content(1, b"b", delivery_mode=2)
    assert confirming.client_data(data).events == []  # x routes nowhere yet
    topology.bind_queue("q", "x", "k")
    [(event, _)] = confirming.client_data(data).events
    assert event.queues == ("q",)
    topology.unbind_queue("q", "x", "k")
    assert confirming.client_data(data).events == []


def test_a_sink_without_append_many_gets_the_events_one_by_one_in_order() -> None:
    """ReplicationSink.append_many's default: append per event, each keyed
    event's verdict reported with its key (the bridge's sink relies on it)."""

    class OneByOne(MemorySink):
        append_many = ReplicationSink.append_many  # the default, not MemorySink's

        def append(self, event, on_durable) -> None:
            super().append(event, None)
            if on_durable is not None:
                on_durable(event.routing_key != "bad")

    rid = IdSource(1)
    events = [
        (Published("v", rid.next(), "", "q", b"", b"1", ("q",)), (1, 1)),
        (Consumed("v", rid.next(), "q"), None),
        (Published("v", rid.next(), "", "bad", b"", b"2", ("q",)), (1, 2)),
    ]
    sink, verdicts = OneByOne(), []
    sink.append_many(events, lambda key, ok: verdicts.append((key, ok)))
    assert sink.events == [e for e, _ in events]
    assert verdicts == [((1, 1), True), ((1, 2), False)]


def test_a_clients_own_id_header_is_replaced_and_its_other_properties_kept(
    confirming: Session,
) -> None:
    props = {
        "headers": {"k": "v", "x-vpnrepl-id": "old", "n": 7},
        "message_id": "#" * 32,
        "priority": 3,
        "content_type": "text/plain",
    }
    for _ in range(2):  # the second publish takes the memoised header template
        out = confirming.client_data(publish(1, b"x", **props))
        [(event, _)] = out.events
        hdr = decode_all(out.to_broker)[1][1]
        assert hdr.properties.headers == {"k": "v", "n": 7, "x-vpnrepl-id": event.repl_id.wire}
        assert (hdr.properties.message_id, hdr.properties.priority) == ("#" * 32, 3)
        assert hdr.properties.content_type == "text/plain" and hdr.body_size == 1


def test_a_transaction_that_touches_nothing_replicated_passes_straight_through() -> None:
    s = make_session()
    open_session(s)
    s.client_data(m(C.Tx.Select(), 1))
    s.client_data(publish(1, b"a", queue="other") + publish(1, b"t", mode=1))
    out = s.client_data(m(C.Tx.Commit(), 1))
    assert out.prepare == [] and decode_all(out.to_broker)[-1][1].name == "Tx.Commit"
    assert not any(v.name == "Basic.Publish" for _, v in decode_all(out.to_broker))  # no marker
    out = s.broker_data(m(C.Tx.CommitOk(), 1))
    assert out.commit == [] and decode_all(out.to_client)[0][1].name == "Tx.CommitOk"


# -- purges and deletes empty a queue on the standby too --


def consuming(s: Session, ids: list[ReplicationId], queue: str = "q") -> None:
    """A consumer on ``queue`` got ``ids`` as deliveries 1, 2, ... (unacked)."""
    s.client_data(m(C.Basic.Consume(queue=queue, consumer_tag=""), 1))
    s.broker_data(m(C.Basic.ConsumeOk(consumer_tag=f"ctag-{queue}"), 1))
    for tag, rid in enumerate(ids, start=1):
        deliver(s, tag, f"ctag-{queue}", rid)


def test_a_purge_spares_the_deliveries_not_yet_settled() -> None:
    s = make_session()
    open_session(s)
    ids = [ReplicationId.from_parts(4, n) for n in range(1, 5)]
    consuming(s, ids)
    s.client_data(m(C.Basic.Ack(delivery_tag=1), 1))
    s.client_data(m(C.Basic.Nack(delivery_tag=2, requeue=True), 1))  # back in the queue
    assert s.client_data(m(C.Queue.Purge(queue="q"), 1)).events == []  # not done yet
    out = s.broker_data(m(C.Queue.PurgeOk(message_count=1), 1))
    assert [e for e, _ in out.events] == [Purged("orders", "q", (ids[2], ids[3]), deleted=False)]


def test_a_purge_spares_deliveries_of_other_connections_and_acks_in_an_open_transaction() -> None:
    directory, ids = VpnDirectory(), [ReplicationId.from_parts(4, n) for n in range(1, 4)]
    topology = Topology("orders")
    topology.declare_queue("q", {})
    directory.put(VpnView("orders", Role.ACTIVE, ReplicationScope(), topology))
    sessions: list[Session] = []
    a, b = (Session(directory, IdSource(1), peers=lambda: iter(sessions)) for _ in range(2))
    sessions += [a, b]
    for s in sessions:
        open_session(s)
    a.client_data(m(C.Tx.Select(), 1))
    a.broker_data(m(C.Tx.SelectOk(), 1))
    consuming(a, ids)
    a.client_data(m(C.Basic.Ack(delivery_tag=3), 1))  # inside the transaction: still held
    b.client_data(m(C.Queue.Purge(queue="q"), 1))
    out = b.broker_data(m(C.Queue.PurgeOk(message_count=0), 1))
    assert [e for e, _ in out.events] == [Purged("orders", "q", tuple(ids), deleted=False)]


def test_deleting_a_queue_or_closing_the_owner_of_an_exclusive_one_spares_nothing() -> None:
    s = make_session()
    open_session(s)
    consuming(s, [ReplicationId.from_parts(4, 1)])
    s.client_data(m(C.Queue.Delete(queue="q"), 1))
    out = s.broker_data(m(C.Queue.DeleteOk(message_count=0), 1))
    assert [e for e, _ in out.events] == [
        Purged("orders", "q", (), deleted=True),
        TopologyChanged("orders", "queue.delete", name_item("q")),
    ]
    s.client_data(m(C.Queue.Declare(queue="mine", exclusive=True), 1))
    s.broker_data(m(C.Queue.DeclareOk(queue="mine", message_count=0, consumer_count=0), 1))
    out = s.connection_lost()
    assert [e for e, _ in out.events] == [Purged("orders", "mine", (), deleted=True)]


def test_a_nowait_exclusive_declare_of_a_queue_that_exists_does_not_make_it_ours() -> None:
    """RabbitMQ refuses (405) an exclusive declare of a queue that exists and
    is not this connection's own; with nowait the listener never sees the
    refusal. Counting the queue as the connection's would drop a live
    replicated queue from the topology when the connection ends, and with it
    every later publish to it from replication (found by the listener fuzz)."""
    s = make_session()
    open_session(s)
    assert s.vpn is not None
    s.client_data(m(C.Queue.Declare(queue="q", exclusive=True, nowait=True), 1))
    s.client_data(m(C.Queue.Declare(queue="mine", exclusive=True, nowait=True), 1))
    refused = C.Channel.Close(
        reply_code=405, reply_text="RESOURCE_LOCKED", class_id=50, method_id=10
    )
    s.broker_data(m(refused, 1))
    out = s.connection_lost()
    # "mine" is new: had it been refused the broker has nothing to drop either
    assert [e for e, _ in out.events] == [Purged("orders", "mine", (), deleted=True)]
    assert "q" in s.vpn.topology.queues and "mine" not in s.vpn.topology.queues
    other = make_session()
    other.vpn = s.vpn
    open_session(other)
    assert len(other.client_data(publish(1, b"still replicated")).events) == 1


def test_a_nowait_purge_goes_synchronous_and_the_channels_later_frames_wait_for_it() -> None:
    """The broker may refuse a purge or a delete; with nowait the listener
    would never learn of it, and the standby would drop messages the active
    keeps. So it asks for the answer itself, swallows the -ok the client
    did not ask for, and holds the channel's later frames until then: the
    purge stays ahead of the publish that followed it."""
    s = make_session()
    open_session(s)
    out = s.client_data(m(C.Queue.Purge(queue="q", nowait=True), 1) + publish(1, b"after"))
    assert [(c, v.name, v.nowait) for c, v in decode_all(out.to_broker)] == [
        (1, "Queue.Purge", False)
    ]
    assert out.events == [] and out.to_client == []
    out = s.client_data(m(C.Basic.Ack(delivery_tag=7), 1))  # still waiting
    assert out.to_broker == [] and out.events == []
    out = s.broker_data(m(C.Queue.PurgeOk(message_count=3), 1))
    assert out.to_client == []
    kinds = [type(e).__name__ for e, _ in out.events]
    assert kinds == ["Purged", "Published"]
    assert [v.name for _, v in decode_all(out.to_broker)] == [
        "Basic.Publish",
        "ContentHeader",
        "ContentBody",
        "Basic.Ack",
    ]
    out = s.client_data(publish(1, b"relayed at once"))
    assert len(out.events) == 1 and len(decode_all(out.to_broker)) == 3


def test_a_refused_nowait_delete_changes_nothing_on_either_site() -> None:
    s = make_session()
    open_session(s)
    assert s.vpn is not None
    out = s.client_data(
        m(C.Queue.Delete(queue="q", if_empty=True, nowait=True), 1) + publish(1, b"too late")
    )
    assert [v.name for _, v in decode_all(out.to_broker)] == ["Queue.Delete"]
    refused = C.Channel.Close(
        reply_code=406, reply_text="PRECONDITION_FAILED", class_id=50, method_id=40
    )
    out = s.broker_data(m(refused, 1))
    assert out.events == []
    assert [v.name for _, v in decode_all(out.to_client)] == ["Channel.Close"]
    # the broker gets what it would have got, and discards it (the channel closes)
    assert [v.name for _, v in decode_all(out.to_broker)][0] == "Basic.Publish"
    assert "q" in s.vpn.topology.queues
    out = s.client_data(m(C.Channel.CloseOk(), 1))
    assert [v.name for _, v in decode_all(out.to_broker)] == ["Channel.CloseOk"]
    s.client_data(m(C.Channel.Open(), 1))
    s.broker_data(m(C.Channel.OpenOk(), 1))
    assert len(s.client_data(publish(1, b"still replicated")).events) == 1


def test_a_refused_nowait_exchange_delete_keeps_the_exchange() -> None:
    s = make_session()
    open_session(s)
    assert s.vpn is not None
    s.vpn.topology.declare_exchange("x", "topic", {})
    s.client_data(m(C.Exchange.Delete(exchange="x", if_unused=True, nowait=True), 1))
    refused = C.Channel.Close(
        reply_code=406, reply_text="PRECONDITION_FAILED", class_id=40, method_id=20
    )
    s.broker_data(m(refused, 1))
    assert "x" in s.vpn.topology.exchanges
    s.client_data(m(C.Channel.CloseOk(), 1))
    s.client_data(m(C.Channel.Open(), 1))
    s.broker_data(m(C.Channel.OpenOk(), 1))
    s.client_data(m(C.Exchange.Delete(exchange="x", nowait=True), 1))
    assert s.broker_data(m(C.Exchange.DeleteOk(), 1)).to_client == []
    assert "x" not in s.vpn.topology.exchanges


def test_frames_held_for_a_nowait_delete_join_our_close_of_the_channel() -> None:
    """A refused transaction closes the channel from our side while the
    client's frames wait for a nowait delete: they go into the close
    handshake, so the client's close-ok is not held for ever."""
    s = make_session()
    open_session(s)
    s.client_data(m(C.Tx.Select(), 1))
    s.broker_data(m(C.Tx.SelectOk(), 1))
    s.client_data(publish(1, b"in the transaction"))
    out = s.client_data(
        m(C.Tx.Commit(), 1) + m(C.Queue.Delete(queue="other", nowait=True), 1) + publish(1, b"x")
    )
    assert [v.name for _, v in decode_all(out.to_broker)] == ["Queue.Delete"]
    out = s.transaction_prepared(1, refused="the standby did not prepare in time")
    assert [v.name for _, v in decode_all(out.to_client)] == ["Channel.Close"]
    out = s.broker_data(m(C.Queue.DeleteOk(message_count=0), 1))  # on a closing channel
    out = s.client_data(m(C.Channel.CloseOk(), 1))
    s.broker_data(m(C.Channel.CloseOk(), 1))
    out = s.client_data(m(C.Channel.Open(), 1))
    assert [v.name for _, v in decode_all(out.to_broker)] == ["Channel.Open"]


def test_an_unreplicated_vhost_relays_a_nowait_purge_untouched() -> None:
    plain = make_session()
    open_session(plain, vhost="plain")
    request = m(C.Queue.Purge(queue="q", nowait=True), 1) + publish(1, b"next")
    out = plain.client_data(request)
    assert b"".join(out.to_broker) == request and out.events == []
    plain.client_data(m(C.Queue.Purge(queue="q"), 1))
    assert plain.broker_data(m(C.Queue.PurgeOk(message_count=0), 1)).events == []


def test_an_empty_queue_name_means_the_channels_last_declared_queue() -> None:
    s = make_session()
    open_session(s)
    s.client_data(m(C.Queue.Declare(queue=""), 1))  # server-named
    s.client_data(m(C.Queue.Purge(queue=""), 1))  # sent before the declare-ok came
    s.broker_data(m(C.Queue.DeclareOk(queue="amq.gen-7", message_count=0, consumer_count=0), 1))
    out = s.broker_data(m(C.Queue.PurgeOk(message_count=0), 1))
    assert [e for e, _ in out.events] == [Purged("orders", "amq.gen-7", (), deleted=False)]
    s.client_data(m(C.Queue.Declare(queue="q", passive=True), 1))
    s.broker_data(m(C.Queue.DeclareOk(queue="q", message_count=0, consumer_count=0), 1))
    s.client_data(m(C.Queue.Delete(queue=""), 1))
    out = s.broker_data(m(C.Queue.DeleteOk(message_count=0), 1))
    assert [e for e, _ in out.events] == [
        Purged("orders", "q", (), deleted=True),
        TopologyChanged("orders", "queue.delete", name_item("q")),
    ]


# -- a reject or nack without requeue from a dead-lettering queue moves the message --


def dead_lettering_session(policy: bool = False) -> Session:
    """Queue ``q`` dead-letters to the topic exchange ``dlx`` (by argument,
    or by a policy), which routes ``order.*`` to ``q.dead``."""
    topology = Topology("orders")
    args = {} if policy else {"x-dead-letter-exchange": "dlx"}
    topology.declare_queue("q", args)
    topology.declare_exchange("dlx", "topic", {})
    topology.bind_queue("q.dead", "dlx", "order.*")
    if policy:
        topology.set_policies(
            [Policy("dl", "^q$", {"dead-letter-exchange": "dlx"}, apply_to="queues")]
        )
    directory = VpnDirectory()
    directory.put(VpnView("orders", Role.ACTIVE, ReplicationScope((r"q.*",)), topology))
    s = Session(directory, IdSource(1))
    open_session(s)
    s.client_data(m(C.Basic.Consume(queue="q", consumer_tag=""), 1))
    s.broker_data(m(C.Basic.ConsumeOk(consumer_tag="c"), 1))
    return s


@pytest.mark.parametrize("policy", [False, True])
def test_rejects_are_dead_lettered_by_the_messages_own_routing_key(policy: bool) -> None:
    s = dead_lettering_session(policy)
    ids = [ReplicationId.from_parts(4, n) for n in range(1, 6)]
    for tag, rid in enumerate(ids, start=1):
        deliver(s, tag, "c", rid, routing_key="order.x" if tag != 3 else "misc")
    events = []
    events += s.client_data(m(C.Basic.Reject(delivery_tag=1, requeue=False), 1)).events
    events += s.client_data(m(C.Basic.Ack(delivery_tag=2), 1)).events  # an ack is no reject
    events += s.client_data(m(C.Basic.Nack(delivery_tag=4, multiple=True, requeue=False), 1)).events
    events += s.client_data(m(C.Basic.Reject(delivery_tag=5, requeue=True), 1)).events
    assert [e for e, _ in events] == [
        DeadLettered("orders", ids[0], "q", ("q.dead",)),
        Consumed("orders", ids[1], "q"),
        DeadLettered("orders", ids[2], "q", ()),  # "misc" routes nowhere: dropped
        DeadLettered("orders", ids[3], "q", ("q.dead",)),
    ]


def test_a_dead_letter_routing_key_of_the_queue_replaces_the_messages() -> None:
    s = dead_lettering_session()
    view = s.vpn
    assert view is not None
    view.topology.delete_queue("q")
    view.topology.declare_queue(
        "q", {"x-dead-letter-exchange": "dlx", "x-dead-letter-routing-key": "order.dead"}
    )
    rid = ReplicationId.from_parts(4, 1)
    deliver(s, 1, "c", rid, routing_key="misc")
    out = s.client_data(m(C.Basic.Reject(delivery_tag=1, requeue=False), 1))
    assert [e for e, _ in out.events] == [DeadLettered("orders", rid, "q", ("q.dead",))]


def test_a_reject_rolled_back_is_dead_lettered_by_its_own_key_when_rejected_again() -> None:
    s = dead_lettering_session()
    s.client_data(m(C.Tx.Select(), 1))
    s.broker_data(m(C.Tx.SelectOk(), 1))
    rid = ReplicationId.from_parts(4, 1)
    deliver(s, 1, "c", rid, routing_key="order.x")
    s.client_data(m(C.Basic.Reject(delivery_tag=1, requeue=False), 1))
    s.client_data(m(C.Tx.Rollback(), 1))
    s.broker_data(m(C.Tx.RollbackOk(), 1))
    s.client_data(m(C.Basic.Reject(delivery_tag=1, requeue=False), 1))
    [txn] = s.client_data(m(C.Tx.Commit(), 1)).prepare
    assert txn.events == (DeadLettered("orders", rid, "q", ("q.dead",)),)


# -- topology requests on a replicated VPN are ledger events, in wire order --


def test_declares_binds_and_deletes_become_topology_events_in_order_with_publishes() -> None:
    """What the standby needs to rebuild the topology without a listing:
    every change the broker carried out, with the arguments the client
    declared, where the broker made it among the channel's publishes."""
    s = make_session()
    open_session(s)
    args = {"x-queue-type": "quorum", "x-max-length": 10}
    s.client_data(m(C.Exchange.Declare(exchange="x", exchange_type="fanout", durable=True), 1))
    out = s.broker_data(m(C.Exchange.DeclareOk(), 1))
    s.client_data(m(C.Queue.Declare(queue="q2", durable=True, arguments=args), 1))
    out2 = s.broker_data(m(C.Queue.DeclareOk(queue="q2", message_count=0, consumer_count=0), 1))
    s.client_data(m(C.Queue.Bind(queue="q2", exchange="x", routing_key="k"), 1))
    out3 = s.broker_data(m(C.Queue.BindOk(), 1))
    s.client_data(m(C.Queue.Unbind(queue="q2", exchange="x", routing_key="k"), 1))
    out4 = s.broker_data(m(C.Queue.UnbindOk(), 1))
    s.client_data(m(C.Exchange.Delete(exchange="x"), 1))
    out5 = s.broker_data(m(C.Exchange.DeleteOk(), 1))
    events = [e for o in (out, out2, out3, out4, out5) for e, _ in o.events]
    binding = binding_item("x", "q2", "queue", "k", {})
    assert events == [
        TopologyChanged(
            "orders",
            "exchange.declare",
            exchange_item("x", "fanout", {}, durable=True, auto_delete=False, internal=False),
        ),
        TopologyChanged(
            "orders", "queue.declare", queue_item("q2", args, durable=True, auto_delete=False)
        ),
        TopologyChanged("orders", "bind", binding),
        TopologyChanged("orders", "unbind", binding),
        TopologyChanged("orders", "exchange.delete", name_item("x")),
    ]
    assert '"x-queue-type":"quorum"' in events[1].item


def test_a_refused_declare_and_a_passive_one_replicate_nothing() -> None:
    s = make_session()
    open_session(s)
    s.client_data(m(C.Queue.Declare(queue="q", passive=True), 1))
    out = s.broker_data(m(C.Queue.DeclareOk(queue="q", message_count=0, consumer_count=0), 1))
    assert out.events == []
    s.client_data(m(C.Queue.Declare(queue="q", durable=True, arguments={"x-max-length": 1}), 1))
    refused = C.Channel.Close(
        reply_code=406, reply_text="PRECONDITION_FAILED", class_id=50, method_id=10
    )
    out = s.broker_data(m(refused, 1))
    assert out.events == []


def test_a_nowait_declare_on_a_replicated_vpn_waits_for_the_brokers_ok() -> None:
    """A nowait declare the broker refuses (inequivalent arguments) must not
    reach the standby's definitions: it goes to the broker synchronous, its
    -ok (which the client did not ask for) is swallowed, and only then does
    it replicate."""
    s = make_session()
    open_session(s)
    out = s.client_data(m(C.Queue.Declare(queue="q", durable=True, nowait=True), 1))
    assert [(c, v.name, v.nowait) for c, v in decode_all(out.to_broker)] == [
        (1, "Queue.Declare", False)
    ]
    assert out.events == []
    ok = s.broker_data(m(C.Queue.DeclareOk(queue="q", message_count=0, consumer_count=0), 1))
    assert not ok.to_client
    assert [e.op for e, _ in ok.events] == ["queue.declare"]


def test_the_connections_exclusive_queues_do_not_replicate_as_topology() -> None:
    s = make_session()
    open_session(s)
    s.client_data(m(C.Queue.Declare(queue="mine", exclusive=True), 1))
    out = s.broker_data(m(C.Queue.DeclareOk(queue="mine", message_count=0, consumer_count=0), 1))
    s.client_data(m(C.Queue.Bind(queue="mine", exchange="amq.topic", routing_key="#"), 1))
    out2 = s.broker_data(m(C.Queue.BindOk(), 1))
    assert out.events == [] and out2.events == []


def test_a_clients_frame_max_of_0_is_clamped_to_the_brokers() -> None:
    """frame_max 0 ("no limit") from the client would let it make the
    listener buffer a frame of any size: the broker's frame_max bounds it,
    and a larger frame closes the connection (501) from its header."""
    s = make_session()
    s.client_data(amqp.PROTOCOL_HEADER)
    s.broker_data(m(C.Connection.Start(mechanisms="PLAIN", locales="en_US")))
    s.client_data(m(C.Connection.StartOk(response="\0guest\0guest")))
    s.broker_data(m(C.Connection.Tune(channel_max=2047, frame_max=131072, heartbeat=60)))
    s.client_data(m(C.Connection.TuneOk(channel_max=2047, frame_max=0, heartbeat=60)))
    s.client_data(m(C.Connection.Open(virtual_host="orders")))
    s.broker_data(m(C.Connection.OpenOk()))
    s.client_data(m(C.Channel.Open(), 1))
    s.broker_data(m(C.Channel.OpenOk(), 1))
    huge = struct.pack(">BHI", 3, 1, 200_000)  # a body frame header, 200 kB announced
    out = s.client_data(huge)
    closes = [v for _, v in decode_all(out.to_client) if isinstance(v, C.Connection.Close)]
    assert closes and closes[0].reply_code == 501
    assert "exceeds frame-max 131072" in str(closes[0].reply_text)


def test_a_stream_queues_consumers_remove_nothing_on_either_site() -> None:
    """A stream keeps what its consumers ack (they read from an offset, and
    the broker's retention alone removes): its ack is no consumption event,
    while a quorum (or classic) queue's ack is one."""
    topology = Topology("orders")
    topology.declare_queue("q", {"x-queue-type": "stream"})
    topology.declare_queue("q2", {"x-queue-type": "quorum"})
    directory = VpnDirectory()
    directory.put(VpnView("orders", Role.ACTIVE, ReplicationScope((r"q",)), topology))
    s = Session(directory, IdSource(1), marker_key=MARKERS)
    open_session(s)
    s.client_data(m(C.Basic.Qos(prefetch_count=10), 1))
    s.client_data(m(C.Basic.Consume(queue="q", consumer_tag="log"), 1))
    s.broker_data(m(C.Basic.ConsumeOk(consumer_tag="log"), 1))
    s.client_data(m(C.Basic.Consume(queue="q2", consumer_tag="work"), 1))
    s.broker_data(m(C.Basic.ConsumeOk(consumer_tag="work"), 1))
    log, work = ReplicationId.from_parts(3, 1), ReplicationId.from_parts(3, 2)
    assert deliver(s, 1, "log", log).events == []
    assert s.client_data(m(C.Basic.Ack(delivery_tag=1), 1)).events == []
    deliver(s, 2, "work", work)
    [(event, _)] = s.client_data(m(C.Basic.Ack(delivery_tag=2), 1)).events
    assert event == Consumed("orders", work, "q2")
