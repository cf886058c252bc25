"""The listener's wire pieces, without servers: framing, hot decoders, splicing."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, strategies as st
from pamqp import commands, frame, header

from bridge import amqp

short_str = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40
).filter(lambda s: len(s.encode()) < 256)


def _frames(data: bytes, splitter: amqp.FrameSplitter | None = None):
    splitter = splitter or amqp.FrameSplitter()
    buf, frames, fault = splitter.feed(data)
    assert fault is None
    return [bytes(buf[f.start : f.end]) for f in frames], splitter


def test_splitter_whole_and_byte_by_byte_agree() -> None:
    stream = b"".join(
        frame.marshal(m, 1)
        for m in (
            commands.Basic.Publish(exchange="x", routing_key="k"),
            commands.Basic.Ack(delivery_tag=7, multiple=True),
        )
    )
    stream += frame.marshal(header.ContentHeader(body_size=3), 1)
    whole, _ = _frames(stream)
    assert b"".join(whole) == stream and len(whole) == 3
    splitter = amqp.FrameSplitter()
    pieces = []
    for i in range(len(stream)):
        got, splitter = _frames(stream[i : i + 1], splitter)
        pieces.extend(got)
    assert pieces == whole
    assert splitter.pending == 0


def test_splitter_keeps_a_partial_frame_for_later() -> None:
    data = frame.marshal(commands.Basic.Ack(delivery_tag=1), 1)
    got, splitter = _frames(data + data[:5])
    assert got == [data] and splitter.pending == 5


def _stream_and_boundaries() -> tuple[bytes, list[int]]:
    from pamqp.body import ContentBody

    parts = [
        frame.marshal(commands.Basic.Deliver("c", 1, exchange="", routing_key="q"), 1),
        frame.marshal(header.ContentHeader(body_size=300), 1),
        frame.marshal(ContentBody(b"b" * 300), 1),
        frame.marshal(commands.Basic.Ack(delivery_tag=7), 2),
        frame.marshal(commands.Connection.CloseOk(), 0),
    ]
    ends = [sum(len(p) for p in parts[: i + 1]) for i in range(len(parts))]
    return b"".join(parts), [0, *ends]


@given(st.lists(st.integers(min_value=0, max_value=340), max_size=6))
def test_pass_over_follows_frame_boundaries_however_the_bytes_are_cut(cuts: list[int]) -> None:
    """Bytes relayed unsplit, cut anywhere into reads: pass_over knows
    whether a read ended inside a frame, and with one_frame stops exactly
    at the end of the frame in progress, from where feed splits the rest."""
    stream, boundaries = _stream_and_boundaries()
    points = sorted({min(c, len(stream)) for c in cuts})
    splitter, at = amqp.FrameSplitter(), 0
    for point in points:
        assert splitter.pass_over(stream[at:point]) == point - at
        at = point
        assert splitter.in_frame == (at not in boundaries)
    end = splitter.pass_over(stream[at:], one_frame=True)
    assert at + end == min(b for b in boundaries if b >= at)
    assert not splitter.in_frame
    got, _ = _frames(stream[at + end :], splitter)
    assert b"".join(got) == stream[at + end :]


def test_pass_over_byte_by_byte() -> None:
    stream, boundaries = _stream_and_boundaries()
    splitter = amqp.FrameSplitter()
    for i in range(len(stream)):
        assert splitter.pass_over(stream[i : i + 1]) == 1
        assert splitter.in_frame == (i + 1 not in boundaries)
    for start in range(len(stream)):
        splitter = amqp.FrameSplitter()
        splitter.pass_over(stream[:start])
        ends = [
            splitter.pass_over(stream[i : i + 1], one_frame=True) for i in range(start, len(stream))
        ]
        first_boundary = min(b for b in boundaries if b >= start)
        # one byte at a time: each is passed over until the frame ends, then 0
        assert ends == [1] * (first_boundary - start) + [0] * (len(stream) - first_boundary)


@pytest.mark.parametrize(
    ("data", "error", "text"),
    [
        (struct.pack(">BHI", 1, 1, 4) + b"\x00\x3c\x00\x50" + b"\x00", amqp.FrameError, "0xce"),
        (struct.pack(">BHI", 9, 0, 0) + b"\xce", amqp.FrameError, "unknown frame type 9"),
        (b"AMQP\x00\x00\x09\x01", amqp.FrameError, "protocol header"),
    ],
)
def test_splitter_rejects_malformed_frames(data: bytes, error: type, text: str) -> None:
    good = frame.marshal(commands.Basic.Ack(delivery_tag=1), 1)
    buf, frames, fault = amqp.FrameSplitter().feed(good + data)
    assert [buf[f.start : f.end] for f in frames] == [good]  # what came before is kept
    assert isinstance(fault, error)
    assert text in str(fault)


def test_oversize_frame_is_refused_from_its_header_alone() -> None:
    head = struct.pack(">BHI", 3, 1, 200_000)
    _, _, fault = amqp.FrameSplitter(131072).feed(head)
    assert isinstance(fault, amqp.FrameError)
    assert "exceeds frame-max 131072" in str(fault)


def test_unknown_method_is_command_invalid() -> None:
    data = struct.pack(">BHI", 1, 1, 4) + struct.pack(">HH", 99, 1) + b"\xce"
    buf, frames, _ = amqp.FrameSplitter().feed(data)
    with pytest.raises(amqp.CommandInvalid) as info:
        amqp.method_id(buf, frames[0])
    assert info.value.reply_code == 503
    assert "unknown class 99 method 1" in info.value.reply_text


def test_reply_codes_table_maps_codes_to_classes() -> None:
    assert amqp.REPLY_CODES[501] is amqp.FrameError
    assert amqp.REPLY_CODES[502] is amqp.SyntaxError_
    assert amqp.REPLY_CODES[505] is amqp.FrameOutOfOrder
    assert amqp.REPLY_CODES[530] is amqp.NotAllowed


exchange_names = st.text(alphabet="abcXYZ019-_.:", max_size=40)


@given(exchange_names, short_str, st.booleans())
def test_publish_decoder_matches_pamqp(exchange: str, key: str, mandatory: bool) -> None:
    data = frame.marshal(
        commands.Basic.Publish(exchange=exchange, routing_key=key, mandatory=mandatory), 3
    )
    buf, frames, _ = amqp.FrameSplitter().feed(data)
    assert amqp.decode_publish(buf, frames[0]) == (exchange, key, mandatory)


@given(st.integers(0, 2**63 - 1), st.booleans(), st.booleans())
def test_ack_nack_reject_decoders_match_pamqp(tag: int, multiple: bool, requeue: bool) -> None:
    cases = [
        (commands.Basic.Ack(delivery_tag=tag, multiple=multiple), (tag, multiple, False)),
        (
            commands.Basic.Nack(delivery_tag=tag, multiple=multiple, requeue=requeue),
            (tag, multiple, requeue),
        ),
        (commands.Basic.Reject(delivery_tag=tag, requeue=requeue), (tag, False, requeue)),
    ]
    for method, expected in cases:
        buf, frames, _ = amqp.FrameSplitter().feed(frame.marshal(method, 1))
        assert amqp.decode_ack(buf, frames[0]) == expected


@given(short_str.filter(bool), st.integers(1, 2**63 - 1))
def test_deliver_decoder_matches_pamqp(consumer_tag: str, tag: int) -> None:
    data = frame.marshal(
        commands.Basic.Deliver(
            consumer_tag=consumer_tag, delivery_tag=tag, exchange="x", routing_key="k"
        ),
        1,
    )
    buf, frames, _ = amqp.FrameSplitter().feed(data)
    assert amqp.decode_deliver(buf, frames[0]) == (consumer_tag, tag)


def test_encoded_confirms_decode_with_pamqp() -> None:
    for data, cls in (
        (amqp.encode_ack(5, 42, True), commands.Basic.Ack),
        (amqp.encode_nack(5, 42, False), commands.Basic.Nack),
    ):
        _, channel, method = frame.unmarshal(data)
        assert channel == 5 and isinstance(method, cls)
        assert method.delivery_tag == 42


header_values = st.one_of(st.integers(-(2**31), 2**31 - 1), short_str, st.booleans(), st.none())


@given(
    st.dictionaries(short_str.filter(bool), header_values, max_size=5),
    st.sampled_from([None, "text/plain"]),
    st.sampled_from([None, 1, 2]),
    st.sampled_from([None, "msg-1"]),
)
def test_splice_adds_the_id_and_keeps_every_other_byte(headers, content_type, mode, msg_id):
    props = commands.Basic.Properties(
        content_type=content_type,
        headers=headers or None,
        delivery_mode=mode,
        message_id=msg_id,
    )
    payload = header.ContentHeader(body_size=11, properties=props).marshal()
    layout = amqp.property_layout(payload)
    assert layout.delivery_mode == mode
    spliced = amqp.splice_header(payload, layout, "x-vpnrepl-id", amqp.long_field(2**62 + 5))

    decoded = header.ContentHeader()
    decoded.unmarshal(spliced)
    assert decoded.body_size == 11
    assert decoded.properties.headers == {**(headers or {}), "x-vpnrepl-id": 2**62 + 5}
    assert decoded.properties.content_type == content_type
    assert decoded.properties.delivery_mode == mode
    assert decoded.properties.message_id == msg_id
    new_layout = amqp.property_layout(spliced)
    assert amqp.find_header(spliced, new_layout, "x-vpnrepl-id") == amqp.long_field(2**62 + 5)
    # the original table's bytes are untouched: only appended to
    if headers:
        old_table = payload[layout.headers_at + 4 : layout.headers_end]
        new_table = spliced[new_layout.headers_at + 4 : new_layout.headers_end]
        assert new_table.startswith(old_table)


def test_splice_keeps_integer_widths_a_reencode_would_change() -> None:
    # A Java client's Integer header ('I', 4 bytes) must stay an 'I'.
    table = b"\x01n" + b"I" + struct.pack(">i", 5)
    payload = struct.pack(">HHQH", 60, 0, 0, 0x2000 | 0x1000) + struct.pack(">I", len(table))
    payload += table + b"\x02"
    layout = amqp.property_layout(payload)
    spliced = amqp.splice_header(payload, layout, "x-vpnrepl-id", amqp.long_field(0))
    assert b"\x01nI\x00\x00\x00\x05" in spliced


def test_splice_replaces_an_existing_id() -> None:
    props = commands.Basic.Properties(headers={"x-vpnrepl-id": "1" * 32, "a": 1}, delivery_mode=2)
    payload = header.ContentHeader(body_size=0, properties=props).marshal()
    layout = amqp.property_layout(payload)
    spliced = amqp.splice_header(payload, layout, "x-vpnrepl-id", amqp.long_field(2))
    decoded = header.ContentHeader()
    decoded.unmarshal(spliced)
    assert decoded.properties.headers == {"a": 1, "x-vpnrepl-id": 2}


def test_find_header_gives_the_encoded_value_of_any_type_or_none() -> None:
    plain = header.ContentHeader(body_size=0, properties=commands.Basic.Properties()).marshal()
    assert amqp.find_header(plain, amqp.property_layout(plain), "x-vpnrepl-id") is None
    props = commands.Basic.Properties(headers={"x-vpnrepl-id": "ab", "other": 1})
    payload = header.ContentHeader(body_size=0, properties=props).marshal()
    layout = amqp.property_layout(payload)
    assert amqp.find_header(payload, layout, "x-vpnrepl-id") == amqp.longstr_field("ab")
    assert amqp.find_header(payload, layout, "x-vpnrepl") is None  # a prefix is not the key
    # a headers table that does not parse hides the id rather than failing
    broken = payload.replace(b"\x05otherb", b"\x05other?")
    assert amqp.find_header(broken, amqp.property_layout(broken), "x-vpnrepl-id") is None


def test_truncated_properties_are_a_syntax_error() -> None:
    props = commands.Basic.Properties(content_type="text/plain", delivery_mode=2)
    payload = header.ContentHeader(body_size=0, properties=props).marshal()
    with pytest.raises(amqp.SyntaxError_):
        amqp.property_layout(payload[:16])


def test_the_login_user_is_read_from_plain_and_amqplain_and_nothing_else() -> None:
    from pamqp import encode

    amqplain = encode.field_table({"LOGIN": "bob", "PASSWORD": "secret"})[4:]
    assert amqp.login_user("PLAIN", "\x00alice\x00secret") == "alice"
    assert amqp.login_user("PLAIN", "admin\x00alice\x00secret") == "alice"  # authzid ignored
    assert amqp.login_user("AMQPLAIN", amqplain) == "bob"
    assert amqp.login_user("AMQPLAIN", amqplain[:7]) is None  # truncated
    assert amqp.login_user("PLAIN", "alice") is None
    assert amqp.login_user("EXTERNAL", "") is None
