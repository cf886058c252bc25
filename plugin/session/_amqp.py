"""AMQP 0-9-1 wire pieces the listener needs, without I/O.

Invariant: bytes the listener does not have to change are relayed exactly as
received. The :class:`FrameSplitter` cuts the stream on frame headers (7 bytes
and a frame-end octet, ~1.6 µs a frame) and hands back offsets, never copies;
only the frames replication needs are decoded — the hot ones (publish, ack,
deliver, confirms) with ``struct`` here, the rare ones with pamqp. A content
header that must carry a replication id is *spliced*, not re-encoded: pamqp
would re-encode every header value with its own choice of integer width, and a
Java consumer expecting an ``Integer`` would then get a ``Byte``.

Protocol faults are exceptions whose class carries the AMQP reply code, found
through :data:`REPLY_CODES`, so the session can close the client connection
with the right code and a reply text that names the fault.
"""

from __future__ import annotations

import decimal
import functools
import struct
from collections.abc import Callable
from typing import ClassVar, NamedTuple

from pamqp import base, commands, frame

__all__ = [
    "AMQPError",
    "AccessRefused",
    "CommandInvalid",
    "FrameError",
    "FrameSplitter",
    "NotAllowed",
    "PROTOCOL_HEADER",
    "REPLY_CODES",
    "SyntaxError_",
    "UnexpectedFrame",
    "login_user",
]

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_HEARTBEAT = 1, 2, 3, 8
FRAME_END = 0xCE
_FRAME_HEAD = struct.Struct(">BHI")
_METHOD_ID = struct.Struct(">HH")
_I64 = struct.Struct(">q")
_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")
#: class id, weight, body size, property flags
_CONTENT_HEAD = struct.Struct(">HHQH")

# (class id, method id) of the methods the session looks at.
CONNECTION_START_OK = (10, 11)
CONNECTION_TUNE = (10, 30)
CONNECTION_TUNE_OK = (10, 31)
CONNECTION_OPEN = (10, 40)
CONNECTION_OPEN_OK = (10, 41)
CONNECTION_CLOSE = (10, 50)
CONNECTION_CLOSE_OK = (10, 51)
CHANNEL_OPEN = (20, 10)
CHANNEL_CLOSE = (20, 40)
CHANNEL_CLOSE_OK = (20, 41)
EXCHANGE_DECLARE, EXCHANGE_DECLARE_OK = (40, 10), (40, 11)
EXCHANGE_DELETE, EXCHANGE_DELETE_OK = (40, 20), (40, 21)
EXCHANGE_BIND, EXCHANGE_BIND_OK = (40, 30), (40, 31)
EXCHANGE_UNBIND, EXCHANGE_UNBIND_OK = (40, 40), (40, 51)
QUEUE_DECLARE, QUEUE_DECLARE_OK = (50, 10), (50, 11)
QUEUE_BIND, QUEUE_BIND_OK = (50, 20), (50, 21)
QUEUE_PURGE, QUEUE_PURGE_OK = (50, 30), (50, 31)
QUEUE_DELETE, QUEUE_DELETE_OK = (50, 40), (50, 41)
QUEUE_UNBIND, QUEUE_UNBIND_OK = (50, 50), (50, 51)
BASIC_CONSUME, BASIC_CONSUME_OK = (60, 20), (60, 21)
BASIC_CANCEL, BASIC_CANCEL_OK = (60, 30), (60, 31)
BASIC_PUBLISH = (60, 40)
BASIC_RETURN = (60, 50)
BASIC_DELIVER = (60, 60)
BASIC_GET, BASIC_GET_OK, BASIC_GET_EMPTY = (60, 70), (60, 71), (60, 72)
BASIC_ACK = (60, 80)
BASIC_REJECT = (60, 90)
BASIC_RECOVER_ASYNC, BASIC_RECOVER = (60, 100), (60, 110)
BASIC_NACK = (60, 120)
CONFIRM_SELECT, CONFIRM_SELECT_OK = (85, 10), (85, 11)
TX_SELECT, TX_SELECT_OK = (90, 10), (90, 11)
TX_COMMIT, TX_COMMIT_OK = (90, 20), (90, 21)
TX_ROLLBACK, TX_ROLLBACK_OK = (90, 30), (90, 31)

#: channel-level reply code of a refused transaction (as RabbitMQ uses for tx errors)
PRECONDITION_FAILED = 406
#: channel-level reply code of a method on a name the product reserves
ACCESS_REFUSED = 403

# Methods that carry content (a header and body frames follow).
CONTENT_METHODS = {BASIC_PUBLISH, BASIC_RETURN, BASIC_DELIVER, BASIC_GET_OK}
_KNOWN_METHODS = {(index >> 16, index & 0xFFFF) for index in commands.INDEX_MAPPING}


# ---------------------------------------------------------------- errors


class AMQPError(Exception):
    """A protocol fault; ``reply_code`` and ``reply_text`` go on the wire."""

    reply_code: ClassVar[int] = 541
    reply_name: ClassVar[str] = "INTERNAL_ERROR"

    def __init__(self, text: str, method: tuple[int, int] = (0, 0)) -> None:
        super().__init__(text)
        self.method = method

    @property
    def reply_text(self) -> str:
        text = f"{self.reply_name} - {self.args[0]}"
        return text.encode()[:255].decode(errors="ignore")


class FrameError(AMQPError):
    reply_code, reply_name = 501, "FRAME_ERROR"


class SyntaxError_(AMQPError):  # noqa: N801 - the AMQP name, kept apart from the builtin
    reply_code, reply_name = 502, "SYNTAX_ERROR"


class CommandInvalid(AMQPError):
    reply_code, reply_name = 503, "COMMAND_INVALID"


class UnexpectedFrame(AMQPError):
    reply_code, reply_name = 505, "UNEXPECTED_FRAME"


class NotAllowed(AMQPError):
    reply_code, reply_name = 530, "NOT_ALLOWED"


class ConnectionForced(AMQPError):
    reply_code, reply_name = 320, "CONNECTION_FORCED"


class AccessRefused(AMQPError):
    reply_code, reply_name = 403, "ACCESS_REFUSED"


REPLY_CODES: dict[int, type[AMQPError]] = {
    cls.reply_code: cls
    for cls in (
        FrameError,
        SyntaxError_,
        CommandInvalid,
        UnexpectedFrame,
        NotAllowed,
        ConnectionForced,
        AccessRefused,
        AMQPError,
    )
}


# ---------------------------------------------------------------- frames


class Frame(NamedTuple):
    """One frame inside a buffer: ``buf[start:end]`` is the whole frame.

    A NamedTuple, not a frozen dataclass: one is made per frame on the hot
    path, and tuple construction is several times cheaper.
    """

    type: int
    channel: int
    start: int
    end: int

    @property
    def payload_start(self) -> int:
        return self.start + 7

    @property
    def payload_end(self) -> int:
        return self.end - 1


class FrameSplitter:
    """Cut a byte stream into frames; keep the incomplete tail for next time.

    ``frame_max`` (0: no limit) is the negotiated maximum frame size; a larger
    frame is a :class:`FrameError` as soon as its header is seen, before its
    payload is buffered, so an oversize frame cannot exhaust memory.

    Bytes relayed without being split (:meth:`pass_over`: the broker's side
    of a vhost that is not replicated) still have their frame boundaries
    followed, from the headers alone, so that splitting can take over later
    at a boundary (:meth:`finish_frame`), not in the middle of a frame.
    """

    def __init__(self, frame_max: int = 0) -> None:
        self.frame_max = frame_max
        self._tail = b""
        #: after pass_over: bytes of the frame in progress still to come,
        #: or the start of its header when the header itself was cut
        self._skip = 0
        self._passed_head = b""

    def feed(self, data: bytes) -> tuple[bytes, list[Frame], AMQPError | None]:
        """Return ``(buffer, frames, fault)``: the frames complete in ``buffer``
        and, if the stream broke after them, the fault (the frames before it
        are still good and are relayed)."""
        buf = self._tail + data if self._tail else data
        frames: list[Frame] = []
        new_frame = tuple.__new__  # Frame's own __new__ is a Python function
        pos, n = 0, len(buf)
        limit = self.frame_max
        fault: AMQPError | None = None
        while n - pos >= 7:
            ftype, channel, size = _FRAME_HEAD.unpack_from(buf, pos)
            if ftype not in (FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_HEARTBEAT):
                if buf[pos : pos + 4] == b"AMQP":
                    fault = FrameError("protocol header received inside an open connection")
                else:
                    fault = FrameError(f"unknown frame type {ftype}")
                break
            if limit and size + 8 > limit:
                fault = FrameError(f"frame of {size + 8} bytes exceeds frame-max {limit}")
                break
            end = pos + 7 + size + 1
            if end > n:
                break
            if buf[end - 1] != FRAME_END:
                fault = FrameError(f"frame-end octet is {buf[end - 1]:#04x}, expected 0xce")
                break
            frames.append(new_frame(Frame, (ftype, channel, pos, end)))
            pos = end
        self._tail = b"" if fault else buf[pos:]
        return buf, frames, fault

    @property
    def pending(self) -> int:
        return len(self._tail)

    def take_tail(self) -> bytes:
        """Hand over the buffered partial frame (when parsing stops)."""
        tail, self._tail = self._tail, b""
        return tail

    def pass_over(self, data: bytes, *, one_frame: bool = False) -> int:
        """Follow the frame boundaries of ``data``, bytes relayed as they came
        (from a frame boundary, or where the last call left off). Returns how
        many bytes of ``data`` were passed over: all of them, or with
        ``one_frame`` those up to the end of the frame in progress (0 at a
        boundary). Only frame headers are read; nothing is buffered but a
        header cut by the end of ``data`` (under 7 bytes)."""
        n = len(data)
        pos = self._skip  # where the next frame starts in data
        head = self._passed_head
        if head:  # the frame in progress began with a header cut short
            if len(head) + n < 7:
                self._passed_head = head + data
                return n
            missing = 7 - len(head)
            pos = missing + _FRAME_HEAD.unpack(head + data[:missing])[2] + 1
            self._passed_head = b""
        if not one_frame:
            while pos + 7 <= n:
                pos += 7 + _FRAME_HEAD.unpack_from(data, pos)[2] + 1
        if pos >= n:
            self._skip = pos - n
            return n
        self._skip = 0
        if one_frame:
            return pos
        self._passed_head = data[pos:]
        return n

    @property
    def in_frame(self) -> bool:
        """:meth:`pass_over` stopped inside a frame."""
        return bool(self._skip or self._passed_head)


def method_id(buf: bytes, f: Frame) -> tuple[int, int]:
    if f.end - f.start < 12:
        raise FrameError("method frame too short for a class and method id")
    ids: tuple[int, int] = _METHOD_ID.unpack_from(buf, f.payload_start)
    if ids not in _KNOWN_METHODS:
        raise CommandInvalid(f"unknown class {ids[0]} method {ids[1]}", ids)
    return ids


def decode_method(buf: bytes, f: Frame) -> base.Frame:
    """Decode a rare method frame with pamqp; faults become 502 SYNTAX_ERROR."""
    try:
        _, _, value = frame.unmarshal(buf[f.start : f.end])
    except Exception as e:  # pamqp raises several types for malformed arguments
        ids = _METHOD_ID.unpack_from(buf, f.payload_start)
        raise SyntaxError_(f"malformed arguments of method {ids[0]}.{ids[1]}", ids) from e
    assert isinstance(value, base.Frame)  # noqa: S101 - method frames decode to methods
    return value


def decode_properties(buf: bytes, f: Frame) -> commands.Basic.Properties:
    """Decode a rare content header's properties with pamqp; faults become
    502 SYNTAX_ERROR."""
    try:
        _, _, value = frame.unmarshal(buf[f.start : f.end])
    except Exception as e:  # pamqp raises several types for malformed properties
        raise SyntaxError_("malformed content header properties") from e
    properties = getattr(value, "properties", None)
    if not isinstance(properties, commands.Basic.Properties):
        raise SyntaxError_("malformed content header properties")
    return properties


def marshal_method(method: base.Frame, channel: int) -> bytes:
    return frame.marshal(method, channel)


# ------------------------------------------------- hot methods, by struct


def _shortstr(buf: bytes, pos: int) -> tuple[str, int]:
    n = buf[pos]
    return buf[pos + 1 : pos + 1 + n].decode(), pos + 1 + n


def decode_publish(buf: bytes, f: Frame) -> tuple[str, str, bool]:
    """basic.publish → (exchange, routing key, mandatory)."""
    try:
        pos = f.start + 13  # frame head, ids, reserved-1
        n = buf[pos]
        exchange = buf[pos + 1 : pos + 1 + n].decode()
        pos += 1 + n
        n = buf[pos]
        key = buf[pos + 1 : pos + 1 + n].decode()
        pos += 1 + n
        if pos >= f.end - 1:
            raise IndexError
        return exchange, key, bool(buf[pos] & 1)
    except (IndexError, UnicodeDecodeError) as e:
        raise SyntaxError_("malformed basic.publish", BASIC_PUBLISH) from e


def decode_ack(buf: bytes, f: Frame) -> tuple[int, bool, bool]:
    """basic.ack / basic.nack / basic.reject → (delivery tag, multiple, requeue).

    For basic.ack ``requeue`` is False; for basic.reject ``multiple`` is False.
    """
    pos = f.payload_start + 4
    if f.payload_end - pos < 9:
        ids = _METHOD_ID.unpack_from(buf, f.payload_start)
        raise SyntaxError_(f"malformed arguments of method {ids[0]}.{ids[1]}", ids)
    tag = _U64.unpack_from(buf, pos)[0]
    bits = buf[pos + 8]
    kind = buf[f.payload_start + 3]  # method id low byte: 80 ack, 90 reject, 120 nack
    if kind == 80:
        return tag, bool(bits & 1), False
    if kind == 90:
        return tag, False, bool(bits & 1)
    return tag, bool(bits & 1), bool(bits & 2)


def decode_deliver(buf: bytes, f: Frame) -> tuple[str, int]:
    """basic.deliver → (consumer tag, delivery tag)."""
    try:
        tag, pos = _shortstr(buf, f.payload_start + 4)
        return tag, _U64.unpack_from(buf, pos)[0]
    except (IndexError, UnicodeDecodeError, struct.error) as e:
        raise SyntaxError_("malformed basic.deliver", BASIC_DELIVER) from e


def decode_get_ok(buf: bytes, f: Frame) -> int:
    """basic.get-ok → delivery tag."""
    return int(_U64.unpack_from(buf, f.payload_start + 4)[0])


def encode_ack(channel: int, tag: int, multiple: bool) -> bytes:
    payload = b"\x00\x3c\x00\x50" + _U64.pack(tag) + (b"\x01" if multiple else b"\x00")
    return _FRAME_HEAD.pack(FRAME_METHOD, channel, len(payload)) + payload + b"\xce"


def encode_nack(channel: int, tag: int, multiple: bool) -> bytes:
    payload = b"\x00\x3c\x00\x78" + _U64.pack(tag) + (b"\x01" if multiple else b"\x00")
    return _FRAME_HEAD.pack(FRAME_METHOD, channel, len(payload)) + payload + b"\xce"


def content_body_size(buf: bytes, f: Frame) -> int:
    if f.payload_end - f.payload_start < 14:
        raise SyntaxError_("content header frame too short")
    return int(_U64.unpack_from(buf, f.payload_start + 4)[0])


# ------------------------------------------------- content header splicing

_FLAG_CONTENT_TYPE, _FLAG_CONTENT_ENCODING = 0x8000, 0x4000
_FLAG_HEADERS, _FLAG_DELIVERY_MODE = 0x2000, 0x1000


class PropertyLayout(NamedTuple):
    """Where the headers table and delivery mode sit in a content header
    (a NamedTuple: one is made per publish)."""

    flags: int
    headers_at: int  # offset of the table (its length) or of where it would go
    headers_end: int  # == headers_at when there is no table
    delivery_mode: int | None
    body_size: int  # from the content header


# property flag -> size of its value: >0 fixed, -1 shortstr, -4 u32-prefixed table
_LATER_PROPERTIES = (
    (0x0800, 1),  # priority
    (0x0400, -1),  # correlation-id
    (0x0200, -1),  # reply-to
    (0x0100, -1),  # expiration
    (0x0080, -1),  # message-id
    (0x0040, 8),  # timestamp
    (0x0020, -1),  # type
    (0x0010, -1),  # user-id
    (0x0008, -1),  # app-id
    (0x0004, -1),  # cluster-id
)


def _skip_later_properties(payload: bytes, flags: int, pos: int) -> int:
    if not flags & 0x0FFC:  # none of them: the common case
        return pos
    for flag, size in _LATER_PROPERTIES:
        if flags & flag:
            pos += 1 + payload[pos] if size == -1 else size
    return pos


def _check_flags(flags: int) -> None:
    if flags & 1:
        raise SyntaxError_("content header property flags continue past one word")
    if flags & 0x2:
        raise SyntaxError_("content header sets an undefined property flag")


def property_layout(payload: bytes) -> PropertyLayout:
    """Check a content header payload (without the frame head) the way the
    broker will, and say where its headers table and delivery mode are.

    Every property is walked, so a header the broker would refuse is refused
    here first and never becomes a replication event. Bytes after the last
    property are tolerated, as RabbitMQ tolerates them.
    """
    try:
        class_id, weight, body_size, flags = _CONTENT_HEAD.unpack_from(payload, 0)
        if class_id != 60:
            raise UnexpectedFrame(f"content header for class {class_id}, expected 60 (basic)")
        if weight != 0:
            raise SyntaxError_(f"content header weight {weight}, expected 0")
        if flags == _FLAG_DELIVERY_MODE:  # the common case: nothing but the mode
            if len(payload) < 15:
                raise IndexError
            return PropertyLayout(flags, 14, 14, payload[14], body_size)
        _check_flags(flags)
        pos = 14
        if flags & _FLAG_CONTENT_TYPE:
            pos += 1 + payload[pos]
        if flags & _FLAG_CONTENT_ENCODING:
            pos += 1 + payload[pos]
        headers_at = pos
        if flags & _FLAG_HEADERS:
            pos += 4 + _U32.unpack_from(payload, pos)[0]
        headers_end = pos
        delivery_mode = None
        if flags & _FLAG_DELIVERY_MODE:
            delivery_mode = payload[pos]
            pos += 1
        pos = _skip_later_properties(payload, flags, pos)
        if pos > len(payload):  # trailing bytes: RabbitMQ ignores them too
            raise SyntaxError_(f"content header properties overrun the frame ({pos} bytes)")
        return PropertyLayout(flags, headers_at, headers_end, delivery_mode, body_size)
    except (IndexError, struct.error) as e:
        raise SyntaxError_("malformed content header properties") from e


_FIXED: dict[int, struct.Struct] = {
    ord(code): struct.Struct(fmt)
    for code, fmt in (
        ("t", ">?"),
        ("b", ">b"),
        ("B", ">B"),
        ("s", ">h"),
        ("u", ">H"),
        ("I", ">i"),
        ("i", ">I"),
        ("l", ">q"),
        ("L", ">q"),
        ("f", ">f"),
        ("d", ">d"),
        ("T", ">Q"),
    )
}


def _long_string(buf: bytes, pos: int) -> tuple[object, int]:
    n = _U32.unpack_from(buf, pos)[0]
    end = pos + 4 + n
    if end > len(buf):
        raise IndexError
    raw = buf[pos + 4 : end]
    try:
        return raw.decode(), end
    except UnicodeDecodeError:
        return raw, end


def _byte_array(buf: bytes, pos: int) -> tuple[object, int]:
    n = _U32.unpack_from(buf, pos)[0]
    if pos + 4 + n > len(buf):
        raise IndexError
    return buf[pos + 4 : pos + 4 + n], pos + 4 + n


def _nested_table(buf: bytes, pos: int) -> tuple[object, int]:
    n = _U32.unpack_from(buf, pos)[0]
    return _field_table(buf, pos + 4, pos + 4 + n), pos + 4 + n


def _array(buf: bytes, pos: int) -> tuple[object, int]:
    n = _U32.unpack_from(buf, pos)[0]
    end, items, at = pos + 4 + n, [], pos + 4
    while at < end:
        value, at = _field_value(buf, at)
        items.append(value)
    if at != end:
        raise IndexError
    return items, end


def _decimal(buf: bytes, pos: int) -> tuple[object, int]:
    scale, value = struct.unpack_from(">Bi", buf, pos)
    return decimal.Decimal(value).scaleb(-scale), pos + 5


def _void(buf: bytes, pos: int) -> tuple[object, int]:
    return None, pos


_VARIABLE: dict[int, Callable[[bytes, int], tuple[object, int]]] = {
    ord("S"): _long_string,
    ord("x"): _byte_array,
    ord("F"): _nested_table,
    ord("A"): _array,
    ord("D"): _decimal,
    ord("V"): _void,
}


def _field_value(buf: bytes, pos: int) -> tuple[object, int]:
    """Decode one field value at ``pos``; timestamps stay integers (seconds),
    so no magnitude the broker accepts can make decoding fail."""
    code = buf[pos]
    fixed = _FIXED.get(code)
    if fixed is not None:
        end = pos + 1 + fixed.size
        if end > len(buf):
            raise IndexError
        return fixed.unpack_from(buf, pos + 1)[0], end
    decoder = _VARIABLE.get(code)
    if decoder is None:
        raise ValueError(f"unknown field type {chr(code)!r}")
    return decoder(buf, pos + 1)


def _field_table(buf: bytes, pos: int, end: int) -> dict[str, object]:
    if end > len(buf):
        raise IndexError
    out: dict[str, object] = {}
    while pos < end:
        klen = buf[pos]
        key = buf[pos + 1 : pos + 1 + klen].decode()
        out[key], pos = _field_value(buf, pos + 1 + klen)
    if pos != end:
        raise IndexError
    return out


def login_user(mechanism: str, response: str | bytes) -> str | None:
    """The user name a ``connection.start-ok`` logs in as (PLAIN's
    ``authzid NUL authcid NUL password``, AMQPLAIN's ``LOGIN``); None when
    the response does not say. The password is never kept."""
    raw = response if isinstance(response, bytes) else response.encode()
    if mechanism == "PLAIN":
        parts = raw.split(b"\0")
        return parts[1].decode(errors="replace") if len(parts) == 3 else None
    if mechanism == "AMQPLAIN":
        try:
            login = _field_table(raw, 0, len(raw)).get("LOGIN")
        except (IndexError, ValueError, struct.error, UnicodeDecodeError):
            return None
        if isinstance(login, bytes):
            return login.decode(errors="replace")
        return login if isinstance(login, str) else None
    return None


def _table_entries(table: bytes) -> list[tuple[str, int, int]]:
    """(key, entry start, entry end) of each entry of a field table's body."""
    out = []
    pos = 0
    while pos < len(table):
        start = pos
        klen = table[pos]
        key = table[pos + 1 : pos + 1 + klen].decode(errors="replace")
        _, pos = _field_value(table, pos + 1 + klen)
        out.append((key, start, pos))
    return out


@functools.cache
def _entry_prefix(key: str) -> bytes:
    return bytes([len(key)]) + key.encode()


def long_field(value: int) -> bytes:
    """A signed 64-bit integer as a field-table value (type ``l``)."""
    return b"l" + _I64.pack(value)


def longstr_field(value: str) -> bytes:
    """A string as a field-table value (type ``S``)."""
    raw = value.encode()
    return b"S" + _U32.pack(len(raw)) + raw


def splice_header(payload: bytes, layout: PropertyLayout, key: str, value: bytes) -> bytes:
    """The content header payload with ``key`` in its headers, its encoded
    field ``value`` (type octet and data: :func:`long_field`, ...).

    Every other byte stays as the client sent it; an existing ``key`` is
    replaced (a message re-published from a replicated queue gets a new id).
    Our entry ends the headers table.
    """
    entry = _entry_prefix(key) + value
    if layout.flags & _FLAG_HEADERS:
        body = payload[layout.headers_at + 4 : layout.headers_end]
        if key.encode() in body:
            try:
                kept = [body[s:e] for k, s, e in _table_entries(body) if k != key]
            except (ValueError, IndexError, struct.error) as e:
                raise SyntaxError_("malformed headers table in content header") from e
            body = b"".join(kept)
        table = _U32.pack(len(body) + len(entry)) + body + entry
        return payload[: layout.headers_at] + table + payload[layout.headers_end :]
    flags = _U16.pack(layout.flags | _FLAG_HEADERS)
    at = layout.headers_at
    return b"".join(
        (payload[:12], flags, payload[14:at], _U32.pack(len(entry)), entry, payload[at:])
    )


def find_header(payload: bytes, layout: PropertyLayout, key: str) -> bytes | None:
    """The encoded field value (type octet and data) of ``key`` in the
    headers, or None (absent, or a headers table that does not parse)."""
    at = header_entry(payload, layout, key)
    if at is None:
        return None
    return payload[at[0] + len(_entry_prefix(key)) : at[1]]


def header_entry(payload: bytes, layout: PropertyLayout, key: str) -> tuple[int, int] | None:
    """Where ``key``'s entry (name and value) sits in ``payload``, as
    ``(start, end)`` offsets, or None (absent, or a table that does not
    parse). The table is walked entry by entry, so a value that merely
    contains the key's bytes is never taken for it."""
    if not layout.flags & _FLAG_HEADERS:
        return None
    body_at = layout.headers_at + 4
    body = payload[body_at : layout.headers_end]
    if _entry_prefix(key) not in body:
        return None
    try:
        for k, s, e in _table_entries(body):
            if k == key:
                return body_at + s, body_at + e
    except (ValueError, IndexError, struct.error):
        return None
    return None


def without_entry(
    payload: bytes, layout: PropertyLayout, start: int, end: int, *, drop_empty: bool
) -> bytes:
    """``payload`` with the headers-table entry at ``start:end`` cut out:
    the table's length is fixed and every other byte is kept as it was (no
    value is decoded or re-encoded). With ``drop_empty``, a table left empty
    goes too, and its property flag with it: the header as it was before
    :func:`splice_header` added a table of its own."""
    if drop_empty and end - start == layout.headers_end - layout.headers_at - 4:
        flags = _U16.pack(layout.flags & ~_FLAG_HEADERS)
        return payload[:12] + flags + payload[14 : layout.headers_at] + payload[end:]
    size = _U32.pack(layout.headers_end - layout.headers_at - 4 - (end - start))
    at = layout.headers_at
    return b"".join((payload[:at], size, payload[at + 4 : start], payload[end:]))


def decode_headers(payload: bytes, layout: PropertyLayout) -> dict[str, object]:
    """The decoded headers table, for routing by headers, CC and BCC."""
    if not layout.flags & _FLAG_HEADERS:
        return {}
    try:
        return _field_table(payload, layout.headers_at + 4, layout.headers_end)
    except (ValueError, IndexError, struct.error, UnicodeDecodeError) as e:
        raise SyntaxError_("malformed headers table in content header") from e


def frame_bytes(ftype: int, channel: int, payload: bytes) -> bytes:
    return _FRAME_HEAD.pack(ftype, channel, len(payload)) + payload + b"\xce"
