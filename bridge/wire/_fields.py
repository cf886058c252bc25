"""The bridge's wire field types: how one value is checked, encoded and
decoded.

A field type knows the bytes of one value (``UInt`` of 8 to 64 bits,
``Flag``, an enum's ``Code``, a ``ReplId``; ``Text`` and ``Blob`` after a
length prefix; an ``Array`` of items after its count; the ``LedgerEntries``
of an ``Events`` batch) and what values may be sent. Records declare their
fields with these types (:mod:`bridge.wire._declare` compiles them): fixed
and length-prefixed types say how to lay themselves out as Python source,
so a record's fixed fields in a row pack and unpack with one struct; the
others encode and decode themselves, and serve as an array's items too.

Decoding never reads past ``end``: every shortfall is a
:class:`~bridge.BadFrame` naming the field (:func:`truncated`), and a value
out of range or an unknown code is one too.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from enum import Enum
from typing import Any, ClassVar

from bridge._entry import LedgerEntry, decode_event, encode_event
from bridge._errors import BadFrame
from bridge._ids import ReplicationId

__all__ = [
    "MAX_U16",
    "MAX_U32",
    "MAX_U64",
    "Array",
    "Blob",
    "Code",
    "Composite",
    "Field",
    "Fixed",
    "Flag",
    "LedgerEntries",
    "ReplId",
    "Text",
    "UInt",
    "U8",
    "U16",
    "U32",
    "U64",
    "check_text",
    "short_run",
    "truncated",
]

MAX_U16 = 2**16 - 1
MAX_U32 = 2**32 - 1
MAX_U64 = 2**64 - 1


def truncated(what: str, label: str) -> BadFrame:
    return BadFrame(f"{what} payload truncated in {label}")


def check_text(label: str, value: str, empty: bool) -> None:
    size = len(value.encode())  # UnicodeEncodeError (a ValueError) on lone surrogates
    if size > MAX_U16 or (size == 0 and not empty):
        raise ValueError(f"{label} must be {0 if empty else 1}..{MAX_U16} bytes of UTF-8")


# ---------------------------------------------------------------- field types


class Field:
    """A wire type: how one value is checked, encoded and decoded."""

    __slots__ = ()

    def check(self, label: str, value: Any) -> None:
        """Raise ValueError if ``value`` cannot be sent."""

    def check_code(self, label: str, expr: str, ref: str) -> list[str]:
        """The constructor's checks of ``expr`` as source lines."""
        return [f"{ref}.check({label!r}, {expr})"]


class Fixed(Field):
    """A fixed-size value: one :mod:`struct` code in its record's runs."""

    __slots__ = ("code", "size")

    def __init__(self, code: str) -> None:
        self.code = code
        self.size = struct.calcsize(">" + code)

    def to_wire(self, expr: str, ref: str) -> str:
        """The expression packed for ``expr``."""
        return expr

    def from_wire(self, var: str, ref: str, label: str) -> list[str]:
        """Source lines turning the unpacked ``var`` into the value."""
        return []

    def convert(self, raw: Any, what: str, label: str) -> Any:
        """What :meth:`from_wire` does, as a function."""
        return raw


class UInt(Fixed):
    """An unsigned integer in ``low..high``; with ``none``, the value None
    travels as that number (which is then outside ``low..high``)."""

    __slots__ = ("high", "low", "none")

    def __init__(self, bits: int, low: int = 0, high: int | None = None, none: int | None = None):
        super().__init__({8: "B", 16: "H", 32: "I", 64: "Q"}[bits])
        self.low, self.high, self.none = low, 2**bits - 1 if high is None else high, none

    def check(self, label: str, value: Any) -> None:
        if value is None and self.none is not None:
            return
        if not self.low <= value <= self.high:
            raise ValueError(f"{label} must be {self.low}..{self.high}, got {value}")

    def check_code(self, label: str, expr: str, ref: str) -> list[str]:
        test = f"not {self.low} <= {expr} <= {self.high}"
        if self.none is not None:
            test = f"{expr} is not None and {test}"
        text = f"{label} must be {self.low}..{self.high}, got {{{expr}}}"
        return [f"if {test}:", f"    raise ValueError(f{text!r})"]

    def to_wire(self, expr: str, ref: str) -> str:
        if self.none is None:
            return expr
        return f"({self.none} if {expr} is None else {expr})"

    def from_wire(self, var: str, ref: str, label: str) -> list[str]:
        if self.none is None:
            return []
        return [f"if {var} == {self.none}:", f"    {var} = None"]

    def convert(self, raw: Any, what: str, label: str) -> Any:
        return None if self.none is not None and raw == self.none else raw


def U8(low: int = 0, high: int | None = None) -> UInt:
    return UInt(8, low, high)


def U16(low: int = 0, high: int | None = None) -> UInt:
    return UInt(16, low, high)


def U32(low: int = 0, high: int | None = None) -> UInt:
    return UInt(32, low, high)


def U64(low: int = 0, high: int | None = None, none: int | None = None) -> UInt:
    return UInt(64, low, high, none)


class Flag(Fixed):
    """A yes/no octet: 0 or 1."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__("B")

    def check_code(self, label: str, expr: str, ref: str) -> list[str]:
        return []

    def from_wire(self, var: str, ref: str, label: str) -> list[str]:
        text = f"{{_what}}.{label} must be 0 or 1, got {{{var}}}"
        return [f"if {var} > 1:", f"    raise BadFrame(f{text!r})", f"{var} = {var} == 1"]

    def convert(self, raw: Any, what: str, label: str) -> bool:
        if raw > 1:
            raise BadFrame(f"{what}.{label} must be 0 or 1, got {raw}")
        return bool(raw == 1)


class Code(Fixed):
    """A member of an :class:`~enum.Enum` as its one-octet code in ``codes``;
    the constructor takes the member's value too."""

    __slots__ = ("codes", "enum", "members")

    def __init__(self, codes: Mapping[Any, int]) -> None:
        super().__init__("B")
        self.codes = dict(codes)
        self.members = {code: member for member, code in codes.items()}
        self.enum: type[Enum] = type(next(iter(codes)))

    def check_code(self, label: str, expr: str, ref: str) -> list[str]:
        return [
            f"if {expr}.__class__ is not {ref}.enum:",
            f"    _setattr(self, {label!r}, {ref}.enum({expr}))",
        ]

    def to_wire(self, expr: str, ref: str) -> str:
        return f"{ref}.codes[{expr}]"

    def from_wire(self, var: str, ref: str, label: str) -> list[str]:
        text = f"{{_what}}.{label}: unknown code {{{var}}}"
        return [
            f"_m = {ref}.members.get({var})",
            "if _m is None:",
            f"    raise BadFrame(f{text!r})",
            f"{var} = _m",
        ]

    def convert(self, raw: Any, what: str, label: str) -> Any:
        member = self.members.get(raw)
        if member is None:
            raise BadFrame(f"{what}.{label}: unknown code {raw}")
        return member


class ReplId(Fixed):
    """A :class:`~bridge.ReplicationId`: its 16 bytes."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__("16s")

    def check_code(self, label: str, expr: str, ref: str) -> list[str]:
        return []

    def to_wire(self, expr: str, ref: str) -> str:
        return f"{expr}.value"

    def from_wire(self, var: str, ref: str, label: str) -> list[str]:
        return [f"{var} = _ReplicationId({var})"]

    def convert(self, raw: Any, what: str, label: str) -> Any:
        return ReplicationId(raw)


#: the length prefix of a :class:`Text` and a :class:`Blob`, as runs see it
_PREFIX16, _PREFIX32 = U16(), U32()


class Text(Field):
    """A string: ``u16`` length and UTF-8; empty only if ``empty``."""

    __slots__ = ("empty",)
    prefix: ClassVar[UInt] = _PREFIX16
    _LENGTH = struct.Struct(">H")

    def __init__(self, empty: bool = False) -> None:
        self.empty = empty

    def check(self, label: str, value: Any) -> None:
        check_text(label, value, self.empty)

    def check_code(self, label: str, expr: str, ref: str) -> list[str]:
        return [f"_check_text({label!r}, {expr}, {self.empty})"]

    def to_bytes(self, expr: str) -> str:
        return f"{expr}.encode()"

    def from_bytes(self, var: str, start: str, stop: str, label: str) -> list[str]:
        return [
            "try:",
            f"    {var} = _data[{start}:{stop}].decode()",
            "except UnicodeDecodeError as _x:",
            f"    raise BadFrame(f'{{_what}}.{label} is not UTF-8') from _x",
        ]

    def piece(self, value: str, version: int) -> bytes:
        raw = value.encode()
        return self._LENGTH.pack(len(raw)) + raw

    def unpack(
        self, data: bytes, pos: int, end: int, version: int, what: str, label: str
    ) -> tuple[str, int]:
        if end - pos < 2:
            raise truncated(what, label)
        stop = pos + 2 + self._LENGTH.unpack_from(data, pos)[0]
        if stop > end:
            raise truncated(what, label)
        try:
            return data[pos + 2 : stop].decode(), stop
        except UnicodeDecodeError as e:
            raise BadFrame(f"{what}.{label} is not UTF-8") from e


class Blob(Field):
    """Bytes: ``u32`` length and the bytes."""

    __slots__ = ()
    prefix: ClassVar[UInt] = _PREFIX32

    def check(self, label: str, value: Any) -> None:
        if len(value) > MAX_U32:
            raise ValueError(f"{label} is longer than {MAX_U32} bytes")

    def check_code(self, label: str, expr: str, ref: str) -> list[str]:
        text = f"{label} is longer than {MAX_U32} bytes"
        return [f"if len({expr}) > {MAX_U32}:", f"    raise ValueError({text!r})"]

    def to_bytes(self, expr: str) -> str:
        return expr

    def from_bytes(self, var: str, start: str, stop: str, label: str) -> list[str]:
        return [f"{var} = _data[{start}:{stop}]"]


class Composite(Field):
    """A value the compiler leaves to the type: an array, a nested record."""

    __slots__ = ()
    #: the record's earlier fields :meth:`unpack` takes after ``label``
    context: ClassVar[tuple[str, ...]] = ()

    def pieces(self, value: Any, version: int) -> list[bytes]:
        """The value's bytes, in pieces to join with the record's."""
        raise NotImplementedError

    def piece(self, value: Any, version: int) -> bytes:
        """The value's bytes as one array item."""
        return b"".join(self.pieces(value, version))

    def unpack(
        self, data: bytes, pos: int, end: int, version: int, what: str, label: str, *context: Any
    ) -> tuple[Any, int]:
        raise NotImplementedError


class Array(Composite):
    """A tuple of ``item`` values after their count, a :class:`UInt` whose
    range bounds the count."""

    __slots__ = ("count", "item", "_count", "_piece", "_unpack")

    def __init__(self, item: Text | Composite, count: UInt) -> None:
        self.item, self.count = item, count
        self._count = struct.Struct(">" + count.code)
        self._piece, self._unpack = item.piece, item.unpack

    def check(self, label: str, value: Any) -> None:
        self.count.check(f"{label} count", len(value))
        for i, item in enumerate(value):
            self.item.check(f"{label}[{i}]", item)

    def pieces(self, value: Any, version: int) -> list[bytes]:
        piece = self._piece
        return [self._count.pack(len(value)), *[piece(item, version) for item in value]]

    def unpack(
        self, data: bytes, pos: int, end: int, version: int, what: str, label: str, *context: Any
    ) -> tuple[Any, int]:
        if end - pos < self._count.size:
            raise truncated(what, label)
        (n,) = self._count.unpack_from(data, pos)
        pos += self._count.size
        items, unpack = [], self._unpack
        for _ in range(n):
            item, pos = unpack(data, pos, end, version, what, label)
            items.append(item)
        return tuple(items), pos


class LedgerEntries(Composite):
    """An ``Events`` batch's entries: the first index and a ``u32`` count,
    then per entry its epoch and its event in the ledger encoding (``u32``
    length and bytes, shipped as stored); the indexes are implicit, so a
    batch with a hole cannot even be encoded. Decoding needs the VPN."""

    __slots__ = ()
    context: ClassVar[tuple[str, ...]] = ("vpn",)
    _HEAD = struct.Struct(">QI")  # first index, count; then per entry: epoch, event length
    _FIRST: ClassVar = (("first_index", U64()), ("entry count", U32()))
    _ENTRY: ClassVar = (("entry epoch", U64()), ("event", U32()))
    _COUNT: ClassVar = U32(1)

    def check(self, label: str, value: Any) -> None:
        if not value:
            raise ValueError("an Events batch holds at least one entry")
        self._COUNT.check("entry count", len(value))

    def pieces(self, value: Any, version: int) -> list[bytes]:
        head = self._HEAD.pack
        parts = [head(value[0].index, len(value))]
        for e in value:  # the ledger's bytes, as stored: not encoded again
            data = e.data or encode_event(e.event)  # LedgerEntry.encoded, without the call
            parts += (head(e.epoch, len(data)), data)
        return parts

    def unpack(
        self, data: bytes, pos: int, end: int, version: int, what: str, label: str, *context: Any
    ) -> tuple[Any, int]:
        (vpn,) = context
        head = self._HEAD.unpack_from
        if end - pos < 12:
            raise short_run(data, pos, end, what, self._FIRST)
        first, count = head(data, pos)
        pos += 12
        entries = []
        for n in range(count):
            if end - pos < 12:
                raise short_run(data, pos, end, what, self._ENTRY)
            epoch, size = head(data, pos)
            pos += 12
            stop = pos + size
            if stop > end:
                raise truncated(what, "event")
            event = data[pos:stop]
            pos = stop
            entries.append(LedgerEntry(vpn, epoch, first + n, decode_event(event, vpn), event))
        return tuple(entries), pos


def short_run(
    data: bytes, pos: int, end: int, what: str, run: tuple[tuple[str, Fixed], ...]
) -> BadFrame:
    """The fault in a run of fixed fields that does not fit: the first field
    cut short, unless one before it is already invalid (read in order)."""
    for label, field in run:
        if end - pos < field.size:
            return truncated(what, label)
        field.convert(struct.unpack_from(">" + field.code, data, pos)[0], what, label)
        pos += field.size
    raise AssertionError("the run fits")
