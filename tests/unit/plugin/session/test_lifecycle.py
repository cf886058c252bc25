"""The connection lifecycle's transition table (``plugin.session._lifecycle``), alone.

A client must never make the listener raise: every trigger the session can
produce while reading a side is in the table for every state that side's
handlers may meet, including states reached earlier in the same read (a
close-ok followed by more frames) and the close handshake's reader once the
session has closed the connection itself.
"""

from __future__ import annotations

import pytest

from plugin.session import (
    BROKER_DONE,
    BROKER_READS,
    CLIENT_DONE,
    CLIENT_READS,
    CLOSING,
    LIFECYCLE_TRANSITIONS,
    UPSTREAM_ON_FAULT,
    WE_CLOSED,
    BrokerReads,
    ClientReads,
    Lifecycle,
    LifecycleError,
    Trigger,
    Upstream,
    advance,
)

L, T = Lifecycle, Trigger

#: what each way of reading the client's bytes can report (FAULT only while
#: the session has not closed the connection itself: it returns before)
CLIENT_TRIGGERS = {
    ClientReads.HEADER: {T.HEADER, T.BAD_HEADER},
    ClientReads.TRACKED: {
        T.CLIENT_CLOSE,
        T.CLIENT_CLOSE_ASTRAY,
        T.CLIENT_CLOSE_OK,
        T.FAULT,
        T.FRAMING_FAULT,
    },
    ClientReads.CHECKED: {T.CLIENT_CLOSE, T.FAULT, T.FRAMING_FAULT},
    ClientReads.CLOSE_HANDSHAKE: {T.CLIENT_CLOSE, T.CLIENT_CLOSE_OK},
    ClientReads.SCAN: {T.CLIENT_CLOSE_OK},
    ClientReads.NOTHING: set(),
}
#: the same for the broker; open-ok comes once, during the handshake
BROKER_TRIGGERS = {
    BrokerReads.TRACKED: {T.BROKER_CLOSE, T.BROKER_CLOSE_OK, T.FAULT},
    BrokerReads.CLOSE_HANDSHAKE: {T.BROKER_CLOSE, T.BROKER_CLOSE_OK},
    BrokerReads.RAW: set(),
    BrokerReads.NOTHING: set(),
}
#: held client frames (channel frames) replayed while a broker read is handled
REPLAYED = {T.CLIENT_CLOSE_ASTRAY, T.CLIENT_CLOSE_OK, T.FAULT}


def _one_read(
    start: Lifecycle, reads: set[Trigger], closing: set[Trigger]
) -> dict[Lifecycle, set[Trigger]]:
    """The states the handlers of one read starting in ``start`` may meet,
    each with the triggers they may report there: ``reads`` until the
    session closed the connection, ``closing`` after. A framing fault ends
    the read (nothing after it has frame boundaries)."""
    met: dict[Lifecycle, set[Trigger]] = {}
    todo = [start]
    while todo:
        state = todo.pop()
        if state in met:
            continue
        triggers = closing if state in WE_CLOSED else reads
        if state in WE_CLOSED:
            triggers = triggers - {T.FAULT, T.FRAMING_FAULT}  # the session returns before
        met[state] = triggers
        for trigger in triggers - {T.FRAMING_FAULT}:
            nxt = LIFECYCLE_TRANSITIONS.get((state, trigger))
            if nxt is not None:
                todo.append(nxt)
    return met


def _client_reads(state: Lifecycle) -> set[Trigger]:
    return CLIENT_TRIGGERS[CLIENT_READS[state]]


@pytest.mark.parametrize("start", list(Lifecycle))
def test_whatever_a_client_sends_has_a_transition(start: Lifecycle) -> None:
    closing = CLIENT_TRIGGERS[ClientReads.CLOSE_HANDSHAKE]
    starts = [start]
    if CLIENT_READS[start] is ClientReads.SCAN:  # no frames: the close-ok, or nothing
        assert (start, T.CLIENT_CLOSE_OK) in LIFECYCLE_TRANSITIONS
        return
    if CLIENT_READS[start] is ClientReads.HEADER:  # the rest of the read is frames
        for trigger in (T.HEADER, T.BAD_HEADER):
            assert (start, trigger) in LIFECYCLE_TRANSITIONS
        starts = [LIFECYCLE_TRANSITIONS[start, T.HEADER]]
    for first in starts:
        for state, triggers in _one_read(first, _client_reads(first), closing).items():
            missing = {t for t in triggers if (state, t) not in LIFECYCLE_TRANSITIONS}
            assert missing == set(), (start, state)


@pytest.mark.parametrize("start", list(Lifecycle))
def test_whatever_the_broker_sends_has_a_transition(start: Lifecycle) -> None:
    reads = BROKER_TRIGGERS[BROKER_READS[start]]
    if start is L.AWAITING_HEADER or not reads:
        return  # the broker has been sent nothing yet
    closing = BROKER_TRIGGERS[BrokerReads.CLOSE_HANDSHAKE]
    for state, triggers in _one_read(start, reads | REPLAYED, closing | REPLAYED).items():
        missing = {t for t in triggers if (state, t) not in LIFECYCLE_TRANSITIONS}
        if state in WE_CLOSED:
            missing -= REPLAYED  # a replayed frame meets the close handshake's reader
        assert missing == set(), (start, state)


@pytest.mark.parametrize("state", [L.HANDSHAKE, L.HANDSHAKE_CLOSING, L.CLIENT_DONE])
def test_open_ok_is_expected_while_the_handshake_may_be_answered(state: Lifecycle) -> None:
    for trigger in (T.OPENED, T.OPENED_PASSTHROUGH):
        advance(state, trigger)


def test_every_state_says_how_each_side_is_read_and_what_a_fault_sends() -> None:
    for state in Lifecycle:
        assert state in CLIENT_READS and state in BROKER_READS
        assert (state in WE_CLOSED) != (state in UPSTREAM_ON_FAULT), state
        assert (state, T.LOST) in LIFECYCLE_TRANSITIONS
    assert CLIENT_DONE <= CLOSING and WE_CLOSED <= CLOSING


def test_an_illegal_transition_raises() -> None:
    with pytest.raises(LifecycleError, match="OPENED is not allowed in OPEN"):
        advance(L.OPEN, T.OPENED)
    with pytest.raises(LifecycleError):
        advance(L.AWAITING_HEADER, T.BROKER_CLOSE)


def _walk(*triggers: Trigger) -> Lifecycle:
    state = L.AWAITING_HEADER
    for trigger in triggers:
        state = advance(state, trigger)
    return state


def test_a_close_either_side_starts_ends_when_both_are_done() -> None:
    opened = (T.HEADER, T.OPENED)
    by_client = _walk(*opened, T.CLIENT_CLOSE, T.BROKER_CLOSE_OK)
    assert by_client is L.BROKER_DONE and by_client in BROKER_DONE and by_client in CLOSING
    assert _walk(*opened, T.CLIENT_CLOSE, T.BROKER_CLOSE_OK, T.CLIENT_CLOSE_OK) is L.CLOSED
    by_broker = _walk(*opened, T.BROKER_CLOSE, T.CLIENT_CLOSE_OK)
    assert by_broker is L.CLIENT_DONE and by_broker in CLIENT_DONE
    at_once = (T.CLIENT_CLOSE, T.BROKER_CLOSE, T.CLIENT_CLOSE_OK, T.BROKER_CLOSE_OK)
    assert _walk(*opened, *at_once) is L.CLOSED


@pytest.mark.parametrize(
    ("before", "upstream"),
    [
        ((), Upstream.DROP),
        ((T.HEADER,), Upstream.DROP),
        ((T.HEADER, T.BROKER_CLOSE), Upstream.DROP),
        ((T.HEADER, T.OPENED), Upstream.CLOSE),
        ((T.HEADER, T.OPENED_PASSTHROUGH), Upstream.CLOSE),
        ((T.HEADER, T.OPENED, T.BROKER_CLOSE), Upstream.CLOSE),
        ((T.HEADER, T.OPENED, T.CLIENT_CLOSE), Upstream.NOTHING),
        ((T.HEADER, T.OPENED_PASSTHROUGH, T.CLIENT_CLOSE), Upstream.NOTHING),
        ((T.HEADER, T.OPENED, T.CLIENT_CLOSE, T.BROKER_CLOSE_OK), Upstream.NOTHING),
    ],
)
def test_our_close_goes_upstream_only_where_an_amqp_close_is_due(
    before: tuple[Trigger, ...], upstream: Upstream
) -> None:
    state = _walk(*before)
    assert UPSTREAM_ON_FAULT[state] is upstream
    closed = advance(state, T.FAULT)
    assert closed in WE_CLOSED
    assert (closed in BROKER_DONE) == (upstream is Upstream.DROP or state in BROKER_DONE)


def test_our_close_ends_when_both_sides_answered() -> None:
    state = _walk(T.HEADER, T.OPENED, T.FAULT, T.BROKER_CLOSE_OK, T.CLIENT_CLOSE)
    assert state is L.CLOSED_BY_US_DONE and state in CLIENT_DONE and state in BROKER_DONE
    desynced = _walk(T.HEADER, T.OPENED, T.FRAMING_FAULT)
    assert CLIENT_READS[desynced] is ClientReads.SCAN
    assert _walk(T.HEADER, T.OPENED, T.FRAMING_FAULT, T.CLIENT_CLOSE_OK, T.BROKER_CLOSE) is (
        L.CLOSED_BY_US_DONE
    )
