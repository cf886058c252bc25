"""The bridge connection's states and its transition table: everything that
affects the state machine lives here; :mod:`bridge.wire._protocol` only
drives it. The conversation the table allows is in docs/behaviour.md,
"The bridge between sites".

An ``Error`` frame with an empty ``vpn`` ends the connection. One with a
VPN ends that VPN's stream only: the active sends one solely to refuse a
``SyncRequest``; the standby sends one to abandon a stream (a stale epoch,
an apply failure). To stop streaming a VPN for another reason the active
sends a ``ResourceList`` without it. So every VPN-level race resolves
without correlation ids: frames of a stream the standby abandoned that
were already in flight are recognised by state and dropped (:data:`DROP`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from bridge._errors import BridgeError, LocalProtocolError, UnexpectedFrame
from bridge._settings import Role

from ._frames import (
    Ack,
    Checkpoint,
    Error,
    Events,
    Frame,
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
    TxnOutcome,
    TxnPrepare,
    TxnQuery,
    TxnVote,
)

__all__ = ["CONNECTION_TRANSITIONS", "DROP", "ConnectionPhase", "State", "VpnState", "refused"]


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


def refused(sending: bool, text: str, vpn: str = "") -> BridgeError:
    """The error for a frame the table or a check refuses: this end's own
    mistake when it sends it, the peer's when it is received."""
    if sending:
        return LocalProtocolError(f"may not send {text}", vpn)
    return UnexpectedFrame(f"received {text}", vpn)
