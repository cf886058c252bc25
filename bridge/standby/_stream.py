"""One VPN's stream as the standby's apply worker sees it (sans-IO).

The standby reads frames on one task and applies each VPN's in a worker, so
the worker lags the connection: frames of an old stream may sit in its
queue after it asked for a resync, though :class:`~bridge.BridgeConnection`
accepted them. :class:`StandbyStream` holds the worker's view, every change
in one table (:data:`STREAM_TRANSITIONS`). Invariant: the worker applies
nothing of a stream it no longer follows: after a ``SyncRequest`` or an
``Error`` it sent, every queued frame is dropped until the ``SyncAccepted``
that starts the next stream (:meth:`StandbyStream.drops`); a sync is
requested only when none is under way and the active is not one refused for
a stale epoch still listing it at that epoch (:meth:`StandbyStream.wants_sync`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Final

from bridge._errors import BridgeError
from bridge.wire import CheckpointRow, SyncAccepted

__all__ = [
    "STREAM_TRANSITIONS",
    "StreamInput",
    "StreamPhase",
    "StandbyStream",
]


class StreamPhase(enum.Enum):
    IDLE = "idle"  # listed, no sync requested
    REQUESTED = "requested"  # a SyncRequest is out: earlier frames are dropped until its answer
    CATCHING_UP = "catching-up"  # SyncAccepted taken: checkpoint and replay until SyncFinished
    LIVE = "live"  # SyncFinished taken: real-time events
    #: the active refused the sync, or a frame of it was refused (stale
    #: epoch): what is queued still applies, nothing makes it live again,
    #: a relist may ask anew
    STOPPED = "stopped"
    #: this side gave the stream up (an apply failure, a stale epoch):
    #: everything queued is dropped until a new SyncAccepted
    ABANDONED = "abandoned"


class StreamInput(enum.Enum):
    REQUESTED = "requested"  # the worker sent a SyncRequest
    ACCEPTED = "accepted"  # the worker took the SyncAccepted answering it
    FINISHED = "finished"  # the worker took SyncFinished
    REFUSED = "refused"  # the reader: the active refused the sync, or a frame was refused
    ABANDONED = "abandoned"  # the worker gave the stream up and told the active


_P, _I = StreamPhase, StreamInput

#: (phase, input) -> next phase, for every pair: each input is legal in
#: every phase, because the reader's and the worker's inputs interleave.
STREAM_TRANSITIONS: Final[dict[tuple[StreamPhase, StreamInput], StreamPhase]] = {
    # A request (first sync, resync after a gap, after a relist) starts a
    # new stream whatever the old one was doing.
    **{(phase, _I.REQUESTED): _P.REQUESTED for phase in StreamPhase},
    # The worker gives a stream up from any phase; the active is told.
    **{(phase, _I.ABANDONED): _P.ABANDONED for phase in StreamPhase},
    # The answer to our request: the checkpoint and replay follow.
    (_P.REQUESTED, _I.ACCEPTED): _P.CATCHING_UP,
    # A SyncAccepted queued behind a give-up: it ends the dropping, the
    # stream it starts is not ours to make live.
    (_P.ABANDONED, _I.ACCEPTED): _P.STOPPED,
    # The protocol answers a request only once; these change nothing.
    (_P.IDLE, _I.ACCEPTED): _P.IDLE,
    (_P.CATCHING_UP, _I.ACCEPTED): _P.CATCHING_UP,
    (_P.LIVE, _I.ACCEPTED): _P.LIVE,
    (_P.STOPPED, _I.ACCEPTED): _P.STOPPED,
    # The end of the replay of a stream we follow: real time.
    (_P.CATCHING_UP, _I.FINISHED): _P.LIVE,
    # The end of a replay refused meanwhile, or one not ours: ignored.
    (_P.IDLE, _I.FINISHED): _P.IDLE,
    (_P.LIVE, _I.FINISHED): _P.LIVE,
    (_P.STOPPED, _I.FINISHED): _P.STOPPED,
    # Dropped before the worker takes them (see ``drops``).
    (_P.REQUESTED, _I.FINISHED): _P.REQUESTED,
    (_P.ABANDONED, _I.FINISHED): _P.ABANDONED,
    # A refusal ends a stream under way; what the worker has queued of it
    # still applies (it was accepted before the refusal) ...
    (_P.CATCHING_UP, _I.REFUSED): _P.STOPPED,
    (_P.LIVE, _I.REFUSED): _P.STOPPED,
    # ... but a refused request leaves the old stream's tail to be dropped.
    (_P.REQUESTED, _I.REFUSED): _P.ABANDONED,
    # Nothing under way: nothing changes.
    (_P.IDLE, _I.REFUSED): _P.IDLE,
    (_P.STOPPED, _I.REFUSED): _P.STOPPED,
    (_P.ABANDONED, _I.REFUSED): _P.ABANDONED,
}

_FOLLOWING: Final = frozenset({_P.REQUESTED, _P.CATCHING_UP, _P.LIVE})
_DROPPING: Final = frozenset({_P.REQUESTED, _P.ABANDONED})


class StreamError(BridgeError):
    """An input the table has no transition for (a bug)."""


@dataclass(eq=False)
class StandbyStream:
    """One VPN's stream on the standby, as its apply worker sees it."""

    vpn: str
    phase: StreamPhase = StreamPhase.IDLE
    #: the epoch this site knew when the active was refused for a stale one
    #: (0: never): its listings at a lower epoch ask for no sync
    refused_at_epoch: int = 0
    #: the highest index acknowledged on this stream
    acked: int = 0
    #: the last index of the group last committed early (ahead of the stream)
    early: int = 0
    #: the chunks of a checkpoint being received, installed at its last one
    rows: list[CheckpointRow] = field(default_factory=list)

    def feed(self, what: StreamInput) -> StreamPhase:
        after = STREAM_TRANSITIONS.get((self.phase, what))
        if after is None:  # pragma: no cover - the table covers every pair
            raise StreamError(f"VPN {self.vpn}: {what.value} in phase {self.phase.value}")
        self.phase = after
        return after

    @property
    def following(self) -> bool:
        """A sync is under way or live: no new request is needed."""
        return self.phase in _FOLLOWING

    def drops(self, item: object) -> bool:
        """Whether the worker drops ``item``: the tail of a stream this side
        left, queued before it left it (anything but the SyncAccepted that
        starts the next stream)."""
        return self.phase in _DROPPING and not isinstance(item, SyncAccepted)

    def wants_sync(self, listed_epoch: int, known_epoch: int) -> bool:
        """Whether a listing of the VPN at ``listed_epoch`` should start a
        sync: none is under way, and the active was not refused for a stale
        epoch while it still lists one below what this site knows."""
        if self.following:
            return False
        return not (self.refused_at_epoch and listed_epoch < known_epoch)

    def requested(self) -> None:
        self.feed(StreamInput.REQUESTED)

    def accepted(self) -> None:
        """The next stream starts: nothing of the previous one counts."""
        self.feed(StreamInput.ACCEPTED)
        self.acked, self.rows = 0, []

    def finished(self) -> bool:
        """SyncFinished taken; True when it ends the replay of a stream we
        follow (the VPN is live, and its in-doubt transactions can be asked)."""
        following = self.following
        self.feed(StreamInput.FINISHED)
        return following

    def refused(self, stale_at: int | None = None) -> None:
        """The active refused the sync or a frame of it; ``stale_at``: the
        epoch this site knows, when the refusal was for a stale epoch."""
        self.feed(StreamInput.REFUSED)
        if stale_at is not None:
            self.refused_at_epoch = stale_at

    def abandoned(self, stale_at: int | None = None) -> None:
        """This side gave the stream up; ``stale_at`` as for :meth:`refused`."""
        self.feed(StreamInput.ABANDONED)
        if stale_at is not None:
            self.refused_at_epoch = stale_at

    def take_checkpoint(self) -> list[CheckpointRow]:
        """A checkpoint's last chunk came: its rows, to install."""
        rows, self.rows = self.rows, []
        return rows
