"""Where one VPN's stream stands at one end of a bridge connection, and the
checks a stream frame's data must pass against it.

Invariant: the standby accepts no event that does not extend exactly the
state it has. An ``Events`` batch must start at the stream's next index: one
starting past it raises :class:`~bridge.Gap` (the caller resyncs from its
last *applied* index), entries at or below the last received one are
duplicates and dropped. A replay that does not start from the standby's own
state (``SyncAccepted.from_index`` is not ``last_applied_index + 1``: the
standby is behind the retained ledger, or its history diverged) takes
nothing before a complete ``Checkpoint`` at ``from_index - 1``: no events,
no ``SyncFinished``, no ``Ack``. A position is replaced whole on every
change, so a frame that fails a check leaves no trace.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from bridge._errors import Gap, LocalProtocolError

from ._frames import (
    TXN_FRAMES,
    Ack,
    Checkpoint,
    Error,
    Events,
    Frame,
    Repair,
    SyncAccepted,
    SyncFinished,
    SyncRequest,
    TxnFrame,
)
from ._transitions import VpnState, refused

__all__ = ["Install", "StreamPosition", "VpnFrame", "advance"]


class Install(enum.Enum):
    """Where a catch-up stands with respect to a checkpoint."""

    REQUIRED = "required"  # from_index != last_applied + 1: nothing else until it is complete
    ALLOWED = "allowed"  # the replay follows the standby's state; a checkpoint may still come
    OPEN = "open"  # chunks arriving, the last one not yet
    DONE = "done"  # installed, or the replay began: no checkpoint any more


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """One VPN's stream as this end sees it."""

    state: VpnState = VpnState.LISTED
    request: SyncRequest | None = None  # the accepted request being answered or streamed
    from_index: int = 0
    through: int = 0  # highest index delivered on this stream
    acked: int = 0
    install: Install = Install.DONE


VpnFrame = (
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


def advance(
    frame: VpnFrame, stream: StreamPosition, *, sending: bool
) -> tuple[StreamPosition, Frame | None]:
    """Check ``frame`` against the stream's data (``stream.state`` is
    already the new state); the position after it, and the frame to hand
    the caller (None: all duplicates; fewer entries: some were)."""
    if isinstance(frame, SyncRequest):
        return replace(stream, request=frame), frame
    if isinstance(frame, SyncAccepted):
        return _accept(frame, stream, sending=sending), frame
    if isinstance(frame, Checkpoint):
        return _install(frame, stream, sending=sending), frame
    if isinstance(frame, Events):
        return _events(frame, stream, sending=sending)
    if isinstance(frame, SyncFinished):
        return _finish(frame, stream, sending=sending), frame
    if isinstance(frame, Ack):
        return _ack(frame, stream, sending=sending), frame
    if isinstance(frame, (*TXN_FRAMES, Repair)):
        return stream, frame
    return replace(stream, request=None), frame  # a VPN-level Error


def _accept(frame: SyncAccepted, stream: StreamPosition, *, sending: bool) -> StreamPosition:
    if stream.request is None:
        raise refused(sending, "SyncAccepted for a rejected request", frame.vpn)
    follows = frame.from_index == stream.request.last_applied_index + 1
    return replace(
        stream,
        from_index=frame.from_index,
        through=frame.from_index - 1,
        acked=0,
        install=Install.ALLOWED if follows else Install.REQUIRED,
    )


def _install(frame: Checkpoint, stream: StreamPosition, *, sending: bool) -> StreamPosition:
    if stream.install is Install.DONE:
        what = "a Checkpoint once the replay began or the checkpoint ended"
        raise refused(sending, what, frame.vpn)
    if frame.index != stream.from_index - 1:
        what = f"a Checkpoint at index {frame.index} for a replay from {stream.from_index}"
        raise refused(sending, what, frame.vpn)
    return replace(stream, install=Install.DONE if frame.last else Install.OPEN)


def _check_installed(
    frame: Events | SyncFinished | Ack, stream: StreamPosition, *, sending: bool
) -> None:
    if stream.install in (Install.REQUIRED, Install.OPEN):
        what = f"{type(frame).__name__} before the checkpoint is complete"
        raise refused(sending, what, frame.vpn)


def _events(
    frame: Events, stream: StreamPosition, *, sending: bool
) -> tuple[StreamPosition, Events | None]:
    _check_installed(frame, stream, sending=sending)
    first, expected = frame.entries[0].index, stream.through + 1
    if sending and first != expected:
        raise LocalProtocolError(f"Events from {first}, the stream is at {expected}", frame.vpn)
    if first > expected:
        raise Gap(
            f"Events from index {first}, expected {expected}",
            frame.vpn,
            expected=expected,
            got=first,
        )
    fresh = frame.entries[expected - first :]
    if not fresh:
        return stream, None  # all duplicates
    after = replace(stream, through=fresh[-1].index, install=Install.DONE)
    if len(fresh) == len(frame.entries):
        return after, frame
    return after, Events(frame.vpn, frame.epoch, fresh)


def _finish(frame: SyncFinished, stream: StreamPosition, *, sending: bool) -> StreamPosition:
    _check_installed(frame, stream, sending=sending)
    if frame.index != stream.through:
        what = f"SyncFinished at {frame.index}, the replay reached {stream.through}"
        raise refused(sending, what, frame.vpn)
    return replace(stream, install=Install.DONE)


def _ack(frame: Ack, stream: StreamPosition, *, sending: bool) -> StreamPosition:
    _check_installed(frame, stream, sending=sending)
    if not stream.acked <= frame.index <= stream.through:
        what = f"Ack of {frame.index}, outside {stream.acked}..{stream.through}"
        raise refused(sending, what, frame.vpn)
    return replace(stream, acked=frame.index)
