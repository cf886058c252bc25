"""AMQP 0-9-1 field tables, decoded without pamqp.

Decoding only: a table the node changes (a content header's headers) is
spliced entry by entry (:mod:`bridge.amqp._content`), never re-encoded,
because an encoder picks its own integer widths and a consumer would see
other types than the publisher sent. Timestamps stay integers (seconds),
so no magnitude the broker accepts can make decoding fail.
"""

from __future__ import annotations

import decimal
import struct
from collections.abc import Callable

__all__ = ["field_table", "field_value", "long_field", "longstr_field", "table_entries"]

_I64 = struct.Struct(">q")
_U32 = struct.Struct(">I")

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
    return field_table(buf, pos + 4, pos + 4 + n), pos + 4 + n


def _array(buf: bytes, pos: int) -> tuple[object, int]:
    n = _U32.unpack_from(buf, pos)[0]
    end, items, at = pos + 4 + n, [], pos + 4
    while at < end:
        value, at = field_value(buf, at)
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


def field_value(buf: bytes, pos: int) -> tuple[object, int]:
    """Decode one field value (type octet and data) at ``pos``; returns the
    value and where the next one starts. Raises IndexError, ValueError or
    struct.error on bytes that do not decode."""
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


def field_table(buf: bytes, pos: int, end: int) -> dict[str, object]:
    """The table whose entries fill ``buf[pos:end]`` (without its length)."""
    if end > len(buf):
        raise IndexError
    out: dict[str, object] = {}
    while pos < end:
        klen = buf[pos]
        key = buf[pos + 1 : pos + 1 + klen].decode()
        out[key], pos = field_value(buf, pos + 1 + klen)
    if pos != end:
        raise IndexError
    return out


def table_entries(table: bytes) -> list[tuple[str, int, int]]:
    """(key, entry start, entry end) of each entry of a field table's body."""
    out = []
    pos = 0
    while pos < len(table):
        start = pos
        klen = table[pos]
        key = table[pos + 1 : pos + 1 + klen].decode(errors="replace")
        _, pos = field_value(table, pos + 1 + klen)
        out.append((key, start, pos))
    return out


def long_field(value: int) -> bytes:
    """A signed 64-bit integer as a field-table value (type ``l``)."""
    return b"l" + _I64.pack(value)


def longstr_field(value: str) -> bytes:
    """A string as a field-table value (type ``S``)."""
    raw = value.encode()
    return b"S" + _U32.pack(len(raw)) + raw
