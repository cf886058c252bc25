"""AMQP 0-9-1 content: a message's header and body frames, kept byte for byte.

Invariant: **property bytes are never decoded and encoded again.** pamqp
would re-encode every header value with its own choice of integer width
(the integer 5 as a short-short ``b`` whatever the publisher sent, ``I``
say), and a Java consumer expecting an ``Integer`` would then get a
``Byte``. So a content header that must carry a replication id has the
entry *spliced* into its headers table (:func:`splice_header`), one that
must lose it has the entry cut out (:func:`without_entry`), a stored
message goes out with its property bytes verbatim (:func:`encode_message`)
and with delivery mode 2 set in place (:func:`persistent_properties`).
:func:`property_layout` walks a header once, the way the broker will, and
says where each of those edits goes.
"""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple

from ._errors import FrameOutOfOrder, SyntaxError_
from ._fields import field_table, table_entries
from ._frames import FRAME_BODY, FRAME_HEADER

__all__ = [
    "PropertyLayout",
    "decode_headers",
    "encode_message",
    "find_header",
    "header_entry",
    "persistent_properties",
    "property_layout",
    "splice_header",
    "without_entry",
]

_FRAME_HEAD = struct.Struct(">BHI")
#: class id, weight, body size, property flags
_CONTENT_HEAD = struct.Struct(">HHQH")
#: frame head + class, weight, body size: the fixed part of a content header frame
_CONTENT_FRAME_HEAD = struct.Struct(">BHIHHQ")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_FRAME_END = b"\xce"

_FLAG_CONTENT_TYPE, _FLAG_CONTENT_ENCODING = 0x8000, 0x4000
_FLAG_HEADERS, _FLAG_DELIVERY_MODE = 0x2000, 0x1000
_PERSISTENT = 2


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
            raise FrameOutOfOrder(f"content header for class {class_id}, expected 60 (basic)")
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


@functools.cache
def _entry_prefix(key: str) -> bytes:
    return bytes([len(key)]) + key.encode()


def splice_header(payload: bytes, layout: PropertyLayout, key: str, value: bytes) -> bytes:
    """The content header payload with ``key`` in its headers, its encoded
    field ``value`` (type octet and data: :func:`~bridge.amqp.long_field`, ...).

    Every other byte stays as the client sent it; an existing ``key`` is
    replaced (a message re-published from a replicated queue gets a new id).
    Our entry ends the headers table.
    """
    entry = _entry_prefix(key) + value
    if layout.flags & _FLAG_HEADERS:
        body = payload[layout.headers_at + 4 : layout.headers_end]
        if key.encode() in body:
            try:
                kept = [body[s:e] for k, s, e in table_entries(body) if k != key]
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
        for k, s, e in table_entries(body):
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
        return field_table(payload, layout.headers_at + 4, layout.headers_end)
    except (ValueError, IndexError, struct.error, UnicodeDecodeError) as e:
        raise SyntaxError_("malformed headers table in content header") from e


# ------------------------------------------------------------------ stored messages


def encode_message(
    out: list[bytes],
    publish: bytes,
    channel: int,
    properties: bytes,
    body: bytes,
    frame_max: int,
) -> None:
    """Append one message's frames to ``out``: the ``basic.publish`` method
    frame ``publish`` (encoded once per routing key by the caller), a content
    header whose property bytes are ``properties`` verbatim, and ``body``
    split into frames of at most ``frame_max`` bytes."""
    size = len(body)
    head = _CONTENT_FRAME_HEAD.pack(FRAME_HEADER, channel, 12 + len(properties), 60, 0, size)
    step = frame_max - 8
    if size == 0:
        out += (publish, head, properties, _FRAME_END)
    elif size <= step:
        out += (
            publish,
            head,
            properties,
            _FRAME_END + _FRAME_HEAD.pack(FRAME_BODY, channel, size),
            body,
            _FRAME_END,
        )
    else:
        out += (publish, head, properties, _FRAME_END)
        view = memoryview(body)
        for i in range(0, size, step):
            chunk = view[i : i + step]
            out += (_FRAME_HEAD.pack(FRAME_BODY, channel, len(chunk)), bytes(chunk), _FRAME_END)


def persistent_properties(properties: bytes) -> bytes:
    """``properties`` (a content header's flags and values) with delivery
    mode 2: unchanged when it already says so (the replicated case: only
    persistent publishes are replicated), else with the mode set or
    inserted and every other byte kept. A malformed property list raises
    :class:`ValueError`."""
    try:
        flags = _U16.unpack_from(properties, 0)[0]
        if flags == _FLAG_DELIVERY_MODE and len(properties) == 3 and properties[2] == _PERSISTENT:
            return properties
        if flags & 1:
            raise ValueError("the property flags continue past one word")
        pos = 2
        if flags & _FLAG_CONTENT_TYPE:
            pos += 1 + properties[pos]
        if flags & _FLAG_CONTENT_ENCODING:
            pos += 1 + properties[pos]
        if flags & _FLAG_HEADERS:
            pos += 4 + _U32.unpack_from(properties, pos)[0]
        if flags & _FLAG_DELIVERY_MODE:
            if properties[pos] == _PERSISTENT:
                return properties
            return properties[:pos] + b"\x02" + properties[pos + 1 :]
        if pos > len(properties):
            raise IndexError(pos)
        flags |= _FLAG_DELIVERY_MODE
        return _U16.pack(flags) + properties[2:pos] + b"\x02" + properties[pos:]
    except (IndexError, struct.error) as e:
        raise ValueError("malformed content header properties (truncated)") from e
