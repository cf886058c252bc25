"""The bridge wire protocol between an active and a standby site, without I/O.

Invariant: the standby never accepts an event that does not extend exactly the
state it already has, nor one from a fenced active. Concretely, a
:class:`BridgeConnection` never hands its caller

* bytes that were not sent as they are: every frame is length-prefixed and
  checksummed, its length checked against the limit from the 8-byte header
  alone, before anything is buffered (:class:`~bridge.BadFrame`,
  :class:`~bridge.BadChecksum`);
* a frame that is not legal in the connection's state: the transitions are
  the table :data:`CONNECTION_TRANSITIONS`, the same for both ends, each end checking
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

The conversation: the standby dials and sends ``Hello``, the active
answers ``Hello``; ``GetAllResources`` / ``ResourceList`` (VPNs, their
epochs, replication settings and RabbitMQ definitions); then per VPN
``SyncRequest`` with the last applied index, ``SyncAccepted``, an optional
``Checkpoint`` (for a standby behind the retained ledger), ``Events``
replayed in index order, ``SyncFinished``, then live ``Events``, while the
standby returns cumulative ``Ack`` frames ("durably applied up to index").

An ``Error`` frame with an empty ``vpn`` ends the connection. One with a VPN
ends that VPN's stream only: the active sends one solely to refuse a
``SyncRequest``; the standby sends one to abandon a stream (a stale epoch, an
apply failure). To stop streaming a VPN for another reason the active sends a
``ResourceList`` without it. These rules make every VPN-level race resolvable
without correlation ids: frames of a stream the standby abandoned that were
already in flight are recognised by state and dropped.

Versions and capabilities: the standby proposes its version in its
``Hello`` and the active answers in the same one or refuses; from version 6
on each ``Hello`` offers the sender's capability flags and the connection
uses those both offered (:attr:`BridgeConnection.capabilities`). A peer
without the topology capability reads each topology event as a purge of
the queue named "" (no queue has that name: a no-op that keeps the indexes
dense, so it detects no gap); one without the purge point capability reads
each purge without its purge point (``Purged.sent_at``), as it encoded them.

The frames and their wire encoding are :mod:`bridge.wire._frames`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Final

from bridge._entry import LedgerEntry
from bridge._errors import (
    BadFrame,
    BridgeError,
    Fenced,
    Gap,
    LocalProtocolError,
    RemoteProtocolError,
    RoleConflict,
    StaleEpoch,
    UnexpectedFrame,
    UnknownVpn,
    VersionMismatch,
)
from bridge._events import Purged, TopologyChanged
from bridge._settings import Role

from ._frames import (
    CAP_PURGE_POINT,
    CAP_TOPOLOGY,
    CAPABILITIES,
    DEFAULT_MAX_FRAME_SIZE,
    FRAME_OVERHEAD,
    OUR_CAPABILITIES,
    PREVIOUS_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    TXN_FRAMES,
    VPN_FRAMES,
    Ack,
    Checkpoint,
    Error,
    Events,
    Frame,
    FrameReader,
    GetAllResources,
    Heartbeat,
    Hello,
    Repair,
    ResourceList,
    SyncAccepted,
    SyncFinished,
    SyncRequest,
    TxnApplied,
    TxnCommit,
    TxnFrame,
    TxnOutcome,
    TxnPrepare,
    TxnQuery,
    TxnVote,
    VpnResource,
)

__all__ = [
    "PRE_HELLO_MAX_FRAME",
    "CLOSED",
    "NEED_DATA",
    "CONNECTION_TRANSITIONS",
    "BridgeConnection",
    "ConnectionPhase",
    "Sentinel",
    "VpnState",
]


# ---------------------------------------------------------------- state machine
# Everything that affects the state machine lives below.


#: the largest frame read before the peer's Hello (a Hello is a few hundred
#: bytes; an Error a few KiB): a stranger cannot make this end buffer more
PRE_HELLO_MAX_FRAME: Final = 64 * 1024


class ConnectionPhase(enum.Enum):
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


#: A frame the standby drops: the tail of a stream the standby abandoned,
#: sent before the active saw the resync request or Error. Never legal to send.
DROP: Final = _Drop.DROP

_A, _S = Role.ACTIVE, Role.STANDBY
_P, _V = ConnectionPhase, VpnState
State = ConnectionPhase | VpnState

#: (sender, frame type, state at the end applying it) -> next state. Both ends
#: use this one table: an end checks its own sends against it and the peer's
#: frames on receipt. VPN frames are looked up with the VPN's state, others
#: with the connection's phase. A connection-level Error is legal in any phase
#: before CLOSED and leads to CLOSED.
CONNECTION_TRANSITIONS: Final[Mapping[tuple[Role, type[Frame], State], State | _Drop]] = (
    MappingProxyType(
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
            # A reconcile repair goes in line with the live stream (version 5 on).
            (_A, Repair, _V.LIVE): _V.LIVE,
            # A repair in flight when the standby abandoned the stream, or asked
            # for a resync, is dropped: the state it was read against is gone.
            (_A, Repair, _V.DRAINING): DROP,
            (_A, Repair, _V.RESYNC_REQUESTED): DROP,
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
            # --- transactions (txn/local/_coordinator.py): independent of the event
            # stream, so legal in every state of a listed VPN and changing none.
            # The active asks the standby to prepare,
            **{(_A, TxnPrepare, state): state for state in VpnState},
            # the standby votes,
            **{(_S, TxnVote, state): state for state in VpnState},
            # the active tells how a transaction ended,
            **{(_A, TxnOutcome, state): state for state in VpnState},
            # and the standby asks about its prepared ones after a reconnect;
            **{(_S, TxnQuery, state): state for state in VpnState},
            # the active lets the standby commit early, ahead of the stream,
            **{(_A, TxnCommit, state): state for state in VpnState},
            # and the standby says whether it did.
            **{(_S, TxnApplied, state): state for state in VpnState},
        }
    )
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


_VpnFrame = (
    SyncRequest
    | SyncAccepted
    | Checkpoint
    | SyncFinished
    | Events
    | Ack
    | Error
    | TxnFrame
    | Repair
)


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
        version: int = PROTOCOL_VERSION,
        offered: int = OUR_CAPABILITIES,
    ) -> None:
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"this node cannot speak bridge protocol version {version}")
        #: the version this end speaks: the standby's choice, then the
        #: lower of the two ends' once the active's Hello has answered
        self.version = version
        #: the capability flags this end offers in its Hello
        self.offered = offered
        self._peer_offered = 0
        self.our_role = Role(our_role)
        self.their_role = Role.STANDBY if self.our_role is Role.ACTIVE else Role.ACTIVE
        self.our_site = our_site
        self.peer_site: str | None = None
        self.phase = ConnectionPhase.START
        # Bounded before trusted: until the peer's Hello is in, a frame
        # larger than a Hello can be is refused from its header alone.
        self._max_frame_size = max_frame_size
        self._reader = FrameReader(min(max_frame_size, PRE_HELLO_MAX_FRAME))
        self._epochs: dict[str, int] = dict(known_epochs or {})
        self._streams: dict[str, _Stream] = {}
        self._resources: dict[str, VpnResource] = {}
        self._eof = False
        self._failure: BridgeError | None = None

    # ------------------------------------------------------------ inspection

    @property
    def max_frame_size(self) -> int:
        """The largest frame this end takes (its own sends are checked
        against it too); before the peer's Hello, the reader takes at most
        :data:`PRE_HELLO_MAX_FRAME`."""
        return self._max_frame_size

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
            if self.phase is ConnectionPhase.CLOSED:
                return CLOSED
            if self.phase is ConnectionPhase.FAILED:
                raise RemoteProtocolError(f"the connection already failed: {self._failure}")
            try:
                frame = self._reader.next_frame()
                if frame is None:
                    return self._no_frame()
                accepted = self._process(self.their_role, frame, sending=False)
            except RemoteProtocolError as e:
                if e.closes_connection:
                    self._failure = e
                    self.phase = ConnectionPhase.FAILED
                raise
            if accepted is not None:
                return accepted

    def send(self, frame: Frame) -> bytes:
        """The bytes of ``frame``, if we may send it now."""
        data = self._for_peer(frame).encode(self.version)
        size = len(data) - FRAME_OVERHEAD
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
        self.phase = ConnectionPhase.CLOSED
        return CLOSED

    # ------------------------------------------------------------ transitions

    @staticmethod
    def _illegal(sending: bool, text: str, vpn: str = "") -> BridgeError:
        if sending:
            return LocalProtocolError(f"may not send {text}", vpn)
        return UnexpectedFrame(f"received {text}", vpn)

    def _process(self, sender: Role, frame: Frame, *, sending: bool) -> Frame | None:
        if self.phase is ConnectionPhase.CLOSED:
            raise LocalProtocolError("the connection is closed")
        if isinstance(frame, Error) and frame.closes_connection:
            self.phase = ConnectionPhase.CLOSED
            return frame
        if self.phase is ConnectionPhase.FAILED:
            raise LocalProtocolError("after a fault only a connection-level Error may be sent")
        if isinstance(frame, VPN_FRAMES):
            return self._process_vpn(sender, frame, sending=sending)
        if isinstance(frame, Hello):
            self._check_hello(frame, sending=sending)
        new = CONNECTION_TRANSITIONS.get((sender, type(frame), self.phase))
        if not isinstance(new, ConnectionPhase):
            what = f"{type(frame).__name__} from the {sender} in phase {self.phase.value}"
            raise self._illegal(sending, what)
        if isinstance(frame, ResourceList):
            self._relist(frame)
        if isinstance(frame, Hello) and not sending:
            self.peer_site = frame.site
            self._reader.max_frame_size = self._max_frame_size
        self.phase = new
        return frame

    def _check_hello(self, hello: Hello, *, sending: bool) -> None:
        if sending:
            ours = (self.our_site, self.our_role, self.version)
            if (hello.site, hello.role, hello.version) != ours:
                raise LocalProtocolError(f"may not send {hello}: this end is {ours}")
            if self.version >= 6:  # what this end offers is what it said
                self.offered = hello.capabilities
            return
        # The standby proposes its version; the active speaks it if it can and
        # answers with it, and the standby accepts no other answer.
        if hello.version not in SUPPORTED_VERSIONS or hello.version > self.version:
            raise VersionMismatch(
                f"peer {hello.site!r} speaks version {hello.version}, this node "
                f"{PREVIOUS_PROTOCOL_VERSION} to {self.version}"
            )
        if self.our_role is Role.STANDBY and hello.version != self.version:
            raise VersionMismatch(
                f"peer {hello.site!r} answered version {hello.version} to {self.version}"
            )
        self.version = hello.version
        self._peer_offered = hello.capabilities if hello.version >= 6 else 0
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
        new = CONNECTION_TRANSITIONS.get((sender, type(frame), stream.state))
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
        frame: SyncRequest
        | SyncAccepted
        | Checkpoint
        | SyncFinished
        | Events
        | Ack
        | TxnFrame
        | Repair,
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
        if isinstance(frame, (*TXN_FRAMES, Repair)):
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

    @property
    def capabilities(self) -> int:
        """The capabilities in use: those both ends offered (none before the
        peer's Hello, and none below version 6)."""
        return self.offered & self._peer_offered if self.version >= 6 else 0

    def our_hello(self) -> Hello:
        """The ``Hello`` this end sends (after the peer's, on the active)."""
        offered = self.offered if self.version >= 6 else 0
        return Hello(self.our_site, self.version, self.our_role, offered)

    def lacking(self) -> list[str]:
        """What this end offers that the connection cannot use (the peer's
        release lacks it), by name: for one log line per connection."""
        missing = self.offered & ~self.capabilities
        return [name for flag, name in CAPABILITIES.items() if missing & flag]

    def _for_peer(self, frame: Frame) -> Frame:
        """``frame`` as the peer reads it: the fields its declaration ties
        to a capability the connection lacks at their defaults (a prepare
        names no XA owner, a sync request no take-over point); and without
        the topology capability, each topology event becomes a no-op purge
        (module docstring); without the purge point capability, a purge
        says no purge point (an older standby purges as it always did)."""
        if not isinstance(frame, Events):
            return frame.for_peer(self.capabilities)
        lacking = ~self.capabilities & (CAP_TOPOLOGY | CAP_PURGE_POINT)
        if not lacking or not any(_for_older(e, lacking) is not e for e in frame.entries):
            return frame
        return replace(frame, entries=tuple(_for_older(e, lacking) for e in frame.entries))


def _for_older(entry: LedgerEntry, lacking: int) -> LedgerEntry:
    """``entry`` as a peer lacking the ``lacking`` capabilities reads it."""
    event = entry.event
    if isinstance(event, TopologyChanged) and lacking & CAP_TOPOLOGY:
        return LedgerEntry(entry.vpn, entry.epoch, entry.index, Purged(entry.vpn, ""))
    if isinstance(event, Purged) and event.sent_at and lacking & CAP_PURGE_POINT:
        return LedgerEntry(entry.vpn, entry.epoch, entry.index, event._replace(sent_at=0))
    return entry
