"""AMQP 0-9-1 methods: their ids, the hot ones decoded with ``struct``, the
rare ones with pamqp.

The frames every message crosses (``basic.publish``, ``basic.deliver``,
``basic.ack`` and its kin, the broker's confirms) are read and written
here with ``struct``, at offsets into the buffer they came in; pamqp
decodes and encodes the rare control methods. A fault is the error of its
reply code (:mod:`bridge.amqp._errors`): 502 for fields that do not
decode, 503 for a method AMQP does not have.
"""

from __future__ import annotations

import struct

from pamqp import base, commands, frame

from ._errors import CommandInvalid, FrameError, SyntaxError_
from ._fields import field_table
from ._frames import FRAME_METHOD, FrameSpan

__all__ = [
    "Method",
    "content_body_size",
    "decode_ack",
    "decode_deliver",
    "decode_get_ok",
    "decode_method",
    "decode_properties",
    "decode_publish",
    "encode_ack",
    "encode_nack",
    "login_user",
    "marshal_method",
    "method_id",
]

_FRAME_HEAD = struct.Struct(">BHI")
_METHOD_ID = struct.Struct(">HH")
_U64 = struct.Struct(">Q")


class Method:
    """(class id, method id) of the methods the node looks at, by their AMQP
    names: ``Method.BASIC_PUBLISH == (60, 40)``."""

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


_KNOWN_METHODS = {(index >> 16, index & 0xFFFF) for index in commands.INDEX_MAPPING}


def method_id(buf: bytes, f: FrameSpan) -> tuple[int, int]:
    """The (class, method) id of method frame ``f``; 503 when AMQP 0-9-1
    has no such method."""
    if f.end - f.start < 12:
        raise FrameError("method frame too short for a class and method id")
    ids: tuple[int, int] = _METHOD_ID.unpack_from(buf, f.payload_start)
    if ids not in _KNOWN_METHODS:
        raise CommandInvalid(f"unknown class {ids[0]} method {ids[1]}", ids)
    return ids


def decode_method(buf: bytes, f: FrameSpan) -> base.Frame:
    """Decode a rare method frame with pamqp; faults become 502 SYNTAX_ERROR."""
    try:
        _, _, value = frame.unmarshal(buf[f.start : f.end])
    except Exception as e:  # pamqp raises several types for malformed arguments
        ids = _METHOD_ID.unpack_from(buf, f.payload_start)
        raise SyntaxError_(f"malformed arguments of method {ids[0]}.{ids[1]}", ids) from e
    assert isinstance(value, base.Frame)  # noqa: S101 - method frames decode to methods
    return value


def decode_properties(buf: bytes, f: FrameSpan) -> commands.Basic.Properties:
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


def decode_publish(buf: bytes, f: FrameSpan) -> tuple[str, str, bool]:
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
        raise SyntaxError_("malformed basic.publish", Method.BASIC_PUBLISH) from e


def decode_ack(buf: bytes, f: FrameSpan) -> tuple[int, bool, bool]:
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


def decode_deliver(buf: bytes, f: FrameSpan) -> tuple[str, int]:
    """basic.deliver → (consumer tag, delivery tag)."""
    try:
        pos = f.payload_start + 4
        n = buf[pos]
        tag = buf[pos + 1 : pos + 1 + n].decode()
        return tag, _U64.unpack_from(buf, pos + 1 + n)[0]
    except (IndexError, UnicodeDecodeError, struct.error) as e:
        raise SyntaxError_("malformed basic.deliver", Method.BASIC_DELIVER) from e


def decode_get_ok(buf: bytes, f: FrameSpan) -> int:
    """basic.get-ok → delivery tag."""
    return int(_U64.unpack_from(buf, f.payload_start + 4)[0])


def encode_ack(channel: int, tag: int, multiple: bool) -> bytes:
    payload = b"\x00\x3c\x00\x50" + _U64.pack(tag) + (b"\x01" if multiple else b"\x00")
    return _FRAME_HEAD.pack(FRAME_METHOD, channel, len(payload)) + payload + b"\xce"


def encode_nack(channel: int, tag: int, multiple: bool) -> bytes:
    payload = b"\x00\x3c\x00\x78" + _U64.pack(tag) + (b"\x01" if multiple else b"\x00")
    return _FRAME_HEAD.pack(FRAME_METHOD, channel, len(payload)) + payload + b"\xce"


def content_body_size(buf: bytes, f: FrameSpan) -> int:
    """The body size a content header frame announces."""
    if f.payload_end - f.payload_start < 14:
        raise SyntaxError_("content header frame too short")
    return int(_U64.unpack_from(buf, f.payload_start + 4)[0])


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
            login = field_table(raw, 0, len(raw)).get("LOGIN")
        except (IndexError, ValueError, struct.error, UnicodeDecodeError):
            return None
        if isinstance(login, bytes):
            return login.decode(errors="replace")
        return login if isinstance(login, str) else None
    return None
