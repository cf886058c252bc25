"""Ledger entries and the byte encoding of replication events.

An entry is one event of one VPN at (epoch, index): indexes are dense per
VPN and never reused, so the standby detects a gap and resyncs from its
applied index; the epoch is the VPN's when the entry was appended. The
ledger table (``ledger.event``) and the bridge wire share the encoding, so
an entry is encoded once on the active (:attr:`LedgerEntry.data`) and
stored, shipped and applied from those bytes. It is versionless on purpose:
the bridge's handshake carries the protocol version, and a migration would
rewrite stored entries. A purge's optional trailing ``sent_at`` leaves older
entries decoding as before (an older standby gets the purge without it).

    PUBLISHED: b"P" id(16) exchange(str16) routing_key(str16) nqueues(u16)
               queue(str16)* properties(bytes32) body(bytes32)
    CONSUMED:  b"C" id(16) queue(str16)
    PURGED:    b"Q" deleted(u8: 0 or 1) queue(str16) nspared(u32) id(16)*
               [sent_at(u64), only when not 0]
    DEAD:      b"D" id(16) queue(str16) nto(u16) queue(str16)*
    TOPOLOGY:  b"T" op(u8: 1 + its place in TOPOLOGY_OPS) item(bytes32: UTF-8 JSON)
    (str16 = u16 length + UTF-8, bytes32 = u32 length + bytes)
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from ._events import (
    EVENT_KINDS,
    TOPOLOGY_OPS,
    Consumed,
    DeadLettered,
    Event,
    Published,
    Purged,
    TopologyChanged,
)
from ._ids import ReplicationId

__all__ = [
    "EventDecodeError",
    "LedgerEntry",
    "decode_event",
    "encode_event",
    "entries_by_vpn",
    "split_events",
]

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_HEAD = struct.Struct(">c16sH")  # kind, id, length of the first string
KIND_PUBLISHED = b"P"
KIND_CONSUMED = b"C"
KIND_PURGED = b"Q"
KIND_DEAD = b"D"
KIND_TOPOLOGY = b"T"
_OP_CODES = {op: code for code, op in enumerate(TOPOLOGY_OPS, start=1)}


class EventDecodeError(ValueError):
    """Bytes that are not an encoded event (corrupt ledger row or frame)."""


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One event of ``vpn`` at ``(epoch, index)``; ``data`` is its encoding
    when the creator has it at hand (empty: encode on demand)."""

    vpn: str
    epoch: int
    index: int
    event: Event
    data: bytes = field(default=b"", compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.index < 1 or self.epoch < 1:
            raise ValueError(f"ledger index and epoch start at 1 (got {self.index}, {self.epoch})")

    @property
    def kind(self) -> str:
        return EVENT_KINDS[type(self.event)]

    @property
    def encoded(self) -> bytes:
        """The event's bytes as stored in the ledger and shipped on the bridge."""
        return self.data or encode_event(self.event)


_U32_PREFIX = struct.Struct(">I")


def split_events(data: bytes) -> list[bytes]:
    """Event encodings stored back to back, each ``u32``-length-prefixed (a
    ``txn_log.events`` value, a ``TxnPrepare``'s events), split up."""
    out, pos = [], 0
    while pos < len(data):
        (n,) = _U32_PREFIX.unpack_from(data, pos)
        out.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return out


def _str16(text: str) -> bytes:
    raw = text.encode()
    if len(raw) > 0xFFFF:
        raise ValueError("string longer than 65535 bytes")
    return _U16.pack(len(raw)) + raw


def encode_event(event: Event) -> bytes:
    # Hot (once per replicated event): a flat list, no generator per call.
    if isinstance(event, Published):
        parts = [KIND_PUBLISHED, event.repl_id.value, _str16(event.exchange)]
        parts.append(_str16(event.routing_key))
        parts.append(_U16.pack(len(event.queues)))
        for queue in event.queues:
            parts.append(_str16(queue))
        parts.append(_U32.pack(len(event.properties)))
        parts.append(event.properties)
        parts.append(_U32.pack(len(event.body)))
        parts.append(event.body)
        return b"".join(parts)
    if isinstance(event, Consumed):
        return KIND_CONSUMED + event.repl_id.value + _str16(event.queue)
    if isinstance(event, DeadLettered):
        parts = [KIND_DEAD, event.repl_id.value, _str16(event.queue), _U16.pack(len(event.to))]
        parts += [_str16(q) for q in event.to]
        return b"".join(parts)
    if isinstance(event, TopologyChanged):
        item = event.item.encode()
        return b"".join((KIND_TOPOLOGY, bytes((_OP_CODES[event.op],)), _U32.pack(len(item)), item))
    spared = b"".join(r.value for r in event.spared)
    return b"".join(
        (
            KIND_PURGED,
            b"\x01" if event.deleted else b"\x00",
            _str16(event.queue),
            _U32.pack(len(event.spared)),
            spared,
            _U64.pack(event.sent_at) if event.sent_at else b"",
        )
    )


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise EventDecodeError(f"event truncated at byte {self.pos} (needs {n} more)")
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def u16(self) -> int:
        return int(_U16.unpack(self.take(2))[0])

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def str16(self) -> str:
        try:
            return self.take(self.u16()).decode()
        except UnicodeDecodeError as e:
            raise EventDecodeError("event string is not UTF-8") from e


def decode_event(data: bytes, vpn: str) -> Event:
    """Decode an event of ``vpn`` (the VPN is not repeated in every event)."""
    data = bytes(data)
    try:
        return _decode_fast(data, vpn)
    except (struct.error, IndexError, ValueError):
        pass  # malformed: the careful reader below says where
    return _decode_checked(data, vpn)


def _decode_fast(data: bytes, vpn: str) -> Event:
    """The common shapes in few steps; raises on anything it does not expect
    (``UnicodeDecodeError`` is a ``ValueError``), leaving the message to
    :func:`_decode_checked`."""
    kind, rid, n = _HEAD.unpack_from(data)
    pos = 19 + n
    first = data[19:pos].decode()
    if kind == KIND_CONSUMED:
        if pos != len(data):
            raise ValueError("trailing bytes")
        return Consumed(vpn, ReplicationId(rid), first)
    if kind != KIND_PUBLISHED:
        raise ValueError("unknown kind")
    n = _U16.unpack_from(data, pos)[0]
    routing_key = data[pos + 2 : pos + 2 + n].decode()
    pos += 2 + n
    queues: list[str] = []
    for _ in range(_U16.unpack_from(data, pos)[0]):
        n = _U16.unpack_from(data, pos + 2)[0]
        queues.append(data[pos + 4 : pos + 4 + n].decode())
        pos += 2 + n
    pos += 2
    n = _U32.unpack_from(data, pos)[0]
    properties = data[pos + 4 : pos + 4 + n]
    pos += 4 + n
    n = _U32.unpack_from(data, pos)[0]
    body = data[pos + 4 : pos + 4 + n]
    # Offsets only grow by declared lengths: ending exactly at the end means
    # no slice above was cut short.
    if pos + 4 + n != len(data):
        raise ValueError("truncated or trailing bytes")
    return Published(vpn, ReplicationId(rid), first, routing_key, properties, body, tuple(queues))


def _decode_checked(data: bytes, vpn: str) -> Event:
    r = _Reader(data)
    kind = r.take(1)
    event: Event
    if kind == KIND_PURGED:
        flag = r.take(1)
        if flag not in (b"\x00", b"\x01"):
            raise EventDecodeError(f"purge flag is {flag!r}, expected 0 or 1")
        queue = r.str16()
        spared = tuple(ReplicationId(r.take(16)) for _ in range(r.u32()))
        sent_at = int(_U64.unpack(r.take(8))[0]) if r.pos < len(r.data) else 0
        event = Purged(vpn, queue, spared, deleted=flag == b"\x01", sent_at=sent_at)
        if r.pos != len(r.data):
            raise EventDecodeError(f"{len(r.data) - r.pos} bytes after the event")
        return event
    if kind == KIND_TOPOLOGY:
        code = r.take(1)[0]
        if not 1 <= code <= len(TOPOLOGY_OPS):
            raise EventDecodeError(f"unknown topology operation {code}")
        try:
            item = r.take(r.u32()).decode()
        except UnicodeDecodeError as e:
            raise EventDecodeError("topology item is not UTF-8") from e
        if r.pos != len(r.data):
            raise EventDecodeError(f"{len(r.data) - r.pos} bytes after the event")
        return TopologyChanged(vpn, TOPOLOGY_OPS[code - 1], item)
    repl_id = ReplicationId(r.take(16))
    if kind == KIND_PUBLISHED:
        exchange, routing_key = r.str16(), r.str16()
        queues = tuple(r.str16() for _ in range(r.u16()))
        properties = r.take(r.u32())
        body = r.take(r.u32())
        event = Published(vpn, repl_id, exchange, routing_key, properties, body, queues)
    elif kind == KIND_CONSUMED:
        event = Consumed(vpn, repl_id, r.str16())
    elif kind == KIND_DEAD:
        queue = r.str16()
        event = DeadLettered(vpn, repl_id, queue, tuple(r.str16() for _ in range(r.u16())))
    else:
        raise EventDecodeError(f"unknown event kind {kind!r}")
    if r.pos != len(r.data):
        raise EventDecodeError(f"{len(r.data) - r.pos} bytes after the event")
    return event


def entries_by_vpn(entries: Sequence[LedgerEntry]) -> dict[str, list[LedgerEntry]]:
    """``entries`` grouped by VPN, each group in the given order."""
    out: dict[str, list[LedgerEntry]] = {}
    for e in entries:
        items = out.get(e.vpn)
        if items is None:
            out[e.vpn] = [e]
        else:
            items.append(e)
    return out
