"""The bridge's frames and their wire encoding, without I/O or state.

Every frame is a frozen dataclass that validates its fields on
construction, encodes itself (:meth:`encode`) and decodes from a payload
(:meth:`decode`); :func:`decode_frame` and :class:`FrameReader` cut a byte
stream into frames. Which frame may be sent when is the connection's
business (:mod:`bridge.wire._protocol`); this module only guarantees that no
bytes become a frame unless they are exactly what was sent: the length is
checked against the limit from the 8-byte header alone, before anything is
buffered (:class:`~bridge.BadFrame`), and the checksum before the payload
is read (:class:`~bridge.BadChecksum`).

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

import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Final, Self, TypeVar

from bridge._entry import EventDecodeError, LedgerEntry, decode_event
from bridge._errors import (
    ERROR_CODES,
    BadChecksum,
    BadFrame,
    BridgeError,
    PeerFailure,
    RemoteProtocolError,
    VersionMismatch,
)
from bridge._ids import ReplicationId
from bridge._settings import Mode, Role, SyncTimeoutPolicy, TopicFilter, VpnSettings

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "FRAME_OVERHEAD",
    "FRAME_TYPES",
    "MAGIC",
    "CAPABILITIES",
    "CAP_PURGE_POINT",
    "CAP_TAKEOVER",
    "CAP_TOPOLOGY",
    "CAP_XA_OWNER",
    "OUR_CAPABILITIES",
    "PREVIOUS_PROTOCOL_VERSION",
    "PROTOCOL_VERSION",
    "Repair",
    "SUPPORTED_VERSIONS",
    "Ack",
    "Checkpoint",
    "CheckpointRow",
    "Error",
    "Events",
    "Frame",
    "FrameReader",
    "GetAllResources",
    "Heartbeat",
    "Hello",
    "ResourceList",
    "SyncAccepted",
    "SyncFinished",
    "SyncRequest",
    "TxnApplied",
    "TxnCommit",
    "TXN_FRAMES",
    "TxnFrame",
    "TxnOutcome",
    "TxnPrepare",
    "TxnQuery",
    "TxnVote",
    "VPN_FRAMES",
    "VpnResource",
    "decode_frame",
]

MAGIC: Final = 0xBD
#: 2: TxnCommit / TxnApplied; 3: TxnApplied answers every TxnCommit;
#: 4: VpnResource carries expose_id and the index its epoch took over at;
#: 5: VpnResource's queue patterns are searched in a queue name, not
#: matched against all of it (schema revision 0008 rewrote stored ones);
#: 6: capability flags in the Hello (:data:`CAPABILITIES`), and the index a
#: VpnResource's definitions were read at. Later features of this protocol
#: are capabilities, not versions.
PROTOCOL_VERSION: Final = 6
#: The oldest version this node still speaks, so that the two sites can be
#: upgraded one at a time: a connection runs at the lower of the two ends'
#: versions (agreed in the Hello exchange), and its frames carry it.
PREVIOUS_PROTOCOL_VERSION: Final = 5
SUPPORTED_VERSIONS: Final = frozenset({PREVIOUS_PROTOCOL_VERSION, PROTOCOL_VERSION})
#: capability flags (version 6 on): each end offers its own in its Hello,
#: and a connection uses those both offered
CAP_TOPOLOGY: Final = 1 << 0
"""topology changes travel in the stream as ``TopologyChanged`` events"""
CAP_XA_OWNER: Final = 1 << 1
"""a ``TxnPrepare`` names the broker user that owns its XA branch"""
CAP_TAKEOVER: Final = 1 << 2
"""a ``SyncRequest`` names the site that took its epoch and where"""
CAP_PURGE_POINT: Final = 1 << 3
"""a ``Purged`` event says the ledger index its request went to the broker at"""
#: every capability this node has, by name (for log lines)
CAPABILITIES: Final = {
    CAP_TOPOLOGY: "topology events",
    CAP_XA_OWNER: "XA branch owners",
    CAP_TAKEOVER: "take-over points in sync requests",
    CAP_PURGE_POINT: "purge points",
}
OUR_CAPABILITIES: Final = CAP_TOPOLOGY | CAP_XA_OWNER | CAP_TAKEOVER | CAP_PURGE_POINT
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
#: bytes a frame adds to its payload: header and checksum
FRAME_OVERHEAD = _HEADER.size + _CRC.size

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

    __slots__ = ("data", "pos", "version", "what")

    def __init__(self, data: bytes, what: str, version: int = PROTOCOL_VERSION) -> None:
        self.data = data
        self.pos = 0
        self.what = what
        #: the protocol version in the frame's header: what the payload holds
        self.version = version

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

    def payload_in(self, version: int) -> bytes:
        """The payload as a peer of ``version`` reads it (the same bytes,
        except for frames whose fields changed between versions)."""
        return self.payload()

    @classmethod
    def read(cls, r: _Reader) -> Self:
        raise NotImplementedError

    def encode(self, version: int = PROTOCOL_VERSION) -> bytes:
        """The wire bytes, stamped with the connection's protocol ``version``."""
        payload = self.payload_in(version)
        header = _HEADER.pack(MAGIC, version, self.TYPE, 0, len(payload))
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
    """First frame each way: the standby opens, the active answers; from
    version 6 on each end offers its ``capabilities`` (flags)."""

    TYPE: ClassVar[int] = 1
    site: str
    version: int
    role: Role
    capabilities: int = 0

    def __post_init__(self) -> None:
        _check_text("site", self.site)
        _check_int("version", self.version, 0, _MAX_U16)
        _check_int("capabilities", self.capabilities, 0, _MAX_U32)
        object.__setattr__(self, "role", Role(self.role))

    def payload(self) -> bytes:
        return self.payload_in(PROTOCOL_VERSION)

    def payload_in(self, version: int) -> bytes:
        head = _str16(self.site) + _U16.pack(self.version) + _U8.pack(_ROLE_CODES[self.role])
        return head if version < 6 else head + _U32.pack(self.capabilities)

    @classmethod
    def read(cls, r: _Reader) -> Self:
        site, version, role = r.text("site"), r.u16("version"), r.code("role", _ROLE_CODES)
        capabilities = r.u32("capabilities") if r.version >= 6 else 0
        return cls(site, version, role, capabilities)


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
    #: the active's durable ledger index when it read ``definitions_json``
    #: (version 6 on; None: not said): every topology change after it comes
    #: in the stream (:mod:`bridge._definitions`)
    definitions_index: int | None = None

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
        if self.definitions_index is not None:
            _check_int("definitions_index", self.definitions_index, 0, _MAX_U64 - 1)

    @classmethod
    def from_settings(
        cls,
        settings: VpnSettings,
        epoch: int,
        definitions_json: bytes,
        taken_over_at: int = 0,
        definitions_index: int | None = None,
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
            definitions_index,
        )

    def payload(self) -> bytes:
        return self.payload_in(PROTOCOL_VERSION)

    def payload_in(self, version: int) -> bytes:
        """The resource's bytes as a peer of ``version`` reads them."""
        head = self._payload()
        if version < 6:
            return head
        # u64 max: not said
        index = _MAX_U64 if self.definitions_index is None else self.definitions_index
        return head + _U64.pack(index)

    def _payload(self) -> bytes:
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
        index: int | None = None
        if r.version >= 6:
            index = r.u64("definitions_index")
            index = None if index == _MAX_U64 else index
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
            index,
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
        return self.payload_in(PROTOCOL_VERSION)

    def payload_in(self, version: int) -> bytes:
        return _U32.pack(len(self.vpns)) + b"".join(v.payload_in(version) for v in self.vpns)

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

    ``taken_over_by`` and ``taken_over_at``: the site that took the VPN at
    ``epoch`` and the index of the previous epoch's ledger it took it over
    at, from the standby's epoch history ("" and 0: not known), so that an
    active this request fences records them as a listing's would
    (:data:`CAP_TAKEOVER`: a ``str16`` and a ``u64`` after the numbers,
    there only when the site is known; a peer without the capability is
    sent none).
    """

    TYPE: ClassVar[int] = 4
    vpn: str
    epoch: int
    last_applied_index: int
    last_applied_epoch: int
    taken_over_by: str = ""
    taken_over_at: int = 0

    def __post_init__(self) -> None:
        _check_text("vpn", self.vpn)
        _check_int("epoch", self.epoch, 1)
        _check_int("last_applied_index", self.last_applied_index, 0)
        _check_int("last_applied_epoch", self.last_applied_epoch, 0, self.epoch)
        if (self.last_applied_index == 0) != (self.last_applied_epoch == 0):
            raise ValueError("last_applied_index and last_applied_epoch are 0 together")
        _check_text("taken_over_by", self.taken_over_by, empty=True)
        _check_int("taken_over_at", self.taken_over_at, 0)
        if self.taken_over_at and not self.taken_over_by:
            raise ValueError("taken_over_at needs the site that took the epoch (taken_over_by)")

    def payload(self) -> bytes:
        numbers = (self.epoch, self.last_applied_index, self.last_applied_epoch)
        head = _str16(self.vpn) + b"".join(_U64.pack(n) for n in numbers)
        if not self.taken_over_by:
            return head
        return head + _str16(self.taken_over_by) + _U64.pack(self.taken_over_at)

    @classmethod
    def read(cls, r: _Reader) -> Self:
        vpn, epoch = r.text("vpn"), r.u64("epoch")
        applied, applied_epoch = r.u64("last_applied"), r.u64("last_epoch")
        if r.pos == len(r.data):
            return cls(vpn, epoch, applied, applied_epoch)
        by = r.text("taken_over_by")
        return cls(vpn, epoch, applied, applied_epoch, by, r.u64("taken_over_at"))


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
class Repair(_Frame):
    """Active to standby (version 5 on): a full-sync repair of ``vpn``'s live
    rows. ``rows`` are the rows as the active holds them at the stream
    position the frame takes (after the entry sent before it), ``absent``
    the (queue, id) keys the active holds no row for; the standby makes its
    rows so, in the stream's order, without moving its applied index."""

    TYPE: ClassVar[int] = 18
    vpn: str
    epoch: int
    rows: tuple[CheckpointRow, ...]
    absent: tuple[tuple[str, ReplicationId], ...]

    def __post_init__(self) -> None:
        _check_text("vpn", self.vpn)
        _check_int("epoch", self.epoch, 1)
        _check_int("row count", len(self.rows), 0, _MAX_U32)
        _check_int("absent count", len(self.absent), 0, _MAX_U32)
        if not self.rows and not self.absent:
            raise ValueError("a Repair holds at least one row or absent key")
        for queue, _ in self.absent:
            _check_text("queue", queue)

    def payload(self) -> bytes:
        head = _str16(self.vpn) + _U64.pack(self.epoch)
        rows = _U32.pack(len(self.rows)) + b"".join(row.payload() for row in self.rows)
        absent = _U32.pack(len(self.absent)) + b"".join(
            _str16(queue) + rid.value for queue, rid in self.absent
        )
        return head + rows + absent

    @classmethod
    def read(cls, r: _Reader) -> Self:
        vpn, epoch = r.text("vpn"), r.u64("epoch")
        rows = tuple(CheckpointRow.read(r) for _ in range(r.u32("row count")))
        absent = tuple(
            (r.text("queue"), ReplicationId(r.take(16, "repl_id")))
            for _ in range(r.u32("absent count"))
        )
        return cls(vpn, epoch, rows, absent)


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
    events in the ledger encoding, each ``u32``-length-prefixed) and vote.
    ``owner``: an XA branch's broker user, the standby keeps it in the row
    (:data:`CAP_XA_OWNER`: a ``str16`` after the events, there only when
    not empty; a peer without the capability is sent none)."""

    TYPE: ClassVar[int] = 12
    events: bytes
    owner: str = ""

    def __post_init__(self) -> None:
        _TxnFrame.__post_init__(self)
        _check_blob("events", self.events)
        _check_text("owner", self.owner, empty=True)

    def payload(self) -> bytes:
        owner = _str16(self.owner) if self.owner else b""
        return self._head() + _bytes32(self.events) + owner

    @classmethod
    def read(cls, r: _Reader) -> Self:
        head, events = cls._read_head(r), r.blob("events")
        return cls(*head, events, r.text("owner") if r.pos < len(r.data) else "")


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
    the stream is then recognised and skipped (``bridge.standby._applier``)."""

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
    competes with the early commit for either node (``bridge.active._stream``)."""

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
    | Repair
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
        Repair,
    )
}
#: the frames of the transaction link, and every frame that names a VPN
TXN_FRAMES = (TxnPrepare, TxnVote, TxnOutcome, TxnQuery, TxnCommit, TxnApplied)
VPN_FRAMES = (
    SyncRequest,
    SyncAccepted,
    Checkpoint,
    SyncFinished,
    Events,
    Ack,
    Error,
    Repair,
    *TXN_FRAMES,
)


def _decode_at(data: bytes | bytearray, pos: int, max_frame_size: int) -> tuple[Frame, int] | None:
    if len(data) - pos < _HEADER.size:
        return None
    magic, version, ftype, flags, length = _HEADER.unpack_from(data, pos)
    if magic != MAGIC:
        raise BadFrame(f"bad magic byte 0x{magic:02x}: the peer does not speak the bridge protocol")
    if version not in SUPPORTED_VERSIONS:
        raise VersionMismatch(
            f"frame version {version}, this node speaks versions "
            f"{PREVIOUS_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"
        )
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
    reader = _Reader(payload, cls.__name__, version)
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
