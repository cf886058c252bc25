"""The listener's side of client XA, fed scripted frames (sans-IO): requests
taken out of the stream only where no numbering depends on them, a branch's
channel closed to more work, our own broker commit and rollback swallowed."""

from __future__ import annotations

import json

import pytest
from pamqp import commands as C, frame, header
from pamqp.body import ContentBody

from bridge import MARKER_QUEUE, ReplicationId
from plugin.session import Output, Session
from tests.unit.plugin.session.test_session import (
    content,
    decode_all,
    deliver,
    m,
    make_session,
    open_session,
    publish,
)


def xa_request(channel: int, verb: str, doc: dict[str, object], reply: str = "replies") -> bytes:
    body = json.dumps(doc).encode()
    return m(C.Basic.Publish(exchange="vpnrepl.xa", routing_key=verb), channel) + content(
        channel, body, correlation_id="c7", reply_to=reply
    )


def feed(s: Session, data: bytes, split: bool) -> list[Output]:
    """``data`` from the client in one read, or byte by byte."""
    if split:
        return [s.client_data(data[i : i + 1]) for i in range(len(data))]
    return [s.client_data(data)]


@pytest.fixture
def tx() -> Session:
    s = make_session()
    open_session(s)
    s.client_data(m(C.Tx.Select(), 1))
    s.broker_data(m(C.Tx.SelectOk(), 1))
    return s


@pytest.mark.parametrize("split", [False, True])
def test_a_request_is_taken_out_of_the_stream(tx: Session, split: bool) -> None:
    data = xa_request(1, "start", {"xid": "1:61:62"}) + publish(1, b"work")
    outs = feed(tx, data, split)
    to_broker = b"".join(b"".join(o.to_broker) for o in outs)
    calls = [c for o in outs for c in o.xa_calls]
    assert [v.name for _, v in decode_all([to_broker])] == [
        "Basic.Publish",
        "ContentHeader",
        "ContentBody",
    ]  # only the work: the request never reaches the broker
    [call] = calls
    assert (call.channel, call.verb, call.correlation_id, call.reply_to) == (
        1,
        "start",
        "c7",
        "replies",
    )
    assert json.loads(call.body) == {"xid": "1:61:62"}


def test_on_a_confirm_channel_a_request_is_refused_as_a_reserved_name() -> None:
    """On a confirm channel a publish is numbered, so the listener cannot
    take it out of the stream: it is a publish to a reserved exchange, and
    the channel is closed (403) without it reaching the broker."""
    s = make_session()
    open_session(s)
    s.client_data(m(C.Confirm.Select(), 1))
    out = s.client_data(xa_request(1, "recover", {}))
    assert out.xa_calls == []
    assert [type(v).__name__ for _, v in decode_all(out.to_broker)] == ["Close"]
    closes = [v for _, v in decode_all(out.to_client) if isinstance(v, C.Channel.Close)]
    assert closes[0].reply_code == 403 and "'vpnrepl.xa'" in str(closes[0].reply_text)


@pytest.mark.parametrize(
    "method",
    [
        C.Queue.Declare(queue="vpnrepl.commit-markers", durable=True),
        C.Queue.Declare(queue="vpnrepl.commit-markers", passive=True),
        C.Queue.Delete(queue="vpnrepl.commit-markers"),
        C.Queue.Purge(queue="vpnrepl.commit-markers"),
        C.Queue.Bind(queue="vpnrepl.commit-markers", exchange="amq.fanout"),
        C.Queue.Bind(queue="q", exchange="vpnrepl.xa"),
        C.Exchange.Declare(exchange="vpnrepl.xa", exchange_type="direct"),
        C.Exchange.Delete(exchange="vpnrepl.anything"),
        C.Exchange.Bind(destination="x", source="vpnrepl.xa"),
        C.Basic.Consume(queue="vpnrepl.commit-markers"),
        C.Basic.Get(queue="vpnrepl.commit-markers"),
        C.Queue.Declare(
            queue="dl", arguments={"x-dead-letter-routing-key": "vpnrepl.commit-markers"}
        ),
        C.Queue.Declare(queue="dl", arguments={"x-dead-letter-exchange": "vpnrepl.xa"}),
        C.Exchange.Declare(
            exchange="x", exchange_type="direct", arguments={"alternate-exchange": "vpnrepl.x"}
        ),
    ],
    ids=lambda method: type(method).__qualname__,
)
def test_every_method_on_a_reserved_name_is_refused_with_403(method: object) -> None:
    """The commit markers steer crash recovery: a client may not read,
    remove, bind or even look at them through the listener."""
    s = make_session()
    open_session(s)
    out = s.client_data(m(method, 1))
    closes = [v for _, v in decode_all(out.to_client) if isinstance(v, C.Channel.Close)]
    assert closes and closes[0].reply_code == 403, out.to_client
    assert "vpn-replication's own" in str(closes[0].reply_text)
    assert not [v for _, v in decode_all(out.to_broker) if type(v) is type(method)]


def test_a_publish_to_a_reserved_queue_by_the_default_exchange_is_refused() -> None:
    s = make_session()
    open_session(s)
    out = s.client_data(publish(1, b"forged marker", queue="vpnrepl.commit-markers"))
    closes = [v for _, v in decode_all(out.to_client) if isinstance(v, C.Channel.Close)]
    assert closes and closes[0].reply_code == 403
    assert not [v for _, v in decode_all(out.to_broker) if isinstance(v, C.Basic.Publish)]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("header_name", ["CC", "BCC"])
def test_a_publish_whose_cc_or_bcc_names_a_reserved_queue_is_refused(
    split: bool, header_name: str
) -> None:
    """To the default exchange a CC/BCC entry routes to the queue it
    names: the method waits for its content header, and neither reaches
    the broker (whole in one read, the fused path; byte by byte, the
    frame-by-frame one)."""
    s = make_session()
    open_session(s)
    data = publish(1, b"forged marker", headers={header_name: ["q", "vpnrepl.commit-markers"]})
    outs = feed(s, data, split)
    to_client = decode_all([b"".join(b"".join(o.to_client) for o in outs)])
    to_broker = decode_all([b"".join(b"".join(o.to_broker) for o in outs)])
    closes = [v for _, v in to_client if isinstance(v, C.Channel.Close)]
    assert closes and closes[0].reply_code == 403, to_client
    assert "'vpnrepl.commit-markers'" in str(closes[0].reply_text)
    assert [type(v).__name__ for _, v in to_broker] == ["Close"]  # no publish, no content


@pytest.mark.parametrize("split", [False, True])
def test_a_held_publish_with_a_harmless_cc_reaches_the_broker_in_order(split: bool) -> None:
    s = make_session()
    open_session(s)
    data = publish(1, b"body", headers={"CC": ["other"]}) + publish(2, b"two", mode=1)
    outs = feed(s, data, split)
    to_broker = decode_all([b"".join(b"".join(o.to_broker) for o in outs)])
    assert [(ch, type(v).__name__) for ch, v in to_broker] == [
        (1, "Publish"),
        (1, "ContentHeader"),
        (1, "ContentBody"),
        (2, "Publish"),
        (2, "ContentHeader"),
        (2, "ContentBody"),
    ]
    assert to_broker[1][1].properties.headers["CC"] == ["other"]
    assert [v.value for _, v in to_broker if isinstance(v, ContentBody)] == [b"body", b"two"]


def test_on_a_vhost_not_replicated_a_request_is_relayed_untouched() -> None:
    s = make_session(vhost="orders")
    open_session(s, vhost="elsewhere")
    data = xa_request(1, "recover", {})
    out = s.client_data(data)
    assert out.xa_calls == [] and b"".join(out.to_broker) == data


def branch_prepared(s: Session) -> None:
    """Channel 1 holds a branch whose work is taken for its prepare."""
    s.client_data(publish(1, b"a"))
    ch = s.xa_channel(1)
    assert ch is not None
    ch.xa = "1:61:62"
    txn = ch.xa_take_work("1:61:62")
    assert txn is not None and [e.body for e in txn.events] == [b"a"]
    assert txn.txid.startswith("xa/1:61:62/")


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        (publish(1, b"more"), "no more work"),
        (m(C.Tx.Commit(), 1), "commit or roll it back with XA"),
        (m(C.Tx.Rollback(), 1), "commit or roll it back with XA"),
    ],
)
def test_work_or_a_tx_verb_on_a_prepared_branch_closes_its_channel(
    tx: Session, frames: bytes, why: str
) -> None:
    branch_prepared(tx)
    out = tx.client_data(frames)
    [(_, close)] = decode_all(out.to_client)
    assert isinstance(close, C.Channel.Close) and close.reply_code == 406
    assert why in close.reply_text
    assert [type(v) for _, v in decode_all(out.to_broker)] == [C.Channel.Close]
    assert out.xa_gone == [1]  # the broker rolls the channel's transaction back


def test_our_broker_commit_goes_behind_the_marker_and_its_ok_is_swallowed(tx: Session) -> None:
    branch_prepared(tx)
    ch = tx.xa_channel(1)
    assert ch is not None
    answers: list[bool] = []
    frames = ch.xa_broker_commit("xa/1:61:62/1.1.1.1", answers.append)
    sent = decode_all([frames])
    assert [v.name for _, v in sent] == [
        "Basic.Publish",
        "ContentHeader",
        "ContentBody",
        "Tx.Commit",
    ]
    assert sent[0][1].routing_key == MARKER_QUEUE
    out = tx.broker_data(m(C.Tx.CommitOk(), 1))
    assert out.to_client == [] and out.commit == [] and answers == [True]
    ch.xa_unbind()
    out = tx.client_data(publish(1, b"next"))  # the channel's own again
    assert out.to_client == []


def test_our_rollback_makes_the_branch_acks_unacked_again(tx: Session) -> None:
    tx.client_data(m(C.Basic.Consume(queue="q", consumer_tag="t"), 1))
    tx.broker_data(m(C.Basic.ConsumeOk(consumer_tag="t"), 1))
    deliver(tx, 1, "t", ReplicationId.from_parts(7, 1))
    tx.client_data(m(C.Basic.Ack(delivery_tag=1), 1))
    ch = tx.xa_channel(1)
    assert ch is not None
    ch.xa = "1:61:62"
    ch.xa_take_work("1:61:62")
    answers: list[bool] = []
    frames = ch.xa_broker_rollback(answers.append)
    assert [v.name for _, v in decode_all([frames])] == ["Tx.Rollback"]
    out = tx.broker_data(m(C.Tx.RollbackOk(), 1))
    assert out.to_client == [] and answers == [True]
    assert 1 in ch.deliveries


def test_a_channel_closing_under_our_commit_says_so(tx: Session) -> None:
    branch_prepared(tx)
    ch = tx.xa_channel(1)
    assert ch is not None
    answers: list[bool] = []
    ch.xa_broker_commit("xa/1:61:62/1.1.1.1", answers.append)
    out = tx.connection_lost()
    assert answers == [False] and out.xa_gone == [1]


def test_an_xa_request_body_over_64_kib_closes_the_channel_from_its_header(tx: Session) -> None:
    """A request is held back from the broker, so RabbitMQ's size limit
    never applies to it: the listener's own bound does, from the content
    header, before any body byte is buffered (a 100 MiB announced body)."""
    hdr = header.ContentHeader(
        body_size=100 * 2**20, properties=C.Basic.Properties(correlation_id="c", reply_to="r")
    )
    data = m(C.Basic.Publish(exchange="vpnrepl.xa", routing_key="start"), 1)
    out = tx.client_data(data + frame.marshal(hdr, 1))
    closes = [v for _, v in decode_all(out.to_client) if isinstance(v, C.Channel.Close)]
    assert closes and closes[0].reply_code == 406
    assert "an XA request body is at most 65536 bytes" in str(closes[0].reply_text)
    more = tx.client_data(frame.marshal(ContentBody(b"x" * 100_000), 1))
    assert more.xa_calls == [] and out.xa_calls == []
    assert b"".join(more.to_broker) == b""  # nothing of it reaches the broker either
