"""Array parameters in PostgreSQL's binary wire format, packed in one pass.

The ledger writer and the shared apply step send their rows as array
parameters of one ``unnest()`` statement. psycopg's generic list dumper
looks up a dumper per element and was the largest single cost of the
active's live-state apply in py-spy (about a quarter of it); these
pre-packed values are the bytes ``array_send`` would produce, handed to
psycopg as they are.

Binary array layout: ``ndim i32 | has_nulls i32 | element oid u32`` then,
per dimension, ``length i32 | lower bound i32``, then per element ``length
i32 | bytes``. No element is ever NULL here.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, ClassVar, cast

import psycopg
from psycopg.adapt import Dumper
from psycopg.pq import Format

__all__ = ["bytea_array", "int8_array", "text_array"]

_HEAD = struct.Struct(">iiIii")
_EMPTY = struct.Struct(">iiI")
_LEN = struct.Struct(">i")
_INT8 = struct.Struct(">iq")  # length 8, value


class _Packed(bytes):
    """An array parameter already in binary wire format."""

    OID: ClassVar[int]


class _ByteaArray(_Packed):
    OID = 17


class _TextArray(_Packed):
    OID = 25


class _Int8Array(_Packed):
    OID = 20


def _packed_dumper(cls: type[_Packed], array_oid: int) -> type[Dumper]:
    class PackedDumper(Dumper):
        format = Format.BINARY
        oid = array_oid

        def dump(self, obj: Any) -> bytes:
            return cast(bytes, obj)  # already the wire bytes: no copy

    PackedDumper.__name__ = f"{cls.__name__}Dumper"
    return PackedDumper


# bytea[], text[], int8[]: registered on the global adapters map, which every
# connection made afterwards copies.
for _cls, _array_oid in ((_ByteaArray, 1001), (_TextArray, 1009), (_Int8Array, 1016)):
    psycopg.adapters.register_dumper(_cls, _packed_dumper(_cls, _array_oid))


def _pack(cls: type[_Packed], items: Sequence[bytes]) -> _Packed:
    if not items:
        return cls(_EMPTY.pack(0, 0, cls.OID))
    parts = [_HEAD.pack(1, 0, cls.OID, len(items), 1)]
    pack_len = _LEN.pack
    for item in items:
        parts.append(pack_len(len(item)))
        parts.append(item)
    return cls(b"".join(parts))


def bytea_array(items: Sequence[bytes]) -> bytes:
    """``items`` as a ``bytea[]`` parameter."""
    return _pack(_ByteaArray, items)


def text_array(items: Sequence[str]) -> bytes:
    """``items`` as a ``text[]`` parameter."""
    return _pack(_TextArray, [item.encode() for item in items])


def int8_array(items: Sequence[int]) -> bytes:
    """``items`` as an ``int8[]`` parameter."""
    if not items:
        return _Int8Array(_EMPTY.pack(0, 0, _Int8Array.OID))
    pack = _INT8.pack
    body = b"".join([pack(8, item) for item in items])
    return _Int8Array(_HEAD.pack(1, 0, _Int8Array.OID, len(items), 1) + body)
