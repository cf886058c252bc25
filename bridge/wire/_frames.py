"""The bridge's frames: the declared frame table and the stream cutter,
without I/O or state.

Every frame is a frozen dataclass whose fields are declared once, in wire
order, with their wire type (:mod:`bridge.wire._fields`); its encoder,
decoder and constructor checks are derived from that declaration
(:mod:`bridge.wire._declare`), so no
frame can be built that cannot be sent, and the bytes a frame decodes from
are exactly the ones it encodes to. Which frame may be sent when is the
connection's business (:mod:`bridge.wire._protocol`); this module only
guarantees that no bytes become a frame unless they are exactly what was
sent: the length is checked against the limit from the 8-byte header alone,
before anything is buffered (:class:`~bridge.BadFrame`), and the checksum
before the payload is read (:class:`~bridge.BadChecksum`).

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

Versions and capabilities are declared too: a field a version added is
marked ``Since(version)`` (an older peer neither sends nor reads it), a
frame type a version added has ``SINCE``, and an optional trailing part a
capability added is marked ``Trailing(capability)``: it is sent only when not
at its default, and :meth:`_Frame.for_peer` sends it at its default to a
peer without the capability.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, replace
from typing import Annotated, ClassVar, Final, Self

from bridge._entry import LedgerEntry
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

from ._declare import Declared, Nested, Since, Trailing, declared
from ._fields import MAX_U64, U16, U32, U64, Array, Blob, Code, Flag, LedgerEntries, ReplId, Text

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
#: bytes a frame adds to its payload: header and checksum
FRAME_OVERHEAD = _HEADER.size + _CRC.size


# ---------------------------------------------------------------- wire types

_ROLE_CODES = {Role.ACTIVE: 1, Role.STANDBY: 2}
_MODE_CODES = {Mode.ASYNC: 1, Mode.SYNC: 2}
_POLICY_CODES = {SyncTimeoutPolicy.DEGRADE: 1, SyncTimeoutPolicy.REJECT: 2}

#: a VPN's name, a transaction id, a site: 1..65535 bytes of UTF-8
Name = Annotated[str, Text()]
#: a string that may be empty
OptionalText = Annotated[str, Text(empty=True)]
#: a VPN's fencing epoch: epochs start at 1
Epoch = Annotated[int, U64(low=1)]
#: a ledger index (0: before the first entry)
Index = Annotated[int, U64()]
#: a ledger index of an entry: indexes start at 1
EntryIndex = Annotated[int, U64(low=1)]


# ---------------------------------------------------------------- frames


class _Wire(Declared):
    """A declared record of this protocol."""

    __slots__ = ()

    def payload(self, version: int = PROTOCOL_VERSION) -> bytes:
        """The bytes as a peer of ``version`` reads them."""
        return self._pack(version)


class _Frame(_Wire):
    """Base of the frame classes: ``encode()`` gives the wire bytes."""

    __slots__ = ()
    TYPE: ClassVar[int]
    #: the protocol version that added this frame type
    SINCE: ClassVar[int] = 1

    def encode(self, version: int = PROTOCOL_VERSION) -> bytes:
        """The wire bytes, stamped with the connection's protocol ``version``."""
        payload = self._pack(version)
        header = _HEADER.pack(MAGIC, version, self.TYPE, 0, len(payload))
        return b"".join((header, payload, _CRC.pack(zlib.crc32(payload, zlib.crc32(header)))))

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """Decode exactly one whole frame of this type."""
        got = decode_frame(data, max_frame_size=max(len(data), 1))
        if got is None or got[1] != len(data) or not isinstance(got[0], cls):
            raise BadFrame(f"not exactly one {cls.__name__} frame")
        return got[0]

    def for_peer(self, capabilities: int) -> Self:
        """This frame as a peer with only ``capabilities`` reads it: each
        field that needs another capability at its default."""
        if not self._needs & ~capabilities:
            return self
        lacking = {
            name: default
            for name, capability, default in self._capable
            if not capabilities & capability and getattr(self, name) != default
        }
        return replace(self, **lacking) if lacking else self  # type: ignore[type-var]


@declared
@dataclass(frozen=True, slots=True)
class Hello(_Frame):
    """First frame each way: the standby opens, the active answers; from
    version 6 on each end offers its ``capabilities`` (flags)."""

    TYPE: ClassVar[int] = 1
    site: Name
    version: Annotated[int, U16()]
    role: Annotated[Role, Code(_ROLE_CODES)]
    capabilities: Annotated[int, U32(), Since(6)] = 0


@declared
@dataclass(frozen=True, slots=True)
class GetAllResources(_Frame):
    """Standby to active: list every replicated VPN (GET_ALL_RESOURCES)."""

    TYPE: ClassVar[int] = 2


@declared
@dataclass(frozen=True, slots=True)
class VpnResource(_Wire):
    """One replicated VPN as the active lists it: its fencing epoch, its
    replication settings and its RabbitMQ definitions export (config-sync)."""

    name: Name
    epoch: Epoch
    mode: Annotated[Mode, Code(_MODE_CODES)]
    sync_timeout_ms: Annotated[int, U32()]
    on_sync_timeout: Annotated[SyncTimeoutPolicy, Code(_POLICY_CODES)]
    queue_patterns: Annotated[tuple[str, ...], Array(Text(), U16())]
    topic_filters: Annotated[
        tuple[TopicFilter, ...],
        Array(Nested(TopicFilter, exchange=Text(empty=True), pattern=Text()), U16()),
    ]
    definitions_json: Annotated[bytes, Blob()]
    expose_id: Annotated[bool, Flag()] = False
    #: the index of the previous epoch's ledger up to which this site had
    #: applied it when it took the VPN over (0: the VPN never changed sites)
    taken_over_at: Index = 0
    #: the active's durable ledger index when it read ``definitions_json``
    #: (version 6 on; None: not said, u64 max on the wire): every topology
    #: change after it comes in the stream (:mod:`bridge._definitions`)
    definitions_index: Annotated[int | None, U64(high=MAX_U64 - 1, none=MAX_U64), Since(6)] = None

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


@declared
@dataclass(frozen=True, slots=True)
class ResourceList(_Frame):
    """Active to standby: every replicated VPN (RESOURCE_LIST).

    Sent in answer to ``GetAllResources`` and again, unasked, whenever the
    set changes; a VPN missing from the latest list is forgotten by both ends.
    """

    TYPE: ClassVar[int] = 3
    vpns: Annotated[tuple[VpnResource, ...], Array(Nested(VpnResource), U32())]

    def _invariant(self) -> None:
        names = [v.name for v in self.vpns]
        if len(set(names)) != len(names):
            raise ValueError("a VPN is listed twice")


@declared
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
    vpn: Name
    epoch: Epoch
    last_applied_index: Index
    last_applied_epoch: Index
    taken_over_by: Annotated[OptionalText, Trailing(CAP_TAKEOVER)] = ""
    taken_over_at: Annotated[Index, Trailing(CAP_TAKEOVER)] = 0

    def _invariant(self) -> None:
        if self.last_applied_epoch > self.epoch:
            raise ValueError(
                f"last_applied_epoch must be 0..{self.epoch}, got {self.last_applied_epoch}"
            )
        if (self.last_applied_index == 0) != (self.last_applied_epoch == 0):
            raise ValueError("last_applied_index and last_applied_epoch are 0 together")
        if self.taken_over_at and not self.taken_over_by:
            raise ValueError("taken_over_at needs the site that took the epoch (taken_over_by)")


@declared
@dataclass(frozen=True, slots=True)
class SyncAccepted(_Frame):
    """Active to standby: the replay of ``vpn`` starts at ``from_index``
    (SYNC_REQ_ACCEPTED). Anything but ``last_applied_index + 1`` announces a
    :class:`Checkpoint` at ``from_index - 1``."""

    TYPE: ClassVar[int] = 5
    vpn: Name
    epoch: Epoch
    from_index: EntryIndex


@declared
@dataclass(frozen=True, slots=True)
class CheckpointRow(_Wire):
    """One live (not yet consumed) message of one queue on the active."""

    queue: Name
    repl_id: Annotated[ReplicationId, ReplId()]
    publish_index: EntryIndex
    exchange: OptionalText
    routing_key: OptionalText
    properties: Annotated[bytes, Blob()]
    body: Annotated[bytes, Blob()]


#: rows of live messages, as a Checkpoint and a Repair carry them
Rows = Annotated[tuple[CheckpointRow, ...], Array(Nested(CheckpointRow), U32())]


@declared
@dataclass(frozen=True, slots=True)
class Checkpoint(_Frame):
    """Active to standby: the VPN's live messages as of ledger ``index``, for
    a standby behind the retained ledger; split over frames, ``last`` on the
    final one. Installing it replaces the standby's state for the VPN."""

    TYPE: ClassVar[int] = 6
    WIRE_ORDER: ClassVar = ("vpn", "epoch", "index", "last", "rows")
    vpn: Name
    epoch: Epoch
    index: Index
    rows: Rows
    last: Annotated[bool, Flag()]

    def _invariant(self) -> None:
        for row in self.rows:
            if row.publish_index > self.index:
                raise ValueError(f"a row published at {row.publish_index} is past the checkpoint")


@dataclass(frozen=True, slots=True)
class _IndexFrame(_Frame):
    """A VPN frame that carries one ledger index and nothing else."""

    vpn: Name
    epoch: Epoch
    index: Index


@declared
@dataclass(frozen=True, slots=True)
class SyncFinished(_IndexFrame):
    """Active to standby: the replay of ``vpn`` ended at ``index``; live
    events follow (SYNC_FINISHED)."""

    TYPE: ClassVar[int] = 7


@declared
@dataclass(frozen=True, slots=True)
class Events(_Frame):
    """Active to standby: consecutive ledger entries of one VPN.

    On the wire the indexes are implicit (the first index, then one per
    entry), so a batch with a hole cannot even be encoded.
    """

    TYPE: ClassVar[int] = 8
    vpn: Name
    epoch: Epoch
    entries: Annotated[tuple[LedgerEntry, ...], LedgerEntries()]

    def _invariant(self) -> None:
        first, epoch = self.entries[0].index, 0
        for offset, entry in enumerate(self.entries):
            if entry.vpn != self.vpn or entry.event.vpn != self.vpn:
                raise ValueError(f"entry {entry.index} belongs to VPN {entry.vpn!r}")
            if entry.index != first + offset:
                raise ValueError(f"entries are not consecutive at index {entry.index}")
            if not epoch <= entry.epoch <= self.epoch:
                raise ValueError(f"entry {entry.index} has epoch {entry.epoch} out of order")
            epoch = entry.epoch


@declared
@dataclass(frozen=True, slots=True)
class Repair(_Frame):
    """Active to standby (version 5 on): a reconcile repair of ``vpn``'s live
    rows. ``rows`` are the rows as the active holds them at the stream
    position the frame takes (after the entry sent before it), ``absent``
    the (queue, id) keys the active holds no row for; the standby makes its
    rows so, in the stream's order, without moving its applied index."""

    TYPE: ClassVar[int] = 18
    SINCE: ClassVar[int] = 5
    vpn: Name
    epoch: Epoch
    rows: Rows
    absent: Annotated[
        tuple[tuple[str, ReplicationId], ...],
        Array(Nested(tuple, queue=Text(), repl_id=ReplId()), U32()),
    ]

    def _invariant(self) -> None:
        if not self.rows and not self.absent:
            raise ValueError("a Repair holds at least one row or absent key")


@declared
@dataclass(frozen=True, slots=True)
class Ack(_IndexFrame):
    """Standby to active: ``vpn`` is durably applied up to ``index``
    (cumulative; never goes back on one stream)."""

    TYPE: ClassVar[int] = 9


@declared
@dataclass(frozen=True, slots=True)
class Heartbeat(_Frame):
    """Either way, once the sender's ``Hello`` is out: "still here"."""

    TYPE: ClassVar[int] = 10


@declared
@dataclass(frozen=True, slots=True)
class Error(_Frame):
    """Either way: a fault with its bridge error code.

    ``vpn == ""`` ends the connection; otherwise it ends that VPN's stream
    (see the module docstring). :meth:`exception` rebuilds the class the
    sender raised, through :data:`~bridge.ERROR_CODES`.
    """

    TYPE: ClassVar[int] = 11
    code: Annotated[int, U16()]
    vpn: OptionalText
    text: OptionalText

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


@dataclass(frozen=True, slots=True)
class _TxnFrame(_Frame):
    """What every frame about one transaction starts with."""

    vpn: Name
    epoch: Epoch
    txid: Name


@declared
@dataclass(frozen=True, slots=True)
class TxnPrepare(_TxnFrame):
    """Active to standby: persist transaction ``txid`` as prepared (its
    events in the ledger encoding, each ``u32``-length-prefixed) and vote.
    ``owner``: an XA branch's broker user, the standby keeps it in the row
    (:data:`CAP_XA_OWNER`: a ``str16`` after the events, there only when
    not empty; a peer without the capability is sent none)."""

    TYPE: ClassVar[int] = 12
    events: Annotated[bytes, Blob()]
    owner: Annotated[OptionalText, Trailing(CAP_XA_OWNER)] = ""


@declared
@dataclass(frozen=True, slots=True)
class TxnVote(_TxnFrame):
    """Standby to active: ``txid`` is durably prepared (``ok``) or not."""

    TYPE: ClassVar[int] = 13
    ok: Annotated[bool, Flag()]


@declared
@dataclass(frozen=True, slots=True)
class TxnOutcome(_TxnFrame):
    """Active to standby: how ``txid`` ended. A commit's effects reach the
    standby with the ledger; this settles the participant's row."""

    TYPE: ClassVar[int] = 14
    commit: Annotated[bool, Flag()]


@declared
@dataclass(frozen=True, slots=True)
class TxnQuery(_Frame):
    """Standby to active: how did these prepared transactions end? Answered
    with one ``TxnOutcome`` each, once the active knows."""

    TYPE: ClassVar[int] = 15
    vpn: Name
    epoch: Epoch
    txids: Annotated[tuple[str, ...], Array(Text(), U16(low=1))]


@declared
@dataclass(frozen=True, slots=True)
class TxnCommit(_TxnFrame):
    """Active to standby: the broker committed ``txid``, whose group the
    active is appending to its ledger at ``first`` onwards. The standby may
    apply the transaction from its prepared row at once, while the active's
    ledger write runs, and answer :class:`TxnApplied`; the group's copy in
    the stream is then recognised and skipped (``bridge.standby._applier``)."""

    TYPE: ClassVar[int] = 16
    SINCE: ClassVar[int] = 2
    first: EntryIndex


@declared
@dataclass(frozen=True, slots=True)
class TxnApplied(_TxnFrame):
    """Standby to active, the answer to every :class:`TxnCommit`: ``txid``'s
    effects and its commit are durable here (``applied``), or the standby
    left the transaction to the stream (not ``applied``), whose
    acknowledgement the active waits for instead. The active holds the
    group's copy in the stream until this answer, so the copy never
    competes with the early commit for either node (``bridge.active._stream``)."""

    TYPE: ClassVar[int] = 17
    SINCE: ClassVar[int] = 2
    applied: Annotated[bool, Flag()]


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
#: the frame types each version this node speaks has
_TYPES_IN: Final = {
    version: {t: cls for t, cls in FRAME_TYPES.items() if cls.SINCE <= version}
    for version in SUPPORTED_VERSIONS
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
    cls = _TYPES_IN[version].get(ftype)
    if cls is None:
        raise BadFrame(f"unknown frame type {ftype}")
    try:
        frame, end = cls._unpack(payload, 0, length, version, cls.__name__)
    except ValueError as e:  # a check of the constructor's, an EventDecodeError
        raise BadFrame(f"{cls.__name__}: {e}") from e
    if end != length:
        raise BadFrame(f"{length - end} bytes after the {cls.__name__} payload")
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
