"""The replication id header is invisible to consumers (no servers).

The listener splices ``x-vpnrepl-id`` into a replicated publish's content
header and cuts it out of every message it hands a client (deliver, get-ok,
return), so the consumer gets the publisher's own encoding byte for byte —
never a decode and re-encode, which could change a field's type.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings, strategies as st
from pamqp import commands, frame, header
from pamqp.body import ContentBody

from bridge import REPLICATION_HEADER, IdSource, Published, ReplicationId, Role, amqp
from plugin.session import Session
from plugin.topology import ReplicationScope, Topology, VpnDirectory, VpnView
from tests.unit.plugin.session.test_session import decode_all, m, open_session

C = commands

# Field values of every type pamqp encodes (it picks the narrowest integer).
_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.text(max_size=20)
    | st.floats(width=32, allow_nan=False, allow_infinity=False)
    | st.decimals(places=2, min_value=-1000, max_value=1000),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
_headers = st.none() | st.dictionaries(
    st.text(min_size=0, max_size=12).filter(lambda k: k != REPLICATION_HEADER), _values, max_size=5
)
_properties = st.fixed_dictionaries(
    {"headers": _headers, "delivery_mode": st.just(2)},
    optional={
        "content_type": st.text(max_size=10),
        "priority": st.integers(0, 9),
        "message_id": st.text(max_size=10),
        "app_id": st.text(max_size=10),
        "expiration": st.integers(1, 10**6).map(str),
        "correlation_id": st.text(max_size=10),
    },
)


def session(expose_id: bool = False) -> Session:
    topology = Topology("orders")
    topology.declare_queue("q", {})
    directory = VpnDirectory()
    directory.put(VpnView("orders", Role.ACTIVE, ReplicationScope(), topology, expose_id=expose_id))
    s = Session(directory, IdSource(5))
    open_session(s)
    s.client_data(m(C.Basic.Consume(queue="q", consumer_tag="c", no_ack=True), 1))
    s.broker_data(m(C.Basic.ConsumeOk(consumer_tag="c"), 1))
    return s


def header_frame(properties: dict[str, object], body_size: int = 1) -> bytes:
    props = C.Basic.Properties(**properties)
    return frame.marshal(header.ContentHeader(body_size=body_size, properties=props), 1)


def published(s: Session, hdr: bytes) -> tuple[bytes, Published]:
    """The content header frame the broker gets for ``hdr``, and the event."""
    method = m(C.Basic.Publish(exchange="", routing_key="q"), 1)
    body = frame.marshal(ContentBody(b"x"), 1)
    out = s.client_data(method + hdr + body)
    [(event, _)] = out.events
    assert isinstance(event, Published)
    sent = b"".join(out.to_broker)
    assert sent.startswith(method) and sent.endswith(body)
    return sent[len(method) : -len(body)], event


def delivered(s: Session, hdr: bytes, method: object | None = None) -> bytes:
    """The content header frame the client gets for a message the broker
    hands out with ``hdr``."""
    if method is None:
        method = C.Basic.Deliver(consumer_tag="c", delivery_tag=1, exchange="", routing_key="q")
    out = s.broker_data(m(method, 1) + hdr)
    [(_, got_method), (_, got_header)] = decode_all(out.to_client)
    assert type(got_method) is type(method)
    assert isinstance(got_header, header.ContentHeader)
    data = b"".join(out.to_client)
    return data[len(m(method, 1)) :]


@settings(max_examples=300, deadline=None)
@given(_properties)
def test_a_consumer_gets_the_publishers_encoding_back(properties) -> None:
    s = session()
    original = header_frame(properties)
    to_broker, event = published(s, original)
    assert amqp.find_header(to_broker[7:-1], amqp.property_layout(to_broker[7:-1]),
                            REPLICATION_HEADER) is not None  # fmt: skip
    assert delivered(s, to_broker) == original
    get_ok = C.Basic.GetOk(delivery_tag=2, exchange="", routing_key="q", message_count=0)
    assert delivered(s, to_broker, get_ok) == original
    back = C.Basic.Return(reply_code=312, reply_text="NO_ROUTE", exchange="", routing_key="q")
    assert delivered(s, to_broker, back) == original


def _entries(table: bytes) -> list[bytes]:
    return [table[start:end] for _, start, end in amqp.table_entries(table)]


@settings(max_examples=200, deadline=None)
@given(_headers.filter(bool), st.integers(0, 5))
def test_our_entry_is_cut_wherever_the_broker_put_it(headers, where) -> None:
    """RabbitMQ re-encodes a table it changes (dead-lettering adds
    ``x-death``); our entry may then stand anywhere in it."""
    s = session()
    original = header_frame({"headers": headers, "delivery_mode": 2})
    to_broker, _ = published(s, original)
    payload = to_broker[7:-1]
    layout = amqp.property_layout(payload)
    entries = _entries(payload[layout.headers_at + 4 : layout.headers_end])
    ours = entries.pop()  # the listener appends it
    entries.insert(min(where, len(entries)), ours)
    table = b"".join(entries)
    moved = (
        payload[: layout.headers_at]
        + struct.pack(">I", len(table))
        + table
        + payload[layout.headers_end :]
    )
    assert delivered(s, amqp.frame_bytes(amqp.FRAME_HEADER, 1, moved)) == original


@pytest.mark.parametrize("headers", [None, {}, {"k": 1}])
def test_with_expose_id_consumers_see_the_plain_id(headers) -> None:
    s = session(expose_id=True)
    original = header_frame({"headers": headers, "delivery_mode": 2})
    to_broker, event = published(s, original)
    got = decode_all([delivered(s, to_broker)])[0][1]
    assert isinstance(got, header.ContentHeader)
    assert got.properties.headers == {**(headers or {}), REPLICATION_HEADER: event.repl_id.wire}


def test_a_message_published_while_ids_were_hidden_shows_the_plain_id_once_exposed() -> None:
    hidden = session()
    to_broker, event = published(hidden, header_frame({"delivery_mode": 2}))
    got = decode_all([delivered(session(expose_id=True), to_broker)])[0][1]
    assert got.properties.headers == {REPLICATION_HEADER: event.repl_id.wire}


@pytest.mark.parametrize(
    "value",
    [
        amqp.longstr_field("not an id"),
        b"I" + struct.pack(">i", 5),  # an int32, not our int64
        amqp.longstr_field("zz" * 16),
    ],
)
def test_a_header_of_that_name_that_is_not_ours_is_left_alone(value: bytes) -> None:
    s = session()
    plain = header_frame({"headers": {"a": 1}, "delivery_mode": 2})[7:-1]
    layout = amqp.property_layout(plain)
    foreign = amqp.splice_header(plain, layout, REPLICATION_HEADER, value)
    hdr = amqp.frame_bytes(amqp.FRAME_HEADER, 1, foreign)
    assert delivered(s, hdr) == hdr


def test_the_ids_of_a_table_of_our_own_are_negative_on_the_wire() -> None:
    s = session()
    to_broker, event = published(s, header_frame({"delivery_mode": 2}))
    got = decode_all([to_broker])[0][1]
    assert got.properties.headers == {REPLICATION_HEADER: ~event.repl_id.wire}
    assert ReplicationId.from_wire(~got.properties.headers[REPLICATION_HEADER]) == event.repl_id
