"""One end of a bridge connection, without I/O: bytes in, frames out.

Invariant: a :class:`BridgeConnection` never hands its caller bytes that
were not sent as they are (every frame is length-prefixed and checksummed,
its length checked against the limit from the header alone, before
anything is buffered), a frame the table :data:`CONNECTION_TRANSITIONS`
does not allow in the connection's state (:mod:`bridge.wire._transitions`),
an event that does not extend the stream exactly
(:mod:`bridge.wire._position`), or a VPN frame whose epoch is below the
highest this connection has seen for the VPN: another site was promoted
and the sender is fenced (:class:`~bridge.StaleEpoch` on receipt,
:class:`~bridge.Fenced` on send). The conversation, versions and
capabilities: docs/behaviour.md, "The bridge between sites".
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import replace
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
    VPN_FRAMES,
    Ack,
    Checkpoint,
    Error,
    Events,
    Frame,
    FrameReader,
    Hello,
    Repair,
    ResourceList,
    SyncAccepted,
    SyncFinished,
    SyncRequest,
    TxnFrame,
    VpnResource,
)
from ._position import StreamPosition, VpnFrame, advance
from ._transitions import CONNECTION_TRANSITIONS, DROP, ConnectionPhase, VpnState, refused

__all__ = [
    "PRE_HELLO_MAX_FRAME",
    "CLOSED",
    "NEED_DATA",
    "BridgeConnection",
    "Sentinel",
]


#: the largest frame read before the peer's Hello (a Hello is a few hundred
#: bytes; an Error a few KiB): a stranger cannot make this end buffer more
PRE_HELLO_MAX_FRAME: Final = 64 * 1024


class Sentinel(enum.Enum):
    """What :meth:`BridgeConnection.next_event` returns instead of a frame."""

    NEED_DATA = "need data"
    CLOSED = "closed"


#: :meth:`BridgeConnection.next_event`: no whole frame buffered; receive more.
NEED_DATA: Final = Sentinel.NEED_DATA
#: :meth:`BridgeConnection.next_event`: the conversation is over.
CLOSED: Final = Sentinel.CLOSED


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
        self._streams: dict[str, StreamPosition] = {}
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
            raise refused(sending, what)
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
        streams: dict[str, StreamPosition] = {}
        for vpn in listing.vpns:
            streams[vpn.name] = self._streams.get(vpn.name) or StreamPosition()
            self._epochs[vpn.name] = max(self.known_epoch(vpn.name), vpn.epoch)
        self._streams = streams
        self._resources = {vpn.name: vpn for vpn in listing.vpns}

    def _process_vpn(self, sender: Role, frame: VpnFrame, *, sending: bool) -> Frame | None:
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
            raise refused(sending, f"{name} in state {stream.state.value}", frame.vpn)
        if not isinstance(frame, Error):
            self._check_epoch(frame, new, sending=sending)
        if new is not stream.state:  # most frames keep the state: no copy for them
            stream = replace(stream, state=new)
        try:
            after, accepted = advance(frame, stream, sending=sending)
        except Gap:  # the rest of the stream is dropped until a resync
            self._streams[frame.vpn] = replace(stream, state=VpnState.DRAINING)
            raise
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
