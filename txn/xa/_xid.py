"""The XA transaction id of a branch: ``Xid(format_id, gtrid, bqual)``.

Shaped after X/Open XA and psycopg's ``Xid``: a format id (a non-negative
32-bit integer) and two byte strings of 1 to 64 bytes, the global
transaction id and the branch qualifier. One text form, used on the wire,
in ``txn_log.xid`` and on the command line: ``format_id:gtrid:bqual`` with
both byte strings in lower-case hex, so any byte value survives and two
forms of one id never differ.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["MAX_PART", "Xid", "XidError"]

#: the longest gtrid or bqual X/Open XA allows (MAXGTRIDSIZE, MAXBQUALSIZE)
MAX_PART = 64
_FORM = re.compile(r"\A(\d{1,10}):([0-9a-f]*):([0-9a-f]*)\Z")


class XidError(ValueError):
    """Not a valid XA transaction id; the text says which part is wrong."""


@dataclass(frozen=True, slots=True)
class Xid:
    format_id: int
    gtrid: bytes
    bqual: bytes

    def __post_init__(self) -> None:
        if not 0 <= self.format_id < 2**31:
            raise XidError(f"format_id must be 0 .. 2**31-1, got {self.format_id}")
        for name, part in (("gtrid", self.gtrid), ("bqual", self.bqual)):
            if not isinstance(part, bytes):
                raise XidError(f"{name} must be bytes, got {type(part).__name__}")
            if not 1 <= len(part) <= MAX_PART:
                raise XidError(f"{name} must be 1 to {MAX_PART} bytes, got {len(part)}")

    @classmethod
    def from_parts(cls, format_id: int, gtrid: bytes | str, bqual: bytes | str) -> Xid:
        """An id from its parts; text parts are taken as UTF-8."""
        g = gtrid.encode() if isinstance(gtrid, str) else gtrid
        b = bqual.encode() if isinstance(bqual, str) else bqual
        return cls(format_id, g, b)

    @classmethod
    def from_string(cls, text: str) -> Xid:
        """The id of a ``format_id:gtrid-hex:bqual-hex`` text."""
        found = _FORM.match(text)
        if found is None:
            raise XidError(
                f"not an XA id: {text[:80]!r} (expected format_id:gtrid-hex:bqual-hex,"
                " lower-case hex)"
            )
        fmt, gtrid, bqual = found.groups()
        if len(gtrid) % 2 or len(bqual) % 2:
            raise XidError(f"not an XA id: {text[:80]!r} (hex parts need an even length)")
        return cls(int(fmt), bytes.fromhex(gtrid), bytes.fromhex(bqual))

    def __str__(self) -> str:
        return f"{self.format_id}:{self.gtrid.hex()}:{self.bqual.hex()}"
