"""One AMQP channel of a client connection through the listener.

:class:`Channel` holds what the listener must remember per channel and the
operations on it: the publish whose content is on its way, the confirms it
holds (:class:`~plugin._confirms.ConfirmTracker`), the consumers and gets
whose deliveries it maps to replication ids, the deliveries not settled yet,
the transaction buffer, and the topology requests awaiting the broker's
answer. The session (``plugin._session``) decodes the frames and calls it;
a channel never sees bytes it must relay.

Invariants, and why the code keeps them:

* **A consumption event always follows its publish.** A delivery is mapped
  (:meth:`Channel.delivered`) when its content header passes, before the
  client can ack it; :meth:`Channel.settle` only finds deliveries mapped so.
* **Requeues and closes produce no event.** A requeued or recovered delivery
  and a closed channel's deliveries are forgotten, never reported.
* **Transactions are all-or-nothing towards the sink.** A transactional
  channel buffers its events (:meth:`Channel.record`); :meth:`Channel.commit`
  hands them over as one :class:`LocalTransaction`, :meth:`Channel.rollback`
  drops them and restores the acks it rolled back (the deliveries stay
  unacked at the broker).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from bridge import (
    ConfirmKey,
    Consumed,
    DeadLettered,
    Event,
    LocalTransaction,
    Published,
    ReplicationId,
)

from ._confirms import ConfirmTracker
from ._topology_changes import TopologyChange

__all__ = ["Channel", "Incoming", "Publish"]

_Events = list[tuple[Event, ConfirmKey | None]]


@dataclass(slots=True)
class Publish:
    """A publish whose content is on its way from the client."""

    exchange: str
    routing_key: str
    seq: int | None
    body_size: int = -1  # -1 until the content header arrived
    received: int = 0
    #: set when the publish is replicated
    repl_id: ReplicationId | None = None
    properties: bytes = b""
    queues: tuple[str, ...] = ()
    chunks: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class Incoming:
    """A delivery or get-ok whose content header is on its way from the broker."""

    queue: str | None
    delivery_tag: int
    no_ack: bool
    is_return: bool = False
    #: the delivery's routing key, kept when its queue dead-letters rejects
    #: without a routing key of its own
    routing_key: str | None = None


class Channel:
    """The listener's state of one client channel, and what happens to it."""

    __slots__ = (
        "closed_by_us",
        "closing",
        "confirms",
        "consumers",
        "consumes",
        "deliveries",
        "gets",
        "held",
        "held_commit",
        "incoming",
        "last_queue",
        "number",
        "publish",
        "reopening",
        "requests",
        "routing_keys",
        "tx",
        "tx_acked",
        "tx_committing",
        "tx_events",
        "tx_prepared",
        "tx_sequence",
    )

    def __init__(self, number: int) -> None:
        self.number = number
        #: the queue the channel declared last (an empty queue name means it)
        self.last_queue = ""
        self.closing = False  # channel.close sent by either side, close-ok pending
        #: we closed the channel on both sides: close-oks still due (client, broker)
        self.closed_by_us = 0
        #: the client's close-ok came; what it sends on the channel number
        #: before the broker's (a reopening) waits here, to go once the broker
        #: is done with it
        self.reopening: list[bytes] | None = None
        self.publish: Publish | None = None
        self.incoming: Incoming | None = None
        #: set by confirm.select
        self.confirms: ConfirmTracker | None = None
        self.tx = False  # tx.select seen
        self.tx_events: list[Event] = []
        #: the open transaction's acks: restored to ``deliveries`` by a rollback
        self.tx_acked: dict[int, tuple[ReplicationId, str]] = {}
        self.tx_sequence = 0
        #: a tx.commit held until the sink has prepared its transaction
        self.tx_prepared: LocalTransaction | None = None
        self.held_commit = b""
        #: a transaction whose tx.commit went to the broker, commit-ok due
        self.tx_committing: LocalTransaction | None = None
        #: consumer tag -> (queue, no_ack)
        self.consumers: dict[str, tuple[str, bool]] = {}
        #: basic.consume requests awaiting consume-ok, in order
        self.consumes: deque[tuple[str, bool]] = deque()
        #: basic.get requests awaiting get-ok or get-empty, in order
        self.gets: deque[tuple[str, bool]] = deque()
        #: delivery tag -> (id, queue) of each unsettled replicated delivery
        self.deliveries: dict[int, tuple[ReplicationId, str]] = {}
        #: delivery tag -> routing key, for deliveries from dead-lettering queues
        self.routing_keys: dict[int, str] = {}
        #: the topology change of each request awaiting its -ok, and whether that
        #: -ok is ours to swallow (a nowait request we made synchronous)
        self.requests: deque[tuple[TopologyChange | None, bool]] = deque()
        #: the client's frames after a nowait request we made synchronous: they
        #: wait for the broker's verdict on it
        self.held: list[bytes] | None = None

    # -- publishing --------------------------------------------------------

    def select_confirms(self) -> None:
        if self.confirms is None:
            self.confirms = ConfirmTracker(self.number)

    def record(self, seq: int | None, event: Published, events: _Events) -> None:
        """A replicated publish is complete: into the transaction, or to the
        sink (with its confirm key when its confirm is held)."""
        if self.tx:
            self.tx_events.append(event)
        elif seq is not None and self.confirms is not None:  # a seq means confirms
            self.confirms.replicated(seq, event)
            events.append((event, (self.number, seq)))
        else:
            events.append((event, None))

    # -- consumers and deliveries -----------------------------------------

    def consume(self, queue: str, no_ack: bool, consumer_tag: str, nowait: bool) -> None:
        if nowait:
            self.consumers[consumer_tag] = (queue, no_ack)
        else:
            self.consumes.append((queue, no_ack))

    def consume_ok(self, consumer_tag: str) -> None:
        if self.consumes:
            self.consumers[consumer_tag] = self.consumes.popleft()

    def get(self, queue: str, no_ack: bool) -> None:
        self.gets.append((queue, no_ack))

    def get_answered(self) -> tuple[str, bool] | None:
        """The basic.get a get-ok or get-empty answers (None: not ours)."""
        return self.gets.popleft() if self.gets else None

    def delivered(
        self, tag: int, repl_id: ReplicationId, queue: str, routing_key: str | None
    ) -> None:
        """A replicated message reached the client under ``tag``, to be acked."""
        self.deliveries[tag] = (repl_id, queue)
        if routing_key is not None:
            self.routing_keys[tag] = routing_key

    def settle(
        self,
        tag: int,
        multiple: bool,
        requeue: bool,
        rejected: bool,
        vpn: str,
        dead_letter: Callable[[str, str], tuple[str, ...] | None] | None,
        events: _Events,
    ) -> None:
        """The client acked (or with ``rejected``, nacked or rejected)
        ``tag``: each settled delivery becomes a :class:`Consumed` event, or
        :class:`DeadLettered` when ``dead_letter`` (queue, routing key) routes
        it; into the transaction if one is open. Requeued ones are forgotten."""
        deliveries = self.deliveries
        if multiple:
            tags = [t for t in deliveries if tag == 0 or t <= tag]
        else:
            tags = [tag] if tag in deliveries else []
        for t in tags:
            repl_id, queue = deliveries.pop(t)
            routing_key = ""
            if self.routing_keys:
                # a transaction's acks keep theirs: a rollback makes them unacked again
                keys = self.routing_keys
                routing_key = keys.get(t, "") if self.tx else keys.pop(t, "")
            if requeue:
                continue  # back to the queue: nothing consumed
            event: Event = Consumed(vpn, repl_id, queue)
            if rejected and dead_letter is not None:
                to = dead_letter(queue, routing_key)
                if to is not None:
                    event = DeadLettered(vpn, repl_id, queue, to)
            if self.tx:
                self.tx_events.append(event)
                self.tx_acked[t] = (repl_id, queue)
            else:
                events.append((event, None))

    def recover(self) -> None:
        """basic.recover: the unacked deliveries come again under new tags."""
        self.deliveries.clear()
        self.routing_keys.clear()

    def unsettled(self, queue: str) -> Iterator[ReplicationId]:
        """Ids of ``queue``'s messages delivered here and not settled yet
        (acks inside an open transaction included: the broker holds those
        until the commit)."""
        for held in (self.deliveries, self.tx_acked):
            for repl_id, q in held.values():
                if q == queue:
                    yield repl_id

    # -- transactions ------------------------------------------------------

    def commit(
        self, vpn: str | None, connection: int, incarnation: int, held: bytes
    ) -> LocalTransaction | None:
        """tx.commit (its frame ``held``): the transaction to prepare, its
        commit held until then; None if it replicates nothing and the commit
        may pass at once."""
        if not self.tx_events or vpn is None:
            self._forget_tx_acks()
            return None
        self.tx_sequence += 1
        txn = LocalTransaction(
            vpn=vpn,
            connection=connection,
            channel=self.number,
            sequence=self.tx_sequence,
            events=tuple(self.tx_events),
            incarnation=incarnation,
        )
        self.tx_events.clear()
        self._forget_tx_acks()
        self.tx_prepared = txn
        self.held_commit = held
        return txn

    def prepared(self) -> tuple[LocalTransaction, bytes] | None:
        """The transaction the sink has answered for, and its held
        tx.commit (None: no commit is held)."""
        txn, self.tx_prepared = self.tx_prepared, None
        held, self.held_commit = self.held_commit, b""
        return None if txn is None else (txn, held)

    def commit_ok(self) -> LocalTransaction | None:
        """The broker's tx.commit-ok: the transaction it committed (None:
        not one of ours)."""
        txn, self.tx_committing = self.tx_committing, None
        return txn

    def rollback(self) -> None:
        self.tx_events.clear()
        self.deliveries.update(self.tx_acked)  # rolled-back acks: still unacked
        self.tx_acked.clear()

    def _forget_tx_acks(self) -> None:
        """The transaction's acks are committed: their deliveries are settled."""
        for tag in self.tx_acked:
            self.routing_keys.pop(tag, None)
        self.tx_acked.clear()

    def gone(self, abort: list[LocalTransaction], unresolved: list[LocalTransaction]) -> None:
        """The channel is closed (or its connection lost): a transaction
        whose tx.commit reached the broker without its commit-ok coming back
        is left to its marker (``unresolved``), one still being prepared is
        aborted."""
        if self.tx_committing is not None:
            unresolved.append(self.tx_committing)
            self.tx_committing = None
        if self.tx_prepared is not None:
            abort.append(self.tx_prepared)
            self.tx_prepared = None

    # -- topology requests and the frames they hold -----------------------

    def hold_frames(self) -> None:
        """The client's later frames wait for the broker's answer to the
        request just sent."""
        self.held = []

    def release_held(self) -> bytes:
        """The frames that waited (b"": none)."""
        held, self.held = self.held, None
        return b"".join(held) if held else b""

    def close_both_sides(self) -> None:
        """We closed the channel towards the client and the broker."""
        self.closing = True
        self.closed_by_us = 2
