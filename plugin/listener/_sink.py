"""What the listener needs from replication: the :class:`ReplicationSink`.

The listener hands every event to a sink in the order it saw them on the
wire, so a consumption always follows its publish. The node plugs in the
replication core's implementation (``bridge.Replicator``, which runs local
transactions through ``txn``'s coordinator); :class:`MemorySink` is the
in-process implementation used by tests and the listener benchmark. The
interface is a :class:`typing.Protocol` owned here, so the listener never
imports the replication core.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from bridge import ConfirmKey, Event, LocalTransaction
from bridge.active import commit_in_task
from plugin.session import Output

__all__ = ["MemorySink", "ReplicationSink", "append_events"]


class ReplicationSink(Protocol):
    """Where the listener's events go.

    ``append``, ``prepare``, ``commit`` and ``abort`` are the interface;
    the other methods have defaults here, which a class that names this
    protocol as its base inherits (a structural implementation, such as
    the replication core's, provides its own).
    """

    def append(self, event: Event, on_durable: Callable[[bool], None] | None) -> None:
        """Take ``event`` in listener order.

        ``on_durable(ok)`` is called once the event is as durable as its VPN's
        mode requires; ``ok=False`` means the client's confirm must be a nack.
        It may be called before ``append`` returns.
        """
        ...

    def append_many(
        self,
        events: Sequence[tuple[Event, ConfirmKey | None]],
        on_durable: Callable[[ConfirmKey, bool], None],
    ) -> None:
        """Take several events in order, as :meth:`append` would one by one:
        ``on_durable(key, ok)`` once for each event that has a key.

        The listener hands over everything one read of a client produced at
        once; a sink that can take a batch cheaper than event by event
        overrides this (one callback for the batch instead of a closure per
        event).
        """
        for event, key in events:
            self.append(event, None if key is None else functools.partial(on_durable, key))

    def prepare(self, txn: LocalTransaction) -> Awaitable[None]:
        """Persist ``txn`` as prepared; the awaitable raises
        ``bridge.TransactionRefused`` if not (or the call itself does). An
        ``async def`` does; a sink may also start the work at the call, so
        it begins before the listener's task for the rest is scheduled."""
        ...

    async def commit(self, txn: LocalTransaction) -> None:
        """Persist the commit decision of a prepared ``txn`` and apply it."""
        ...

    def commit_soon(
        self, txn: LocalTransaction, done: Callable[[BaseException | None], None]
    ) -> None:
        """:meth:`commit`, reporting through ``done(error)`` (``None``:
        committed; ``bridge.TransactionRefused``: not recorded) instead of
        being awaited. A sink that learns the outcome in a callback of its
        own overrides this and calls ``done`` there, so the listener
        answers the client in that same callback, not one event-loop turn
        and a task wake-up later."""
        commit_in_task(self.commit(txn), done)

    async def abort(self, txn: LocalTransaction) -> None:
        """Forget a prepared ``txn`` whose broker commit did not happen."""
        ...

    async def resolve(self, txn: LocalTransaction) -> None:
        """``txn``'s tx.commit reached the broker but its commit-ok was never
        seen (the connection broke): settle it by its commit marker."""
        return None

    def next_index(self, vpn: str) -> int:
        """The ledger index the next event of ``vpn`` appended takes (0: the
        sink cannot say; a purge then removes what its own index says)."""
        return 0

    def full(self) -> bool:
        """True while the sink holds as many not-yet-durable events as it may;
        the listener then stops reading the client (TCP backpressure)."""
        return False

    async def wait_for_room(self) -> None:
        """Return once :meth:`full` is False again (at once for a sink that
        is never full)."""
        return None


def append_events(
    sink: ReplicationSink,
    vpn: str,
    out: Output,
    on_durable: Callable[[ConfirmKey, bool], None],
) -> None:
    """Hand ``out``'s events to ``sink`` (after its ``to_broker`` was
    written), filling each of its ledger marks with the index the VPN's
    next event took at the mark's place among them: the events before it
    are appended first, so the index is exact whatever the sink refuses."""
    events = out.events
    start = 0
    for before, mark in out.marks:
        if before > start:
            sink.append_many(events[start:before], on_durable)
            start = before
        mark.index = sink.next_index(vpn)
    if start < len(events):
        sink.append_many(events[start:] if start else events, on_durable)


@dataclass
class MemorySink(ReplicationSink):
    """Keeps events in memory and reports them durable at once."""

    events: list[Event] = field(default_factory=list)
    committed: list[LocalTransaction] = field(default_factory=list)
    prepared: list[LocalTransaction] = field(default_factory=list)
    aborted: list[LocalTransaction] = field(default_factory=list)

    def append(self, event: Event, on_durable: Callable[[bool], None] | None) -> None:
        self.events.append(event)
        if on_durable is not None:
            on_durable(True)

    def append_many(
        self,
        events: Sequence[tuple[Event, ConfirmKey | None]],
        on_durable: Callable[[ConfirmKey, bool], None],
    ) -> None:
        for event, key in events:
            self.events.append(event)
            if key is not None:
                on_durable(key, True)

    def next_index(self, vpn: str) -> int:
        """The events kept are numbered from 1, as one VPN's ledger."""
        return len(self.events) + 1

    async def prepare(self, txn: LocalTransaction) -> None:
        self.prepared.append(txn)

    async def commit(self, txn: LocalTransaction) -> None:
        self.committed.append(txn)
        self.events.extend(txn.events)

    async def abort(self, txn: LocalTransaction) -> None:
        self.aborted.append(txn)
