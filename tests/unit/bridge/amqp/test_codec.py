"""The broker client's AMQP pieces without a broker: frames built with
``struct`` checked against pamqp, property splicing, frame splitting and
confirm bookkeeping, the reply-code table."""

from __future__ import annotations

import ast
import struct
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, strategies as st
from pamqp import body, commands, frame, header

from bridge import BridgeError, amqp
from bridge.amqp import (
    HEARTBEAT_FRAME,
    REPLY_CODES,
    AccessRefused,
    AmqpEndpoint,
    AMQPError,
    BrokerConfirms,
    BrokerProtocolError,
    BrokerUnreachable,
    ConnectionForced,
    FrameSplitter,
    NotAllowed,
    NotFound,
    PreconditionFailed,
    PublishRejected,
    broker_frames,
    encode_message,
    persistent_properties,
    refusal,
)

PUBLISH = frame.marshal(commands.Basic.Publish(exchange="", routing_key="q", mandatory=True), 1)


def property_bytes(props: commands.Basic.Properties) -> bytes:
    """pamqp's encoding of ``props`` (flags and values), without class, weight, size."""
    return header.ContentHeader(0, 0, props).marshal()[12:]


def decode_properties(raw: bytes) -> commands.Basic.Properties:
    h = header.ContentHeader()
    h.unmarshal(struct.pack(">HHQ", 60, 0, 0) + raw)
    return h.properties


def unmarshal_all(data: bytes) -> list[Any]:
    out: list[Any] = []
    while data:
        consumed, _, value = frame.unmarshal(data)
        out.append(value)
        data = data[consumed:]
    return out


# ------------------------------------------------------------------ encode_message


@pytest.mark.parametrize("size", [0, 1, 4088, 4089, 10_000])
def test_encoded_frames_decode_with_pamqp(size: int) -> None:
    props = commands.Basic.Properties(
        content_type="text/plain", headers={"x-vpnrepl-id": 2**40, "n": 5}, delivery_mode=2
    )
    raw = property_bytes(props)
    payload = bytes(range(256)) * (size // 256 + 1)
    payload = payload[:size]
    out: list[bytes] = []

    encode_message(out, PUBLISH, 1, raw, payload, 4096)

    data = b"".join(out)
    frames = unmarshal_all(data)
    assert isinstance(frames[0], commands.Basic.Publish) and frames[0].routing_key == "q"
    assert isinstance(frames[1], header.ContentHeader)
    assert frames[1].body_size == size
    assert frames[1].properties == props
    bodies = frames[2:]
    assert all(isinstance(b, body.ContentBody) for b in bodies)
    assert b"".join(b.value for b in bodies) == payload
    assert len(bodies) == -(-size // 4088)  # no empty body frame
    # the property bytes go out verbatim
    assert raw in data


def test_property_bytes_are_not_re_encoded() -> None:
    # a headers table with an "I" (signed 32-bit) 5: pamqp would write "b"
    table = b"\x05countI\x00\x00\x00\x05"
    raw = struct.pack(">HI", 0x3000, len(table)) + table + b"\x02"
    out: list[bytes] = []
    encode_message(out, PUBLISH, 1, raw, b"x", 131072)
    assert raw in b"".join(out)
    assert b"countb" in property_bytes(decode_properties(raw))  # what a codec would send


# ------------------------------------------------------------------ persistent_properties

_shortstr = st.text(alphabet=st.characters(codec="ascii"), max_size=20)


@st.composite
def properties(draw: st.DrawFn) -> commands.Basic.Properties:
    fields: dict[str, st.SearchStrategy[Any]] = {
        "content_type": _shortstr,
        "content_encoding": _shortstr,
        "headers": st.dictionaries(_shortstr.filter(bool), st.integers(-(2**31), 2**31 - 1)),
        "delivery_mode": st.sampled_from([1, 2]),
        "priority": st.integers(0, 9),
        "correlation_id": _shortstr,
        "message_id": _shortstr,
        "timestamp": st.datetimes(
            min_value=datetime(2000, 1, 1),
            max_value=datetime(2100, 1, 1),
        ).map(lambda d: d.replace(microsecond=0)),
        "app_id": _shortstr,
    }
    chosen = draw(st.sets(st.sampled_from(sorted(fields))))
    return commands.Basic.Properties(**{k: draw(fields[k]) for k in chosen})


@given(properties())
def test_persistent_properties_sets_mode_2_and_keeps_everything_else(
    props: commands.Basic.Properties,
) -> None:
    raw = property_bytes(props)

    got = persistent_properties(raw)

    before, after = decode_properties(raw), decode_properties(got)
    assert after.delivery_mode == 2
    for name in props.__slots__:
        if name != "delivery_mode":
            assert getattr(after, name) == getattr(before, name), name
    if props.delivery_mode == 2:
        assert got is raw


@pytest.mark.parametrize(
    "raw",
    [b"", b"\x10", b"\x80\x00\x05ab", b"\x20\x00\x00\x00\x00\x09ab", b"\x10\x00", b"\x10\x01\x02"],
    ids=["empty", "half-flags", "short-content-type", "short-table", "no-mode-octet", "continued"],
)
def test_malformed_properties_are_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        persistent_properties(raw)


# ------------------------------------------------------------------ broker_frames


def _frames() -> bytes:
    return (
        frame.marshal(commands.Basic.Ack(delivery_tag=3, multiple=True), 1)
        + HEARTBEAT_FRAME
        + frame.marshal(commands.Channel.Close(404, "NOT_FOUND - no queue 'q'", 50, 10), 1)
    )


def _split(splitter: FrameSplitter, data: bytes) -> list[tuple[int, int, bytes]]:
    buf, frames = broker_frames(splitter, data)
    return [(f.type, f.channel, buf[f.start : f.end]) for f in frames]


def test_splitter_cuts_whole_frames_fed_at_once_or_byte_by_byte() -> None:
    data = _frames()
    whole = _split(FrameSplitter(131072), data)
    splitter = FrameSplitter(131072)
    pieces = [f for i in range(len(data)) for f in _split(splitter, data[i : i + 1])]
    assert whole == pieces
    assert [(t, c) for t, c, _ in whole] == [(1, 1), (8, 0), (1, 1)]
    assert b"".join(raw for _, _, raw in whole) == data


def test_splitter_keeps_a_partial_frame_for_later() -> None:
    data = _frames()
    splitter = FrameSplitter(131072)
    assert len(_split(splitter, data + data[:10])) == 3
    assert len(_split(splitter, data[10:])) == 3


def test_splitter_refuses_a_bad_end_octet_an_oversize_frame_and_another_protocol() -> None:
    data = bytearray(_frames())
    data[7 + 13] = 0
    with pytest.raises(BrokerProtocolError, match="end octet"):
        broker_frames(FrameSplitter(131072), bytes(data))
    with pytest.raises(BrokerProtocolError, match="frame-max 4096"):
        broker_frames(FrameSplitter(4096), struct.pack(">BHI", 3, 1, 5000))
    with pytest.raises(BrokerProtocolError, match="offered protocol 00000901"):
        broker_frames(FrameSplitter(131072), b"AMQP\x00\x00\x09\x01")


# ------------------------------------------------------------------ BrokerConfirms


def test_tracker_counts_single_and_multiple_acks_once() -> None:
    t = BrokerConfirms()
    t.sent(10)
    assert t.unconfirmed == 10
    assert t.ack(3, False) == 1
    assert t.ack(5, False) == 1
    assert t.ack(4, True) == 3  # 1, 2, 4 (3 was in already)
    assert t.ack(6, True) == 1  # 6 (5 was in already)
    assert t.ack(6, True) == 0  # an old multiple: nothing new
    assert t.ack(10, False) == 1
    assert t.ack(9, True) == 3  # 7, 8, 9; 10 already
    assert (t.confirmed, t.unconfirmed) == (10, 0)


def test_tracker_refuses_a_tag_never_sent_or_acked_twice() -> None:
    t = BrokerConfirms()
    t.sent(3)
    with pytest.raises(BrokerProtocolError, match="never published"):
        t.ack(4, False)
    with pytest.raises(BrokerProtocolError, match="never published"):
        t.ack(0, True)
    t.ack(2, False)
    with pytest.raises(BrokerProtocolError, match="twice"):
        t.ack(2, False)
    t.ack(1, True)
    with pytest.raises(BrokerProtocolError, match="twice"):
        t.ack(1, False)


# ------------------------------------------------------------------ address and errors


def test_endpoint_from_url() -> None:
    e = AmqpEndpoint.from_url("amqps://us%40er:p%3Ass@broker.example/%2F")
    assert (e.host, e.port, e.tls, e.username, e.password) == (
        "broker.example",
        5671,
        True,
        "us@er",
        "p:ss",
    )
    assert "p:ss" not in repr(e) and "p:ss" not in str(e)
    plain = AmqpEndpoint.from_url("amqp://127.0.0.1:5673")
    assert (plain.port, plain.tls, plain.username, plain.password) == (
        5673,
        False,
        "guest",
        "guest",
    )
    with pytest.raises(ValueError, match="amqp://"):
        AmqpEndpoint.from_url("http://host/")


def test_reply_codes_map_to_classes() -> None:
    not_found = refusal("channel", 404, "NOT_FOUND", (50, 10))
    assert isinstance(not_found, NotFound) and not_found.method == (50, 10)
    assert isinstance(refusal("connection", 403, "ACCESS_REFUSED"), AccessRefused)
    assert isinstance(refusal("connection", 530, "NOT_ALLOWED"), NotAllowed)
    assert isinstance(refusal("connection", 320, "CONNECTION_FORCED"), ConnectionForced)
    assert isinstance(refusal("channel", 406, "PRECONDITION_FAILED"), PreconditionFailed)
    other = refusal("channel", 541, "INTERNAL_ERROR")
    assert type(other) is AMQPError
    assert (other.reply_code, other.reply_text) == (541, "INTERNAL_ERROR")
    assert "541 INTERNAL_ERROR" in str(other)
    # a code without a class of its own keeps the broker's code and text
    unknown = refusal("channel", 504, "CHANNEL_ERROR - second 'channel.open'")
    assert type(unknown) is AMQPError
    assert (unknown.reply_code, unknown.reply_text) == (
        504,
        "CHANNEL_ERROR - second 'channel.open'",
    )
    assert AMQPError.reply_code == 541  # the instance's code did not leak into the class


def test_every_reply_code_class_is_in_the_table_under_its_own_code() -> None:
    for code, cls in REPLY_CODES.items():
        assert cls.reply_code == code
        assert issubclass(cls, AMQPError)


def test_one_root_for_both_ends() -> None:
    """The listener's errors and the broker client's share one root, under
    the bridge's; an error of ours says its reply code's name."""
    for cls in (BrokerUnreachable, BrokerProtocolError, PublishRejected, NotFound):
        assert issubclass(cls, AMQPError)
    assert issubclass(AMQPError, BridgeError)
    refused = AccessRefused("no", (10, 11))
    assert (refused.reply_code, refused.reply_text, refused.method) == (
        403,
        "ACCESS_REFUSED - no",
        (10, 11),
    )


def _defined_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_the_amqp_vocabulary_is_defined_once() -> None:
    """What bridge.amqp exports is defined nowhere else: the listener and the
    broker client once had an error class per reply code each, a frame
    splitter each and a confirm tracker each."""
    root = Path(__file__).resolve().parent.parent
    own = root / "bridge" / "amqp"
    exported = set(amqp.__all__)
    again = sorted(
        f"{path.relative_to(root)}: {name}"
        for package in ("plugin", "txn", "bridge")
        for path in (root / package).rglob("*.py")
        if own not in path.parents
        for name in _defined_names(path) & exported
    )
    assert again == []
