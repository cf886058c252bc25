"""The standby worker's view of a VPN's stream (bridge.standby._stream), without I/O.

The worker drops what is queued of a stream it left until the next stream
is accepted, makes a stream live only when it follows it, and asks for a
sync only when none is under way and the active was not refused for a
stale epoch that it still lists.
"""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from bridge import Consumed, LedgerEntry, ReplicationId
from bridge.standby import (
    STREAM_TRANSITIONS,
    StandbyStream,
    StreamInput,
    StreamPhase,
)
from bridge.wire import Checkpoint, Events, SyncAccepted, SyncFinished, TxnCommit

P, In = StreamPhase, StreamInput
VPN = "orders"
ACCEPTED = SyncAccepted(VPN, 1, 1)
FRAMES = [
    Events(VPN, 1, (LedgerEntry(VPN, 1, 1, Consumed(VPN, ReplicationId.from_parts(1, 1), "q")),)),
    Checkpoint(VPN, 1, 0, (), True),
    SyncFinished(VPN, 1, 0),
    TxnCommit(VPN, 1, "t1", 1),
]


def test_every_input_is_legal_in_every_phase() -> None:
    """The reader's and the worker's inputs interleave: none may raise."""
    assert set(STREAM_TRANSITIONS) == {(p, i) for p in StreamPhase for i in StreamInput}


def test_a_first_sync_goes_live() -> None:
    s = StandbyStream(VPN)
    assert s.wants_sync(1, 1) and not s.drops(FRAMES[0])
    s.requested()
    assert s.phase is P.REQUESTED and not s.wants_sync(1, 1)
    assert all(s.drops(f) for f in FRAMES) and not s.drops(ACCEPTED)
    s.acked, s.rows = 7, [object()]  # type: ignore[list-item]
    s.accepted()
    assert (s.phase, s.acked, s.rows) == (P.CATCHING_UP, 0, [])
    assert not any(s.drops(f) for f in FRAMES)
    assert s.finished() is True
    assert s.phase is P.LIVE and not s.wants_sync(1, 1)


def test_a_resync_drops_the_old_streams_tail_until_it_is_accepted() -> None:
    s = StandbyStream(VPN, phase=P.LIVE)
    s.requested()
    assert all(s.drops(f) for f in FRAMES)  # an old SyncFinished too: it makes nothing live
    s.accepted()
    assert s.phase is P.CATCHING_UP and not s.drops(FRAMES[0])


def test_an_abandoned_stream_is_dropped_and_a_relist_asks_again() -> None:
    s = StandbyStream(VPN, phase=P.LIVE)
    s.abandoned()
    assert s.phase is P.ABANDONED and all(s.drops(f) for f in FRAMES)
    assert s.wants_sync(1, 1)
    s.requested()
    s.accepted()
    assert s.phase is P.CATCHING_UP


def test_a_refused_stream_applies_what_it_queued_but_never_goes_live() -> None:
    s = StandbyStream(VPN, phase=P.CATCHING_UP)
    s.refused()
    assert s.phase is P.STOPPED
    assert not any(s.drops(f) for f in FRAMES)  # accepted before the refusal
    assert s.finished() is False
    assert s.wants_sync(1, 1)


def test_a_refused_request_drops_the_previous_streams_tail() -> None:
    s = StandbyStream(VPN, phase=P.LIVE)
    s.requested()
    s.refused()
    assert s.phase is P.ABANDONED and all(s.drops(f) for f in FRAMES)


@pytest.mark.parametrize("how", ["refused", "abandoned"])
def test_an_active_refused_for_a_stale_epoch_is_asked_again_only_at_a_current_one(
    how: str,
) -> None:
    s = StandbyStream(VPN, phase=P.LIVE)
    getattr(s, how)(stale_at=3)
    assert s.refused_at_epoch == 3
    assert not s.wants_sync(listed_epoch=2, known_epoch=3)
    assert s.wants_sync(listed_epoch=3, known_epoch=3)
    getattr(s, how)()  # a later refusal for another reason keeps what was learnt
    assert s.refused_at_epoch == 3


def test_a_checkpoint_is_taken_whole() -> None:
    s = StandbyStream(VPN, phase=P.CATCHING_UP)
    s.rows.extend(["a", "b"])  # type: ignore[list-item]
    assert s.take_checkpoint() == ["a", "b"] and s.rows == []


#: the worker's view as two facts, the way a sync under way and the
#: dropping of an old stream's tail are defined (module docstring)
FOLLOWING = {P.REQUESTED: True, P.CATCHING_UP: True, P.LIVE: True}
DROPPING = {P.REQUESTED: True, P.ABANDONED: True}


@given(st.lists(st.sampled_from(list(StreamInput)), max_size=40))
def test_the_phases_keep_the_two_facts_any_input_order_defines(
    inputs: list[StreamInput],
) -> None:
    """Whatever the order: a request means following and dropping; taking
    the answer ends the dropping; a refusal ends the following; giving the
    stream up ends the following and starts the dropping."""
    s = StandbyStream(VPN)
    following = dropping = False
    for what in inputs:
        s.feed(what)
        if what is In.REQUESTED:
            following = dropping = True
        elif what is In.ACCEPTED:
            dropping = False
        elif what is In.REFUSED:
            following = False
        elif what is In.ABANDONED:
            following, dropping = False, True
        assert FOLLOWING.get(s.phase, False) is following, inputs
        assert DROPPING.get(s.phase, False) is dropping, inputs
        assert s.following is following
