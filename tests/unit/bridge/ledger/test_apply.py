"""Internals, tested beside their module."""

from __future__ import annotations

from bridge import (
    IdSource,
    LedgerEntry,
    Purged,
    Role,
)
from bridge.ledger._apply import _PURGE, _apply_steps
from plugin.listener import MemorySink, append_events
from plugin.session import Output, Session
from plugin.topology import ReplicationScope, Topology, VpnDirectory, VpnView
from tests.unit.plugin.session.test_session import C, m, open_session, publish


def test_a_purge_keeps_on_the_standby_what_was_published_after_its_request_went_out() -> None:
    """The nowait purge race, built step by step. Connection P purges q
    (nowait: the listener makes it synchronous); the broker carries it out;
    connection X then publishes M2, which the broker keeps, and whose event
    enters the ledger before the purge-ok comes back to P. The Purged event
    says which ledger index P's request went out at, and the apply step of
    both sites removes only the messages published below it: M1, never M2
    (a message in between would stay as an extra copy, not be lost)."""
    directory = VpnDirectory()
    topology = Topology("orders")
    topology.declare_queue("q", {})
    directory.put(VpnView("orders", Role.ACTIVE, ReplicationScope((r"q",)), topology))
    p, x = Session(directory, IdSource(1)), Session(directory, IdSource(2))
    for s in (p, x):
        open_session(s)
    x.client_data(m(C.Confirm.Select(), 1))
    x.broker_data(m(C.Confirm.SelectOk(), 1))
    sink = MemorySink()

    def hand_over(out: Output) -> None:  # what the listener does with an output
        append_events(sink, "orders", out, lambda key, ok: None)

    hand_over(x.client_data(publish(1, b"M1")))  # index 1: purged at the broker
    hand_over(p.client_data(m(C.Queue.Purge(queue="q", nowait=True), 1)))
    hand_over(x.client_data(publish(1, b"M2")))  # index 2: the broker purged before it
    hand_over(p.broker_data(m(C.Queue.PurgeOk(message_count=1), 1)))  # index 3
    m1, m2, purged = sink.events
    assert isinstance(purged, Purged) and purged.sent_at == 2
    entries = [LedgerEntry("orders", 1, i, e) for i, e in enumerate(sink.events, start=1)]
    assert _purge_bound(entries) == 2  # publish_index < 2: M1 goes, M2 stays
    assert (m1.body, m2.body) == (b"M1", b"M2")


def _purge_bound(entries: list[LedgerEntry]) -> int:
    """The publish index below which the apply step's purge statement
    removes the queue's rows (the step run without a database)."""
    steps = _apply_steps("orders", entries, keep_topology=True)
    answer: object = None
    bound = None
    try:
        while True:
            step = steps.send(answer)
            if step.sql == _PURGE:
                bound = step.params[2]
            answer = [] if step.returning else 0
    except StopIteration:
        pass
    assert bound is not None
    return int(bound)
