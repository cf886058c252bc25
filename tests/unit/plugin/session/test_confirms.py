"""Held publisher confirms (``plugin.session._confirms``), without a session or servers.

The client's view is modelled as AMQP defines it: a confirm with
``multiple`` settles every outstanding tag up to its own. Every frame the
tracker releases must settle only tags that are outstanding, ready and of
its own verdict; once the broker and the sink have answered everything,
nothing is outstanding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings, strategies as st
from pamqp import commands, frame

from bridge import ConfirmKey, Consumed, Event, Published, ReplicationId
from plugin.session import HeldConfirms

CHANNEL = 3


def published(seq: int, queues: tuple[str, ...] = ("q",)) -> Published:
    return Published(
        vpn="orders",
        repl_id=ReplicationId.from_parts(1, seq),
        exchange="",
        routing_key="q",
        properties=b"",
        body=b"x",
        queues=queues,
    )


@dataclass
class Client:
    """What the client has been told, and everything the tracker released."""

    tracker: HeldConfirms = field(default_factory=lambda: HeldConfirms(CHANNEL))
    frames: list[tuple[str, int, bool]] = field(default_factory=list)
    events: list[object] = field(default_factory=list)

    def release(self, changed: list[int]) -> list[tuple[str, int, bool]]:
        out: list[bytes] = []
        events: list[tuple[Event, ConfirmKey | None]] = []
        self.tracker.release(changed, out, events)
        self.events.extend(event for event, _ in events)
        made = []
        for data in out:
            consumed, channel, method = frame.unmarshal(data)
            assert consumed == len(data) and channel == CHANNEL
            assert isinstance(method, commands.Basic.Ack | commands.Basic.Nack)
            made.append((type(method).__name__, method.delivery_tag, method.multiple))
        self.frames.extend(made)
        return made

    def broker(
        self, tag: int, ok: bool = True, multiple: bool = False
    ) -> list[tuple[str, int, bool]]:
        return self.release(self.tracker.broker_answered(tag, multiple, ok))

    def sink(self, seq: int, ok: bool = True) -> list[tuple[str, int, bool]]:
        return self.release([seq] if self.tracker.sink_answered(seq, ok) else [])


def holding(replicated: list[bool]) -> Client:
    client = Client()
    for flag in replicated:
        seq = client.tracker.hold()
        if flag:
            client.tracker.replicated(seq, published(seq))
    return client


def test_an_unreplicated_publish_is_released_when_the_broker_answers() -> None:
    client = holding([False])
    assert client.broker(1) == [("Ack", 1, False)]
    assert client.tracker.pending == {}


def test_a_replicated_publish_waits_for_the_broker_and_the_sink() -> None:
    client = holding([True])
    assert client.broker(1) == []
    assert client.sink(1) == [("Ack", 1, False)]
    client = holding([True])
    assert client.sink(1) == []  # the sink first: still held for the broker
    assert client.broker(1) == [("Ack", 1, False)]


def test_a_ready_front_is_released_as_one_multiple_ack() -> None:
    client = holding([True, True, True])
    for seq in (1, 2, 3):
        assert client.sink(seq) == []  # the broker has not answered
    assert client.broker(3, multiple=True) == [("Ack", 3, True)]


def test_a_multiple_run_never_spans_a_held_tag() -> None:
    client = holding([False, True, False, False])
    assert client.broker(4, multiple=True) == [
        ("Ack", 1, False),
        ("Ack", 3, False),
        ("Ack", 4, False),
    ]
    assert client.sink(2) == [("Ack", 2, False)]


def test_a_run_is_cut_where_the_verdict_changes() -> None:
    client = holding([True, True, True, True])
    for seq, ok in ((1, True), (2, True), (3, False), (4, True)):
        client.sink(seq, ok)
    assert client.broker(4, multiple=True) == [
        ("Ack", 2, True),
        ("Nack", 3, False),
        ("Ack", 4, False),
    ]


def test_readiness_out_of_order_releases_each_tag_once() -> None:
    client = holding([True, True, True, True])
    client.broker(4, multiple=True)
    assert client.sink(3) == [("Ack", 3, False)]  # behind held tags: alone
    assert client.sink(4) == [("Ack", 4, False)]
    assert client.sink(1) == [("Ack", 1, False)]  # 2 still held: no multiple over it
    assert client.sink(2) == [("Ack", 2, False)]
    assert [tag for _, tag, _ in client.frames] == [3, 4, 1, 2]
    assert client.tracker.pending == {}
    assert client.sink(2) == [] and client.broker(2) == []  # released: never again


def test_a_broker_nack_is_a_nack_and_takes_a_replicated_publish_back() -> None:
    client = Client()
    seq = client.tracker.hold()
    client.tracker.replicated(seq, published(seq, queues=("q", "r")))
    client.tracker.hold()  # not replicated
    assert client.broker(2, ok=False, multiple=True) == [("Nack", 2, False)]  # 1 is held
    assert client.sink(1) == [("Nack", 1, False)]
    rid = ReplicationId.from_parts(1, 1)
    assert client.events == [Consumed("orders", rid, "q"), Consumed("orders", rid, "r")]


def test_a_sink_failure_is_a_nack_and_takes_nothing_back() -> None:
    client = holding([True])
    client.broker(1)
    assert client.sink(1, ok=False) == [("Nack", 1, False)]
    assert client.events == []


def test_numbering_without_holding_keeps_the_sequence() -> None:
    tracker = HeldConfirms(CHANNEL)
    assert [tracker.number(), tracker.hold(), tracker.number()] == [1, 2, 3]
    assert list(tracker.pending) == [2]


@pytest.mark.parametrize("multiple", [False, True])
def test_a_tag_the_tracker_does_not_hold_changes_nothing(multiple: bool) -> None:
    client = holding([True])
    assert client.tracker.broker_answered(7, multiple, True) == ([1] if multiple else [])


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[bool], list[tuple[str, int, bool, bool]]]:
    """Publishes (replicated or not) and the broker's and the sink's answers
    in a random order: each publish answered once by the broker (alone or
    within a ``multiple``) and, if replicated, once by the sink."""
    replicated = draw(st.lists(st.booleans(), min_size=1, max_size=12))
    unanswered = set(range(1, len(replicated) + 1))
    sink_due = {seq for seq, flag in enumerate(replicated, 1) if flag}
    steps: list[tuple[str, int, bool, bool]] = []
    while unanswered or sink_due:
        choices = []
        if unanswered:
            choices.append("broker")
        if sink_due:
            choices.append("sink")
        kind = draw(st.sampled_from(choices))
        if kind == "broker":
            tag = draw(st.sampled_from(sorted(unanswered)))
            multiple = draw(st.booleans())
            ok = draw(st.booleans())
            unanswered -= {t for t in unanswered if t <= tag} if multiple else {tag}
            steps.append(("broker", tag, ok, multiple))
        else:
            seq = draw(st.sampled_from(sorted(sink_due)))
            sink_due.discard(seq)
            steps.append(("sink", seq, draw(st.booleans()), False))
    return replicated, steps


@settings(max_examples=300, deadline=None)
@given(histories())
def test_every_tag_is_released_once_ready_and_never_past_a_held_one(
    history: tuple[list[bool], list[tuple[str, int, bool, bool]]],
) -> None:
    replicated, steps = history
    client = holding(replicated)
    broker: dict[int, bool] = {}
    sink: dict[int, bool] = {}
    outstanding = set(range(1, len(replicated) + 1))
    for kind, tag, ok, multiple in steps:
        if kind == "broker":
            for t in [
                t for t in outstanding if t not in broker and (t <= tag if multiple else t == tag)
            ]:
                broker[t] = ok
            made = client.broker(tag, ok, multiple)
        else:
            sink[tag] = ok
            made = client.sink(tag, ok)
        for verdict, released, run in made:
            settled = {t for t in outstanding if t <= released} if run else {released}
            assert released in outstanding  # never a tag released already
            for t in settled:
                assert t in broker and (not replicated[t - 1] or t in sink)  # ready: never held
                expected = broker[t] and (not replicated[t - 1] or sink[t])
                assert verdict == ("Ack" if expected else "Nack")
            outstanding -= settled
    assert outstanding == set()
    assert client.tracker.pending == {}
    taken_back = {e.repl_id for e in client.events if isinstance(e, Consumed)}
    nacked = {t for t, ok in broker.items() if not ok and replicated[t - 1]}
    assert taken_back == {ReplicationId.from_parts(1, t) for t in nacked}
