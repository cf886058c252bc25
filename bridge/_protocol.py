"""The bridge wire protocol between an active and a standby site, without I/O.

Invariant: the standby never accepts an event that does not extend exactly the
state it already has, nor one from a fenced active. Concretely, a
:class:`BridgeConnection` never hands its caller

* bytes that were not sent as they are: every frame is length-prefixed and
  checksummed, its length checked against the limit from the 8-byte header
  alone, before anything is buffered (:class:`~bridge.BadFrame`,
  :class:`~bridge.BadChecksum`);
* a frame that is not legal in the connection's state: the transitions are
  the table :data:`TRANSITIONS`, the same for both ends, each end checking
  what it sends (:class:`~bridge.LocalProtocolError`) and what it receives
  (:class:`~bridge.UnexpectedFrame`);
* a frame for a VPN whose epoch is below the highest epoch the connection has
  seen for that VPN: another site was promoted and the sender is fenced
  (:class:`~bridge.StaleEpoch` on receipt, :class:`~bridge.Fenced` on send;
  a higher epoch is recorded, and an active learning one is fenced);
* an ``Events`` batch that does not start at the next index of its VPN's
  stream: a batch starting past it raises :class:`~bridge.Gap` and the rest
  of that stream is dropped until the active accepts a resync from the
  standby's last *applied* index; entries at or below the last received index
  are duplicates and silently dropped;
* a replay that does not start from the standby's own state: when
  ``SyncAccepted.from_index`` is not ``last_applied_index + 1`` (the standby
  is behind the retained ledger, or its history diverged), nothing but a
  complete :class:`Checkpoint` at ``from_index - 1`` is accepted before
  events, and no acknowledgement either.

The conversation follows the FIX Antenna synchronisation procedure (seed
000/003): the standby dials and sends ``Hello``, the active answers ``Hello``;
``GetAllResources`` / ``ResourceList`` (GET_ALL_RESOURCES / RESOURCE_LIST:
VPNs, their epochs, replication settings and RabbitMQ definitions); then per
VPN ``SyncRequest`` with the last applied index (SYNC_REQ), ``SyncAccepted``
(SYNC_REQ_ACCEPTED), an optional ``Checkpoint`` (seed 002: checkpoint install
for a follower behind the retained log), ``Events`` replayed in index order,
``SyncFinished`` (SYNC_FINISHED), then live ``Events``, while the standby
returns cumulative ``Ack`` frames ("durably applied up to index").

An ``Error`` frame with an empty ``vpn`` ends the connection. One with a VPN
ends that VPN's stream only: the active sends one solely to refuse a
``SyncRequest``; the standby sends one to abandon a stream (a stale epoch, an
apply failure). To stop streaming a VPN for another reason the active sends a
``ResourceList`` without it. These rules make every VPN-level race resolvable
without correlation ids: frames of a stream the standby abandoned that were
already in flight are recognised by state and dropped.

Wire layout (all integers big-endian)::

    frame  = header payload crc
    header = magic u8 (0xBD) | version u8 | type u8 | flags u8 (0) | length u32
    crc    = u32 CRC-32 of header + payload

The checksum is IEEE CRC-32 (:func:`zlib.crc32`): CRC-32C would be the better
polynomial, but it is not in the standard library, and on the bridge the
checksum catches corruption and framing bugs (TLS, when configured, is what
authenticates). Strings are ``u16`` length + UTF-8, blobs ``u32`` length +
bytes, indexes and epochs ``u64``; events use the ledger encoding of
:mod:`bridge._entry`, so they are shipped as stored.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import ClassVar, Final, Self, TypeVar

from ._entry import EventDecodeError, LedgerEntry, decode_event
from ._errors import (
    ERROR_CODES,
    BadChecksum,
    BadFrame,
    BridgeError,
    Fenced,
    Gap,
    LocalProtocolError,
    PeerFailure,
    RemoteProtocolError,
    RoleConflict,
    StaleEpoch,
    UnexpectedFrame,
    UnknownVpn,
    VersionMismatch,
)
from ._ids import ReplicationId
from ._settings import Mode, Role, SyncTimeoutPolicy, TopicFilter, VpnSettings

__all__ = [
    "CLOSED",
    "DEFAULT_MAX_FRAME_SIZE",
    "MAGIC",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "TRANSITIONS",
    "Ack",
    "BridgeConnection",
    "Checkpoint",
    "CheckpointRow",
    "Error",
    "Events",
    "Frame",
    "FrameReader",
    "GetAllResources",
    "Heartbeat",
    "Hello",
    "Phase",
    "ResourceList",
    "Sentinel",
    "SyncAccepted",
    "SyncFinished",
    "SyncRequest",
    "TxnApplied",
    "TxnCommit",
    "TxnOutcome",
    "TxnPrepare",
    "TxnQuery",
    "TxnVote",
    "VpnResource",
    "VpnState",
    "decode_frame",
]

MAGIC: Final = 0xBD
#: 2: TxnCommit / TxnApplied; 3: TxnApplied answers every TxnCommit;
#: 4: VpnResource carries expose_id and the index its epoch took over at
PROTOCOL_VERSION: Final = 4
#: RabbitMQ (3.8+) accepts messages up to 128 MiB by default, and one event
#: must fit in one frame; 8 MiB on top for properties and framing.
DEFAULT_MAX_FRAME_SIZE: Final = 136 * 2**20

_HEADER = struct.Struct(">BBBBI")
_CRC = struct.Struct(">I")
_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_ENTRY_HEAD = struct.Struct(">QI")  # an Events entry: epoch, event length
_MAX_U16 = 2**16 - 1
_MAX_U32 = 2**32 - 1
_MAX_U64 = 2**64 - 1
_OVERHEAD = _HEADER.size + _CRC.size

_E = TypeVar("_E")


# ---------------------------------------------------------------- wire values

_ROLE_CODES = {Role.ACTIVE: 1, Role.STANDBY: 2}
_MODE_CODES = {Mode.ASYNC: 1, Mode.SYNC: 2}
_POLICY_CODES = {SyncTimeoutPolicy.DEGRADE: 1, SyncTimeoutPolicy.REJECT: 2}


def _check_int(name: str, value: int, low: int, high: int = _MAX_U64) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be {low}..{high}, got {value}")


def _check_text(name: str, value: str, *, empty: bool = False) -> None:
    size = len(value.encode())  # UnicodeEncodeError (a ValueError) on lone surrogates
    if size > _MAX_U16 or (size == 0 and not empty):
        raise ValueError(f"{name} must be {0 if empty else 1}..{_MAX_U16} bytes of UTF-8")


def _check_blob(name: str, value: bytes) -> None:
    if len(value) > _MAX_U32:
        raise ValueError(f"{name} is longer than {_MAX_U32} bytes")


def _str16(text: str) -> bytes:
    raw = text.encode()
    return _U16.pack(len(raw)) + raw


def _bytes32(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def _strs16(texts: tuple[str, ...]) -> bytes:
    return _U16.pack(len(texts)) + b"".join(_str16(t) for t in texts)


class _Reader:
    """Reads one frame's payload; every shortfall is a :class:`BadFrame`."""

    __slots__ = ("data", "pos", "what")

    def __init__(self, data: bytes, what: str) -> None:
        self.data = data
        self.pos = 0
        self.what = what

    def take(self, n: int, name: str) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise BadFrame(f"{self.what} payload truncated in {name}")
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def u8(self, name: str) -> int:
        return int(self.take(1, name)[0])

    def u16(self, name: str) -> int:
        return int(_U16.unpack(self.take(2, name))[0])

    def u32(self, name: str) -> int:
        return int(_U32.unpack(self.take(4, name))[0])

    def u64(self, name: str) -> int:
        return int(_U64.unpack(self.take(8, name))[0])

    def text(self, name: str) -> str:
        raw = self.take(self.u16(name), name)
        try:
            return raw.decode()
        except UnicodeDecodeError as e:
            raise BadFrame(f"{self.what}.{name} is not UTF-8") from e

    def texts(self, name: str) -> tuple[str, ...]:
        return tuple(self.text(name) for _ in range(self.u16(name)))

    def blob(self, name: str) -> bytes:
        return self.take(self.u32(name), name)

    def flag(self, name: str) -> bool:
        value = self.u8(name)
        if value > 1:
            raise BadFrame(f"{self.what}.{name} must be 0 or 1, got {value}")
        return value == 1

    def code(self, name: str, table: Mapping[_E, int]) -> _E:
        value = self.u8(name)
        for member, code in table.items():
            if code == value:
                return member
        raise BadFrame(f"{self.what}.{name}: unknown code {value}")

    def end(self) -> None:
        if self.pos != len(self.data):
            raise BadFrame(f"{len(self.data) - self.pos} bytes after the {self.what} payload")


# ---------------------------------------------------------------- frames


class _Frame:
    """Base of the frame classes: ``encode()`` gives the wire bytes."""

    __slots__ = ()
    TYPE: ClassVar[int]

    def payload(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def read(cls, r: _Reader) -> Self:
        raise NotImplementedError

    def encode(self) -> bytes:
        payload = self.payload()
        header = _HEADER.pack(MAGIC, PROTOCOL_VERSION, self.TYPE, 0, len(payload))
        return b"".join((header, payload, _CRC.pack(zlib.crc32(payload, zlib.crc32(header)))))

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """Decode exactly one whole frame of this type."""
        got = decode_frame(data, max_frame_size=max(len(data), 1))
        if got is None or got[1] != len(data) or not isinstance(got[0], cls):
            raise BadFrame(f"not exactly one {cls.__name__} frame")
        return got[0]


@dataclass(frozen=True, slots=True)
class Hello(_Frame):
    """First frame each way: the standby opens, the active answers."""

    TYPE: ClassVar[int] = 1
    site: str
    version: int
    role: Role

    def __post_init__(self) -> None:
        _check_text("site", self.site)
        _check_int("version", self.version, 0, _MAX_U16)
        object.__setattr__(self, "role", Role(self.role))

    def payload(self) -> bytes:
        return _str16(self.site) + _U16.pack(self.version) + _U8.pack(_ROLE_CODES[self.role])

    @classmethod
    def read(cls, r: _Reader) -> Self:
        return cls(r.text("site"), r.u16("version"), r.code("role", _ROLE_CODES))


@dataclass(frozen=True, slots=True)
class GetAllResources(_Frame):
    """Standby to active: list every replicated VPN (GET_ALL_RESOURCES)."""

    TYPE: ClassVar[int] = 2

    def payload(self) -> bytes:
        return b""

    @classmethod
    def read(cls, r: _Reader) -> Self:
        return cls()


@dataclass(frozen=True, slots=True)
class VpnResource:
    """One replicated VPN as the active lists it: its fencing epoch, its
    replication settings and its RabbitMQ definitions export (config-sync)."""

    name: str
    epoch: int
    mode: Mode
    sync_timeout_ms: int
    on_sync_timeout: SyncTimeoutPolicy
    queue_patterns: tuple[str, ...]
    topic_filters: tuple[TopicFilter, ...]
    definitions_json: bytes
    expose_id: bool = False
    #: the index of the previous epoch's ledger up to which this site had
    #: applied it when it took the VPN over (0: the VPN never changed sites)
    taken_over_at: int = 0

    def __post_init__(self) -> None:
        _check_text("VPN name", self.name)
        _check_int("epoch", self.epoch, 1)
        _check_int("sync_timeout_ms", self.sync_timeout_ms, 0, _MAX_U32)
        object.__setattr__(self, "mode", Mode(self.mode))
        object.__setattr__(self, "on_sync_timeout", SyncTimeoutPolicy(self.on_sync_timeout))
        if len(self.queue_patterns) > _MAX_U16 or len(self.topic_filters) > _MAX_U16:
            raise ValueError(f"at most {_MAX_U16} queue patterns and topic filters")
        for pattern in self.queue_patterns:
            _check_text("queue pattern", pattern)
        for topic in self.topic_filters:
            _check_text("topic filter exchange", topic.exchange, empty=True)
            _check_text("topic filter pattern", topic.pattern)
        _check_blob("definitions", self.definitions_json)
        _check_int("taken_over_at", self.taken_over_at, 0)

    @classmethod
    def from_settings(
        cls, settings: VpnSettings, epoch: int, definitions_json: bytes, taken_over_at: int = 0
    ) -> VpnResource:
        return cls(
            settings.name,
            epoch,
            settings.mode,
            settings.sync_timeout_ms,
            settings.on_sync_timeout,
            settings.queue_patterns,
            settings.topic_filters,
            definitions_json,
            settings.expose_id,
            taken_over_at,
        )

    def payload(self) -> bytes:
        return b"".join(
            (
                _str16(self.name),
                _U64.pack(self.epoch),
                _U8.pack(_MODE_CODES[self.mode]),
                _U32.pack(self.sync_timeout_ms),
                _U8.pack(_POLICY_CODES[self.on_sync_timeout]),
                _strs16(self.queue_patterns),
                _U16.pack(len(self.topic_filters)),
                *(_str16(t.exchange) + _str16(t.pattern) for t in self.topic_filters),
                _bytes32(self.definitions_json),
                _U8.pack(1 if self.expose_id else 0),
                _U64.pack(self.taken_over_at),
            )
        )

    @classmethod
    def read(cls, r: _Reader) -> VpnResource:
        name, epoch = r.text("name"), r.u64("epoch")
        mode = r.code("mode", _MODE_CODES)
        timeout = r.u32("sync_timeout_ms")
        policy = r.code("on_sync_timeout", _POLICY_CODES)
        patterns = r.texts("queue_patterns")
        topics = tuple(
            TopicFilter(r.text("topic exchange"), r.text("topic pattern"))
            for _ in range(r.u16("topic_filters"))
        )
        definitions, expose_id = r.blob("definitions"), r.flag("expose_id")
        taken_over_at = r.u64("taken_over_at")
        return cls(
            name,
            epoch,
            mode,
            timeout,
            policy,
            patterns,
            topics,
            definitions,
            expose_id,
            taken_over_at,
        )


@dataclass(frozen=True, slots=True)
class ResourceList(_Frame):
    """Active to standby: every replicated VPN (RESOURCE_LIST).

    Sent in answer to ``GetAllResources`` and again, unasked, whenever the
    set changes; a VPN missing from the latest list is forgotten by both ends.
    """

    TYPE: ClassVar[int] = 3
    vpns: tuple[VpnResource, ...]

    def __post_init__(self) -> None:
        names = [v.name for v in self.vpns]
        if len(set(names)) != len(names):
            raise ValueError("a VPN is listed twice")
        _check_int("VPN count", len(names), 0, _MAX_U32)

    def payload(self) -> bytes:
        return _U32.pack(len(self.vpns)) + b"".join(v.payload() for v in self.vpns)

    @classmethod
    def read(cls, r: _Reader) -> Self:
        return cls(tuple(VpnResource.read(r) for _ in range(r.u32("vpn count"))))


@dataclass(frozen=True, slots=True)
class SyncRequest(_Frame):
    """Standby to active: replay ``vpn`` after ``last_applied_index`` (SYNC_REQ).

    ``epoch`` is the highest epoch the standby knows for the VPN (a stale
    active learns from it that it is fenced); ``last_applied_epoch`` is the
    epoch of the standby's last applied entry, so the active can tell a
    standby whose history diverged (a demoted former active) from one that is
    merely behind — both get a checkpoint. Both are 0 when nothing is applied.
    """

    TYPE: ClassVar[int] = 4
    vpn: str
    epoch: int
    last_applied_index: int
    last_applied_epoch: int

    def __post_init__(self) -> None:
        _check_text("vpn", self.vpn)
        _check_int("epoch", self.epoch, 1)
        _check_int("last_applied_index", self.last_applied_index, 0)
        _check_int("last_applied_epoch", self.last_applied_epoch, 0, self.epoch)
        if (self.last_applied_index == 0) != (self.last_applied_epoch == 0):
            raise ValueError("last_applied_index and last_applied_epoch are 0 together")

    def payload(self) -> bytes:
        numbers = (self.epoch, self.last_applied_index, self.last_applied_epoch)
        return _str16(self.vpn) + b"".join(_U64.pack(n) for n in numbers)

    @classmethod
    def read(cls, r: _Reader) -> Self:
        return cls(r.text("vpn"), r.u64("epoch"), r.u64("last_applied"), r.u64("last_epoch"))


@dataclass(frozen=True, slots=True)
class SyncAccepted(_Frame):
    """Active to standby: the replay of ``vpn`` starts at ``from_index``
    (SYNC_REQ_ACCEPTED). Anything but ``last_applied_index + 1`` announces a
    :class:`Checkpoint` at ``from_index - 1``."""

    TYPE: ClassVar[int] = 5
    vpn: str
    epoch: int
    from_index: int

    def __post_init__(self) -> None:
        _check_text("vpn", self.vpn)
        _check_int("epoch", self.epoch, 1)
        _check_int("from_index", self.from_index, 1)

    def payload(self) -> bytes:
        return _str16(self.vpn) + _U64.pack(self.epoch) + _U64.pack(self.from_index)

    @classmethod
    def read(cls, r: _Reader) -> Self:
        return cls(r.text("vpn"), r.u64("epoch"), r.u64("from_index"))


@dataclass(frozen=True, slots=True)
class CheckpointRow:
    """One live (not yet consumed) message of one queue on the active."""

    queue: str
    repl_id: ReplicationId
    publish_index: int
    exchange: str
    routing_key: str
    properties: bytes
    body: bytes

    def __post_init__(self) -> None:
        _check_text("queue", self.queue)
        _check_int("publish_index", self.publish_index, 1)
        _check_text("exchange", self.exchange, empty=True)
        _check_text("routing_key", self.routing_key, empty=True)
        _check_blob("properties", self.properties)
        _check_blob("body", self.body)

    def payload(self) -> bytes:
        return b"".join(
            (
                _str16(self.queue),
                self.repl_id.value,
                _U64.pack(self.publish_index),
                _str16(self.exchange),
                _str16(self.routing_key),
                _bytes32(self.properties),
                _bytes32(self.body),
            )
        )

    @classmethod
    def read(cls, r: _Reader) -> CheckpointRow:
        queue = r.text("queue")
        repl_id = ReplicationId(r.take(16, "repl_id"))
        publish_index = r.u64("publish_index")
        exchange, routing_key = r.text("exchange"), r.text("routing_key")
        return cls(
            queue,
            repl_id,
            publish_index,
            exchange,
            routing_key,
            r.blob("properties"),
            r.blob("body"),
        )


@dataclass(frozen=True, slots=True)
class Checkpoint(_Frame):
    """Active to standby: the VPN's live messages as of ledger ``index``, for
    a standby behind the retained ledger; split over frames, ``last`` on the
    final one. Installing it replaces the standby's state for the VPN."""

    TYPE: ClassVar[int] = 6
    vpn: str
    epoch: int
    index: int
    rows: tuple[CheckpointRow, ...]
    last: bool

    def __post_init__(self) -> None:
        _check_text("vpn", self.vpn)
        _check_int("epoch", self.epoch, 1)
        _check_int("index", self.index, 0)
        _check_int("row count", len(self.rows), 0, _MAX_U32)
        for row in self.rows:
            if row.publish_index > self.index:
                raise ValueError(f"a row published at {row.publish_index} is past the checkpoint")

    def payload(self) -> bytes:
        head = _str16(self.vpn) + _U64.pack(self.epoch) + _U64.pack(self.index)
        rows = _U32.pack(len(self.rows)) + b"".join(row.payload() for row in self.rows)
        return head + _U8.pack(int(self.last)) + rows

    @classmethod
    def read(cls, r: _Reader) -> Self:
        vpn, epoch, index, last = r.text("vpn"), r.u64("epoch"), r.u64("index"), r.flag("last")
        rows = tuple(CheckpointRow.read(r) for _ in range(r.u32("row count")))
        return cls(vpn, epoch, index, rows, last)


@dataclass(frozen=True, slots=True)
class _IndexFrame(_Frame):
    """A VPN frame that carries one ledger index and nothing else."""

    vpn: str
    epoch: int
    index: int

    def __post_init__(self) -> None:
        _check_text("vpn", self.vpn)
        _check_int("epoch", self.epoch, 1)
        _check_int("index", self.index, 0)

    def payload(self) -> bytes:
        return _str16(self.vpn) + _U64.pack(self.epoch) + _U64.pack(self.index)

    @classmethod
    def read(cls, r: _Reader) -> Self:
        return cls(r.text("vpn"), r.u64("epoch"), r.u64("index"))


@dataclass(frozen=True, slots=True)
class SyncFinished(_IndexFrame):
    """Active to standby: the replay of ``vpn`` ended at ``index``; live
    events follow (SYNC_FINISHED)."""

    TYPE: ClassVar[int] = 7


@dataclass(frozen=True, slots=True)
class Events(_Frame):
    """Active to standby: consecutive ledger entries of one VPN.

    On the wire the indexes are implicit (the first index, then one per
    entry), so a batch with a hole cannot even be encoded.
    """

    TYPE: ClassVar[int] = 8
    vpn: str
    epoch: int
    entries: tuple[LedgerEntry, ...]

    def __post_init__(self) -> None:
        _check_text("vpn", self.vpn)
        _check_int("epoch", self.epoch, 1)
        if not self.entries:
            raise ValueError("an Events batch holds at least one entry")
        _check_int("entry count", len(self.entries), 1, _MAX_U32)
        first, epoch = self.entries[0].index, 0
        for offset, entry in enumerate(self.entries):
            if entry.vpn != self.vpn or entry.event.vpn != self.vpn:
                raise ValueError(f"entry {entry.index} belongs to VPN {entry.vpn!r}")
            if entry.index != first + offset:
                raise ValueError(f"entries are not consecutive at index {entry.index}")
            if not epoch <= entry.epoch <= self.epoch:
                raise ValueError(f"entry {entry.index} has epoch {entry.epoch} out of order")
            epoch = entry.epoch

    def payload(self) -> bytes:
        head = _str16(self.vpn) + _U64.pack(self.epoch) + _U64.pack(self.entries[0].index)
        parts = [head, _U32.pack(len(self.entries))]
        for e in self.entries:  # the ledger's bytes, as stored: not encoded again
            data = e.encoded
            parts.append(_ENTRY_HEAD.pack(e.epoch, len(data)))
            parts.append(data)
        return b"".join(parts)

    @classmethod
    def read(cls, r: _Reader) -> Self:
        vpn, epoch, first = r.text("vpn"), r.u64("epoch"), r.u64("first_index")
        entries = []
        for n in range(r.u32("entry count")):
            entry_epoch, data = r.u64("entry epoch"), r.blob("event")
            entries.append(LedgerEntry(vpn, entry_epoch, first + n, decode_event(data, vpn), data))
        return cls(vpn, epoch, tuple(entries))


@dataclass(frozen=True, slots=True)
class Ack(_IndexFrame):
    """Standby to active: ``vpn`` is durably applied up to ``index``
    (cumulative; never goes back on one stream)."""

    TYPE: ClassVar[int] = 9


@dataclass(frozen=True, slots=True)
class Heartbeat(_Frame):
    """Either way, once the sender's ``Hello`` is out: "still here"."""

    TYPE: ClassVar[int] = 10

    def payload(self) -> bytes:
        return b""

    @classmethod
    def read(cls, r: _Reader) -> Self:
        return cls()


@dataclass(frozen=True, slots=True)
class Error(_Frame):
    """Either way: a fault with its bridge error code.

    ``vpn == ""`` ends the connection; otherwise it ends that VPN's stream
    (see the module docstring). :meth:`exception` rebuilds the class the
    sender raised, through :data:`~bridge.ERROR_CODES`.
    """

    TYPE: ClassVar[int] = 11
    code: int
    vpn: str
    text: str

    def __post_init__(self) -> None:
        _check_int("code", self.code, 0, _MAX_U16)
        _check_text("vpn", self.vpn, empty=True)
        _check_text("text", self.text, empty=True)

    @classmethod
    def from_exception(cls, exc: BridgeError, vpn: str | None = None) -> Error:
        """The frame reporting ``exc``; ``vpn=""`` makes it connection-level."""
        text = exc.text.encode()[:4096].decode(errors="ignore")
        return cls(exc.code, exc.vpn if vpn is None else vpn, text)

    @property
    def closes_connection(self) -> bool:
        return not self.vpn

    def exception(self) -> RemoteProtocolError:
        cls = ERROR_CODES.get(self.code)
        if cls is None:
            return PeerFailure(
                f"error code {self.code}: {self.text}", self.vpn, reported_by_peer=True
            )
        return cls(self.text, self.vpn, reported_by_peer=True)

    def payload(self) -> bytes:
        return _U16.pack(self.code) + _str16(self.vpn) + _str16(self.text)

    @classmethod
    def read(cls, r: _Reader) -> Self:
        return cls(r.u16("code"), r.text("vpn"), r.text("text"))


@dataclass(frozen=True, slots=True)
class _TxnFrame(_Frame):
    """What every frame about one transaction starts with."""

    vpn: str
    epoch: int
    txid: str

    def __post_init__(self) -> None:
        _check_text("vpn", self.vpn)
        _check_int("epoch", self.epoch, 1)
        _check_text("txid", self.txid)

    def _head(self) -> bytes:
        return _str16(self.vpn) + _U64.pack(self.epoch) + _str16(self.txid)

    @staticmethod
    def _read_head(r: _Reader) -> tuple[str, int, str]:
        return r.text("vpn"), r.u64("epoch"), r.text("txid")


@dataclass(frozen=True, slots=True)
class TxnPrepare(_TxnFrame):
    """Active to standby: persist transaction ``txid`` as prepared (its
    events in the ledger encoding, each ``u32``-length-prefixed) and vote."""

    TYPE: ClassVar[int] = 12
    events: bytes

    def __post_init__(self) -> None:
        _TxnFrame.__post_init__(self)
        _check_blob("events", self.events)

    def payload(self) -> bytes:
        return self._head() + _bytes32(self.events)

    @classmethod
    def read(cls, r: _Reader) -> Self:
        return cls(*cls._read_head(r), r.blob("events"))


@dataclass(frozen=True, slots=True)
class _TxnFlagFrame(_TxnFrame):
    """A transaction frame that ends in one yes/no octet, named ``FLAG``."""

    FLAG: ClassVar[str]

    def payload(self) -> bytes:
        return self._head() + _U8.pack(int(getattr(self, self.FLAG)))

    @classmethod
    def read(cls, r: _Reader) -> Self:
        return cls(*cls._read_head(r), r.flag(cls.FLAG))  # type: ignore[call-arg]


@dataclass(frozen=True, slots=True)
class TxnVote(_TxnFlagFrame):
    """Standby to active: ``txid`` is durably prepared (``ok``) or not."""

    TYPE: ClassVar[int] = 13
    FLAG: ClassVar[str] = "ok"
    ok: bool


@dataclass(frozen=True, slots=True)
class TxnOutcome(_TxnFlagFrame):
    """Active to standby: how ``txid`` ended. A commit's effects reach the
    standby with the ledger; this settles the participant's row."""

    TYPE: ClassVar[int] = 14
    FLAG: ClassVar[str] = "commit"
    commit: bool


@dataclass(frozen=True, slots=True)
class TxnQuery(_Frame):
    """Standby to active: how did these prepared transactions end? Answered
    with one ``TxnOutcome`` each, once the active knows."""

    TYPE: ClassVar[int] = 15
    vpn: str
    epoch: int
    txids: tuple[str, ...]

    def __post_init__(self) -> None:
        _check_text("vpn", self.vpn)
        _check_int("epoch", self.epoch, 1)
        _check_int("txid count", len(self.txids), 1, _MAX_U16)
        for txid in self.txids:
            _check_text("txid", txid)

    def payload(self) -> bytes:
        return _str16(self.vpn) + _U64.pack(self.epoch) + _strs16(self.txids)

    @classmethod
    def read(cls, r: _Reader) -> Self:
        return cls(r.text("vpn"), r.u64("epoch"), r.texts("txids"))


@dataclass(frozen=True, slots=True)
class TxnCommit(_TxnFrame):
    """Active to standby: the broker committed ``txid``, whose group the
    active is appending to its ledger at ``first`` onwards. The standby may
    apply the transaction from its prepared row at once, while the active's
    ledger write runs, and answer :class:`TxnApplied`; the group's copy in
    the stream is then recognised and skipped (``bridge._standby``)."""

    TYPE: ClassVar[int] = 16
    first: int

    def __post_init__(self) -> None:
        _TxnFrame.__post_init__(self)
        _check_int("first", self.first, 1)

    def payload(self) -> bytes:
        return self._head() + _U64.pack(self.first)

    @classmethod
    def read(cls, r: _Reader) -> Self:
        return cls(*cls._read_head(r), r.u64("first"))


@dataclass(frozen=True, slots=True)
class TxnApplied(_TxnFlagFrame):
    """Standby to active, the answer to every :class:`TxnCommit`: ``txid``'s
    effects and its commit are durable here (``applied``), or the standby
    left the transaction to the stream (not ``applied``), whose
    acknowledgement the active waits for instead. The active holds the
    group's copy in the stream until this answer, so the copy never
    competes with the commit ahead for either node (``bridge._transport``)."""

    TYPE: ClassVar[int] = 17
    FLAG: ClassVar[str] = "applied"
    applied: bool


TxnFrame = TxnPrepare | TxnVote | TxnOutcome | TxnQuery | TxnCommit | TxnApplied

Frame = (
    Hello
    | GetAllResources
    | ResourceList
    | SyncRequest
    | SyncAccepted
    | Checkpoint
    | SyncFinished
    | Events
    | Ack
    | Heartbeat
    | Error
    | TxnPrepare
    | TxnVote
    | TxnOutcome
    | TxnQuery
    | TxnCommit
    | TxnApplied
)

FRAME_TYPES: dict[int, type[Frame]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        GetAllResources,
        ResourceList,
        SyncRequest,
        SyncAccepted,
        Checkpoint,
        SyncFinished,
        Events,
        Ack,
        Heartbeat,
        Error,
        TxnPrepare,
        TxnVote,
        TxnOutcome,
        TxnQuery,
        TxnCommit,
        TxnApplied,
    )
}
_TXN_FRAMES = (TxnPrepare, TxnVote, TxnOutcome, TxnQuery, TxnCommit, TxnApplied)
_VPN_FRAMES = (
    SyncRequest,
    SyncAccepted,
    Checkpoint,
    SyncFinished,
    Events,
    Ack,
    Error,
    *_TXN_FRAMES,
)


def _decode_at(data: bytes | bytearray, pos: int, max_frame_size: int) -> tuple[Frame, int] | None:
    if len(data) - pos < _HEADER.size:
        return None
    magic, version, ftype, flags, length = _HEADER.unpack_from(data, pos)
    if magic != MAGIC:
        raise BadFrame(f"bad magic byte 0x{magic:02x}: the peer does not speak the bridge protocol")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(f"frame version {version}, this node speaks {PROTOCOL_VERSION}")
    if length > max_frame_size:
        raise BadFrame(f"a {length}-byte frame exceeds the {max_frame_size}-byte limit")
    body_end = pos + _HEADER.size + length
    if len(data) < body_end + _CRC.size:
        return None
    with memoryview(data) as view:
        crc = zlib.crc32(view[pos:body_end])
        payload = bytes(view[pos + _HEADER.size : body_end])
    (sent,) = _CRC.unpack_from(data, body_end)
    if crc != sent:
        raise BadChecksum(f"frame checksum 0x{sent:08x}, computed 0x{crc:08x}")
    if flags:
        raise BadFrame(f"unknown frame flags 0x{flags:02x}")
    cls = FRAME_TYPES.get(ftype)
    if cls is None:
        raise BadFrame(f"unknown frame type {ftype}")
    reader = _Reader(payload, cls.__name__)
    try:
        frame = cls.read(reader)
    except (ValueError, EventDecodeError) as e:
        raise BadFrame(f"{cls.__name__}: {e}") from e
    reader.end()
    return frame, body_end + _CRC.size


def decode_frame(
    data: bytes | bytearray, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
) -> tuple[Frame, int] | None:
    """The first frame in ``data`` and the bytes it used, or None if ``data``
    holds only part of it. Faults raise :class:`~bridge.RemoteProtocolError`
    subclasses; an oversize length is refused from the header alone."""
    return _decode_at(data, 0, max_frame_size)


class FrameReader:
    """Cuts a byte stream into frames, with no protocol state."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.max_frame_size = max_frame_size
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes) -> None:
        if self._pos and self._pos * 2 >= len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def next_frame(self) -> Frame | None:
        got = _decode_at(self._buf, self._pos, self.max_frame_size)
        if got is None:
            return None
        frame, self._pos = got
        return frame

    @property
    def pending(self) -> int:
        """Bytes received but not yet returned as a frame."""
        return len(self._buf) - self._pos


# ---------------------------------------------------------------- state machine
# Everything that affects the state machine lives below.


class Phase(enum.Enum):
    """The connection's phase, the same at both ends once in-flight frames land."""

    START = "start"  # nothing exchanged
    GREETING = "greeting"  # the standby's Hello is out, the active's is not
    GREETED = "greeted"  # both Hellos exchanged
    LISTING = "listing"  # GetAllResources asked, a ResourceList owed
    READY = "ready"  # a ResourceList delivered: per-VPN sync may run
    FAILED = "failed"  # a fatal fault was raised: only a connection-level Error may go out
    CLOSED = "closed"  # a connection-level Error went either way, or the peer hung up


class VpnState(enum.Enum):
    """One listed VPN's stream, as seen by one end."""

    LISTED = "listed"  # in the resource list, no stream
    SYNC_REQUESTED = "sync-requested"  # SyncRequest out, its answer owed
    RESYNC_REQUESTED = "resync-requested"  # same, and an abandoned stream may be in flight
    CATCHING_UP = "catching-up"  # SyncAccepted: checkpoint and replay until SyncFinished
    LIVE = "live"  # real-time events and acknowledgements
    DRAINING = "draining"  # the standby abandoned the stream; its tail is dropped


class _Drop(enum.Enum):
    DROP = "drop"


#: A frame the receiver drops: the tail of a stream the standby abandoned,
#: sent before the active saw the resync request or Error. Never legal to send.
DROP: Final = _Drop.DROP

_A, _S = Role.ACTIVE, Role.STANDBY
_P, _V = Phase, VpnState
State = Phase | VpnState

#: (sender, frame type, state at the end applying it) -> next state. Both ends
#: use this one table: an end checks its own sends against it and the peer's
#: frames on receipt. VPN frames are looked up with the VPN's state, others
#: with the connection's phase. A connection-level Error is legal in any phase
#: before CLOSED and leads to CLOSED.
TRANSITIONS: Final[Mapping[tuple[Role, type[Frame], State], State | _Drop]] = MappingProxyType(
    {
        # --- connection scope
        # The standby dials and speaks first; nothing may precede its Hello.
        (_S, Hello, _P.START): _P.GREETING,
        # The active answers Hello with Hello once it has checked version and role.
        (_A, Hello, _P.GREETING): _P.GREETED,
        # GET_ALL_RESOURCES, only once both ends know whom they talk to.
        (_S, GetAllResources, _P.GREETED): _P.LISTING,
        # The standby may ask for a fresh list at any time later.
        (_S, GetAllResources, _P.READY): _P.LISTING,
        # RESOURCE_LIST answers it: the only way VPNs become known on a connection.
        (_A, ResourceList, _P.LISTING): _P.READY,
        # The active re-lists unasked when VPNs are enabled, disabled or changed.
        (_A, ResourceList, _P.READY): _P.READY,
        # The standby's heartbeats may start right after its Hello ...
        (_S, Heartbeat, _P.GREETING): _P.GREETING,
        # ... and go on through every later phase,
        (_S, Heartbeat, _P.GREETED): _P.GREETED,
        # including while the active owes a ResourceList,
        (_S, Heartbeat, _P.LISTING): _P.LISTING,
        # and while VPNs sync and stream.
        (_S, Heartbeat, _P.READY): _P.READY,
        # The active's heartbeats start after its own Hello ...
        (_A, Heartbeat, _P.GREETED): _P.GREETED,
        # ... including while it prepares a ResourceList (definitions export),
        (_A, Heartbeat, _P.LISTING): _P.LISTING,
        # and while VPNs sync and stream.
        (_A, Heartbeat, _P.READY): _P.READY,
        # --- VPN scope
        # SYNC_REQ for a listed VPN with no stream, with the last applied index.
        (_S, SyncRequest, _V.LISTED): _V.SYNC_REQUESTED,
        # A resync during the replay (apply failure) abandons that replay.
        (_S, SyncRequest, _V.CATCHING_UP): _V.RESYNC_REQUESTED,
        # A resync of a live stream; what the active sent before seeing it is dropped.
        (_S, SyncRequest, _V.LIVE): _V.RESYNC_REQUESTED,
        # The resync after a Gap, a stale epoch or the standby's own Error.
        (_S, SyncRequest, _V.DRAINING): _V.RESYNC_REQUESTED,
        # SYNC_REQ_ACCEPTED answers a first request: the replay starts.
        (_A, SyncAccepted, _V.SYNC_REQUESTED): _V.CATCHING_UP,
        # ... or a resync request: a new replay starts, the old tail is behind it.
        (_A, SyncAccepted, _V.RESYNC_REQUESTED): _V.CATCHING_UP,
        # A VPN-level Error refuses a first request (unknown VPN, stale epoch) ...
        (_A, Error, _V.SYNC_REQUESTED): _V.LISTED,
        # ... or a resync request; the active sends VPN-level Errors only as answers.
        (_A, Error, _V.RESYNC_REQUESTED): _V.LISTED,
        # A checkpoint first when the standby is behind the retained ledger.
        (_A, Checkpoint, _V.CATCHING_UP): _V.CATCHING_UP,
        # The replay of retained entries, in index order.
        (_A, Events, _V.CATCHING_UP): _V.CATCHING_UP,
        # SYNC_FINISHED: the border between the replay and real time.
        (_A, SyncFinished, _V.CATCHING_UP): _V.LIVE,
        # Real-time replication.
        (_A, Events, _V.LIVE): _V.LIVE,
        # Durable acknowledgements already during the replay (lag, trimming) ...
        (_S, Ack, _V.CATCHING_UP): _V.CATCHING_UP,
        # ... and in real time, where sync-mode confirms wait for them.
        (_S, Ack, _V.LIVE): _V.LIVE,
        # A VPN-level Error from the standby with no stream (e.g. a stale listing).
        # Never while a request is unanswered, so no answer can cross it.
        (_S, Error, _V.LISTED): _V.LISTED,
        # The standby abandons a replay (stale epoch, apply failure).
        (_S, Error, _V.CATCHING_UP): _V.DRAINING,
        # The standby abandons a live stream.
        (_S, Error, _V.LIVE): _V.DRAINING,
        # A further report about a stream already abandoned (after a Gap, say).
        (_S, Error, _V.DRAINING): _V.DRAINING,
        # In flight after the standby abandoned the stream: a checkpoint chunk,
        (_A, Checkpoint, _V.DRAINING): DROP,
        # events,
        (_A, Events, _V.DRAINING): DROP,
        # or the end of a replay; all dropped.
        (_A, SyncFinished, _V.DRAINING): DROP,
        # In flight before the active saw the resync request: a checkpoint chunk,
        (_A, Checkpoint, _V.RESYNC_REQUESTED): DROP,
        # events,
        (_A, Events, _V.RESYNC_REQUESTED): DROP,
        # or the end of the old replay; all dropped until SyncAccepted.
        (_A, SyncFinished, _V.RESYNC_REQUESTED): DROP,
        # --- transactions (txn/_coordinator.py): independent of the event
        # stream, so legal in every state of a listed VPN and changing none.
        # The active asks the standby to prepare,
        **{(_A, TxnPrepare, state): state for state in VpnState},
        # the standby votes,
        **{(_S, TxnVote, state): state for state in VpnState},
        # the active tells how a transaction ended,
        **{(_A, TxnOutcome, state): state for state in VpnState},
        # and the standby asks about its prepared ones after a reconnect;
        **{(_S, TxnQuery, state): state for state in VpnState},
        # the active lets the standby commit ahead of the stream,
        **{(_A, TxnCommit, state): state for state in VpnState},
        # and the standby says whether it did.
        **{(_S, TxnApplied, state): state for state in VpnState},
    }
)


class Sentinel(enum.Enum):
    """What :meth:`BridgeConnection.next_event` returns instead of a frame."""

    NEED_DATA = "need data"
    CLOSED = "closed"


#: :meth:`BridgeConnection.next_event`: no whole frame buffered; receive more.
NEED_DATA: Final = Sentinel.NEED_DATA
#: :meth:`BridgeConnection.next_event`: the conversation is over.
CLOSED: Final = Sentinel.CLOSED


class _Install(enum.Enum):
    """Where a catch-up stands with respect to a checkpoint."""

    REQUIRED = "required"  # from_index != last_applied + 1: nothing else until it is complete
    ALLOWED = "allowed"  # the replay follows the standby's state; a checkpoint may still come
    OPEN = "open"  # chunks arriving, the last one not yet
    DONE = "done"  # installed, or the replay began: no checkpoint any more


@dataclass(frozen=True, slots=True)
class _Stream:
    """One VPN's stream as this end sees it; replaced whole on every change,
    so a frame that fails a check leaves no trace."""

    state: VpnState = VpnState.LISTED
    request: SyncRequest | None = None  # the accepted request being answered or streamed
    from_index: int = 0
    through: int = 0  # highest index delivered on this stream
    acked: int = 0
    install: _Install = _Install.DONE


_VpnFrame = SyncRequest | SyncAccepted | Checkpoint | SyncFinished | Events | Ack | Error | TxnFrame


class BridgeConnection:
    """One end of a bridge connection, in the h11 style.

    Feed received bytes to :meth:`receive_data` (``b""`` at end of stream) and
    call :meth:`next_event` until it returns :data:`NEED_DATA`; :meth:`send`
    checks a frame against the protocol and returns its bytes. Faults raise
    :class:`~bridge.RemoteProtocolError` subclasses; those with
    ``closes_connection`` leave the connection FAILED (send a connection-level
    :meth:`Error.from_exception` and close), the others (Gap, StaleEpoch,
    UnknownVpn) discard one frame and concern one VPN. An illegal send raises
    :class:`~bridge.LocalProtocolError` and changes nothing.

    What the caller does with the VPN-scoped faults: after :class:`~bridge.Gap`
    the standby sends ``SyncRequest`` from its last applied index; after
    :class:`~bridge.StaleEpoch` the standby sends ``Error.from_exception(e)``
    (the active learns it is fenced) and the active answers a stale
    ``SyncRequest`` the same way (a stale ``Ack`` needs nothing);
    :class:`~bridge.UnknownVpn` needs nothing (a ``ResourceList`` crossed
    the frame on the wire).

    ``known_epochs`` seeds the highest epoch this site knows per VPN (from its
    database), so a stale active is recognised on its first frame. The
    standby stamps its frames with :meth:`known_epoch`; the active stamps its
    own epoch and is fenced once :meth:`known_epoch` exceeds it.
    """

    def __init__(
        self,
        our_role: Role | str,
        our_site: str,
        *,
        known_epochs: Mapping[str, int] | None = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> None:
        self.our_role = Role(our_role)
        self.their_role = Role.STANDBY if self.our_role is Role.ACTIVE else Role.ACTIVE
        self.our_site = our_site
        self.peer_site: str | None = None
        self.phase = Phase.START
        self._reader = FrameReader(max_frame_size)
        self._epochs: dict[str, int] = dict(known_epochs or {})
        self._streams: dict[str, _Stream] = {}
        self._resources: dict[str, VpnResource] = {}
        self._eof = False
        self._failure: BridgeError | None = None

    # ------------------------------------------------------------ inspection

    @property
    def max_frame_size(self) -> int:
        return self._reader.max_frame_size

    @property
    def resources(self) -> Mapping[str, VpnResource]:
        """The VPNs of the latest ``ResourceList``, by name."""
        return MappingProxyType(self._resources)

    def vpn_state(self, vpn: str) -> VpnState | None:
        """The VPN's stream state, None if it is not listed."""
        stream = self._streams.get(vpn)
        return None if stream is None else stream.state

    def known_epoch(self, vpn: str) -> int:
        """The highest epoch seen for ``vpn`` (0 if none); an active whose own
        epoch is lower is fenced."""
        return self._epochs.get(vpn, 0)

    def next_index(self, vpn: str) -> int | None:
        """The index the VPN's stream continues with (next to send on the
        active, next expected on the standby), None without a stream."""
        stream = self._streams.get(vpn)
        if stream is None or stream.state not in (VpnState.CATCHING_UP, VpnState.LIVE):
            return None
        return stream.through + 1

    # ------------------------------------------------------------ bytes in/out

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes from the peer; ``b""`` means it closed the stream."""
        if self._eof and data:
            raise LocalProtocolError("data received after the end of the stream")
        if data:
            self._reader.feed(data)
        else:
            self._eof = True

    def next_event(self) -> Frame | Sentinel:
        """The next accepted frame, :data:`NEED_DATA` or :data:`CLOSED`."""
        while True:
            if self.phase is Phase.CLOSED:
                return CLOSED
            if self.phase is Phase.FAILED:
                raise RemoteProtocolError(f"the connection already failed: {self._failure}")
            try:
                frame = self._reader.next_frame()
                if frame is None:
                    return self._no_frame()
                accepted = self._process(self.their_role, frame, sending=False)
            except RemoteProtocolError as e:
                if e.closes_connection:
                    self._failure = e
                    self.phase = Phase.FAILED
                raise
            if accepted is not None:
                return accepted

    def send(self, frame: Frame) -> bytes:
        """The bytes of ``frame``, if we may send it now."""
        data = frame.encode()
        size = len(data) - _OVERHEAD
        if size > self.max_frame_size:
            raise LocalProtocolError(
                f"a {size}-byte {type(frame).__name__} exceeds the "
                f"{self.max_frame_size}-byte frame limit: split it",
                getattr(frame, "vpn", ""),
            )
        self._process(self.our_role, frame, sending=True)
        return data

    def _no_frame(self) -> Sentinel:
        if not self._eof:
            return NEED_DATA
        if self._reader.pending:
            raise BadFrame(f"the peer closed the stream {self._reader.pending} bytes into a frame")
        self.phase = Phase.CLOSED
        return CLOSED

    # ------------------------------------------------------------ transitions

    @staticmethod
    def _illegal(sending: bool, text: str, vpn: str = "") -> BridgeError:
        if sending:
            return LocalProtocolError(f"may not send {text}", vpn)
        return UnexpectedFrame(f"received {text}", vpn)

    def _process(self, sender: Role, frame: Frame, *, sending: bool) -> Frame | None:
        if self.phase is Phase.CLOSED:
            raise LocalProtocolError("the connection is closed")
        if isinstance(frame, Error) and frame.closes_connection:
            self.phase = Phase.CLOSED
            return frame
        if self.phase is Phase.FAILED:
            raise LocalProtocolError("after a fault only a connection-level Error may be sent")
        if isinstance(frame, _VPN_FRAMES):
            return self._process_vpn(sender, frame, sending=sending)
        if isinstance(frame, Hello):
            self._check_hello(frame, sending=sending)
        new = TRANSITIONS.get((sender, type(frame), self.phase))
        if not isinstance(new, Phase):
            what = f"{type(frame).__name__} from the {sender} in phase {self.phase.value}"
            raise self._illegal(sending, what)
        if isinstance(frame, ResourceList):
            self._relist(frame)
        if isinstance(frame, Hello) and not sending:
            self.peer_site = frame.site
        self.phase = new
        return frame

    def _check_hello(self, hello: Hello, *, sending: bool) -> None:
        if sending:
            ours = (self.our_site, self.our_role, PROTOCOL_VERSION)
            if (hello.site, hello.role, hello.version) != ours:
                raise LocalProtocolError(f"may not send {hello}: this end is {ours}")
            return
        if hello.version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"peer {hello.site!r} speaks version {hello.version}, this node {PROTOCOL_VERSION}"
            )
        if hello.role is self.our_role:
            raise RoleConflict(f"peer {hello.site!r} is {hello.role} too")
        if hello.site == self.our_site:
            raise RoleConflict(f"the peer claims this node's own site name {hello.site!r}")

    def _relist(self, listing: ResourceList) -> None:
        # Entries are never refused for their epoch: one stale VPN must not
        # hide the others. The standby's SyncRequest carries the higher epoch,
        # which fences the active for that VPN.
        streams: dict[str, _Stream] = {}
        for vpn in listing.vpns:
            streams[vpn.name] = self._streams.get(vpn.name) or _Stream()
            self._epochs[vpn.name] = max(self.known_epoch(vpn.name), vpn.epoch)
        self._streams = streams
        self._resources = {vpn.name: vpn for vpn in listing.vpns}

    def _process_vpn(self, sender: Role, frame: _VpnFrame, *, sending: bool) -> Frame | None:
        name = type(frame).__name__
        stream = self._streams.get(frame.vpn)
        if stream is None:
            if sending:
                raise LocalProtocolError(f"may not send {name}: VPN not listed", frame.vpn)
            raise UnknownVpn(f"received {name} for a VPN not in the resource list", frame.vpn)
        new = TRANSITIONS.get((sender, type(frame), stream.state))
        if new is DROP and not sending:
            return None
        if not isinstance(new, VpnState):
            raise self._illegal(sending, f"{name} in state {stream.state.value}", frame.vpn)
        if not isinstance(frame, Error):
            self._check_epoch(frame, new, sending=sending)
        if new is not stream.state:  # most frames keep the state: no copy for them
            stream = replace(stream, state=new)
        after, accepted = self._advance(frame, stream, sending=sending)
        self._streams[frame.vpn] = after
        if not isinstance(frame, Error):
            self._epochs[frame.vpn] = max(self.known_epoch(frame.vpn), frame.epoch)
        return accepted

    def _check_epoch(
        self,
        frame: SyncRequest | SyncAccepted | Checkpoint | SyncFinished | Events | Ack | TxnFrame,
        new: VpnState,
        *,
        sending: bool,
    ) -> None:
        known = self.known_epoch(frame.vpn)
        if frame.epoch >= known:
            return
        text = f"{type(frame).__name__} carries epoch {frame.epoch}, but epoch {known} is known"
        if sending:
            raise Fenced(text, frame.vpn)
        stream = self._streams[frame.vpn]
        if self.our_role is Role.STANDBY:
            # The active is fenced: nothing more of this stream may be applied.
            self._streams[frame.vpn] = replace(stream, state=VpnState.DRAINING)
        elif isinstance(frame, SyncRequest):
            # The request still owes an answer, and it can only be an Error.
            self._streams[frame.vpn] = replace(stream, state=new, request=None)
        raise StaleEpoch(text, frame.vpn, known=known, got=frame.epoch)

    def _advance(
        self, frame: _VpnFrame, stream: _Stream, *, sending: bool
    ) -> tuple[_Stream, Frame | None]:
        """Check ``frame`` against the stream's data (``stream.state`` is
        already the new state) and return the stream after it."""
        if isinstance(frame, SyncRequest):
            return replace(stream, request=frame), frame
        if isinstance(frame, SyncAccepted):
            return self._accept(frame, stream, sending=sending), frame
        if isinstance(frame, Checkpoint):
            return self._install(frame, stream, sending=sending), frame
        if isinstance(frame, Events):
            return self._events(frame, stream, sending=sending)
        if isinstance(frame, SyncFinished):
            return self._finish(frame, stream, sending=sending), frame
        if isinstance(frame, Ack):
            return self._ack(frame, stream, sending=sending), frame
        if isinstance(frame, _TXN_FRAMES):
            return stream, frame
        return replace(stream, request=None), frame  # a VPN-level Error

    def _accept(self, frame: SyncAccepted, stream: _Stream, *, sending: bool) -> _Stream:
        if stream.request is None:
            raise self._illegal(sending, "SyncAccepted for a rejected request", frame.vpn)
        follows = frame.from_index == stream.request.last_applied_index + 1
        return replace(
            stream,
            from_index=frame.from_index,
            through=frame.from_index - 1,
            acked=0,
            install=_Install.ALLOWED if follows else _Install.REQUIRED,
        )

    def _install(self, frame: Checkpoint, stream: _Stream, *, sending: bool) -> _Stream:
        if stream.install is _Install.DONE:
            what = "a Checkpoint once the replay began or the checkpoint ended"
            raise self._illegal(sending, what, frame.vpn)
        if frame.index != stream.from_index - 1:
            what = f"a Checkpoint at index {frame.index} for a replay from {stream.from_index}"
            raise self._illegal(sending, what, frame.vpn)
        return replace(stream, install=_Install.DONE if frame.last else _Install.OPEN)

    def _check_installed(
        self, frame: Events | SyncFinished | Ack, stream: _Stream, *, sending: bool
    ) -> None:
        if stream.install in (_Install.REQUIRED, _Install.OPEN):
            what = f"{type(frame).__name__} before the checkpoint is complete"
            raise self._illegal(sending, what, frame.vpn)

    def _events(
        self, frame: Events, stream: _Stream, *, sending: bool
    ) -> tuple[_Stream, Events | None]:
        self._check_installed(frame, stream, sending=sending)
        first, expected = frame.entries[0].index, stream.through + 1
        if sending and first != expected:
            raise LocalProtocolError(f"Events from {first}, the stream is at {expected}", frame.vpn)
        if first > expected:
            self._streams[frame.vpn] = replace(stream, state=VpnState.DRAINING)
            raise Gap(
                f"Events from index {first}, expected {expected}",
                frame.vpn,
                expected=expected,
                got=first,
            )
        fresh = frame.entries[expected - first :]
        if not fresh:
            return stream, None  # all duplicates
        after = replace(stream, through=fresh[-1].index, install=_Install.DONE)
        if len(fresh) == len(frame.entries):
            return after, frame
        return after, Events(frame.vpn, frame.epoch, fresh)

    def _finish(self, frame: SyncFinished, stream: _Stream, *, sending: bool) -> _Stream:
        self._check_installed(frame, stream, sending=sending)
        if frame.index != stream.through:
            what = f"SyncFinished at {frame.index}, the replay reached {stream.through}"
            raise self._illegal(sending, what, frame.vpn)
        return replace(stream, install=_Install.DONE)

    def _ack(self, frame: Ack, stream: _Stream, *, sending: bool) -> _Stream:
        self._check_installed(frame, stream, sending=sending)
        if not stream.acked <= frame.index <= stream.through:
            what = f"Ack of {frame.index}, outside {stream.acked}..{stream.through}"
            raise self._illegal(sending, what, frame.vpn)
        return replace(stream, acked=frame.index)
