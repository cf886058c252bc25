"""What the listener tells replication: typed events and the sink interface.

The listener hands every event to a :class:`ReplicationSink` in the order it
saw them on the wire, so a consumption always follows its publish. The bridge
implements the sink (ledger, standby acknowledgements); :class:`MemorySink`
is the in-process implementation used by tests and the listener benchmark.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import itertools
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = [
    "ConfirmKey",
    "Consumed",
    "DeadLettered",
    "EVENT_KINDS",
    "Event",
    "IdSource",
    "IdsExhausted",
    "LocalTransaction",
    "MemorySink",
    "Published",
    "Purged",
    "ReplicationId",
    "ReplicationSink",
    "TransactionRefused",
    "future_callback",
    "id_in_header",
]

#: The message header carrying a replication id (our own: JMS clients do not
#: set ``message_id``, and a client's own properties must stay the client's).
#: Its value is a signed 64-bit integer (AMQP field type ``l``), the id's
#: :attr:`ReplicationId.wire` form. Why not the 32 hex digits it once was:
#: RabbitMQ 3.10 spends 10-20 % more CPU per persistent message once the
#: content header's properties pass 64 bytes (Erlang's limit for binaries
#: copied onto a process heap), measured with the same lean publisher direct
#: to the broker: a compact client (28 bytes of properties) went from ~1.0 to
#: ~0.87 of its own rate with the hex header (+54 bytes) and stayed at ~1.0
#: with the integer (+26 bytes); a client already past 64 bytes pays that
#: cost whatever we add. Messages carrying the hex form (published by an
#: earlier version) are still recognised.
#:
#: Consumers never see it (unless the VPN exposes it): the listener cuts it
#: out of every message it hands a client. When the publisher sent no
#: headers table at all, the table is ours alone and must go too; the value
#: then says so by being negative (the wire form complemented), since an
#: empty table the publisher did send looks the same once our entry is out.
REPLICATION_HEADER = "x-vpnrepl-id"
#: An id is an incarnation (one per node start, from the site database) and a
#: counter; in the header they share one positive int64.
INCARNATION_BITS = 19
COUNTER_BITS = 44
INCARNATION_LIMIT = 1 << INCARNATION_BITS  # exclusive
COUNTER_LIMIT = 1 << COUNTER_BITS  # exclusive
#: counters left when an :class:`IdSource` asks for a new incarnation
RENEW_MARGIN = 1 << 32


_U64 = struct.Struct(">Q").pack
_I64 = struct.Struct(">q").pack
_I64_FROM = struct.Struct(">q").unpack_from
_new_id = object.__new__
_set = object.__setattr__


class IdsExhausted(RuntimeError):
    """An :class:`IdSource` ran out of counters before it got a new incarnation."""


@dataclass(frozen=True, slots=True)
class ReplicationId:
    """A process incarnation (persisted at start) and a counter, 8 bytes each
    (big-endian) as stored; ids made by :class:`IdSource` fit the header's
    64-bit :attr:`wire` form (19 + 44 bits).

    Not derived from the ledger index: the id is put into the message before
    its ledger entry is durable, so a restarted node must never hand out an
    id again; a new incarnation guarantees it.
    """

    value: bytes

    def __post_init__(self) -> None:
        if len(self.value) != 16:
            raise ValueError(f"a replication id is 16 bytes, got {len(self.value)}")

    @classmethod
    def from_parts(cls, incarnation: int, counter: int) -> ReplicationId:
        if not 0 <= incarnation < 2**64 or not 0 <= counter < 2**64:
            raise ValueError("incarnation and counter must fit in 64 bits")
        return cls(incarnation.to_bytes(8, "big") + counter.to_bytes(8, "big"))

    @classmethod
    def from_hex(cls, text: str) -> ReplicationId:
        if len(text) != 32:
            raise ValueError(f"a replication id is 32 hex digits, got {len(text)}")
        return cls(bytes.fromhex(text))

    @classmethod
    def from_wire(cls, wire: int) -> ReplicationId:
        """The id whose header value is ``wire``."""
        if not 0 <= wire < 1 << 63:
            raise ValueError(f"a replication id's header value is a positive int64, got {wire}")
        return cls.from_parts(wire >> COUNTER_BITS, wire & (COUNTER_LIMIT - 1))

    @property
    def wire(self) -> int:
        """The header value: incarnation and counter in one positive int64."""
        incarnation = int.from_bytes(self.value[:8], "big")
        counter = int.from_bytes(self.value[8:], "big")
        if incarnation >= INCARNATION_LIMIT or counter >= COUNTER_LIMIT:
            raise ValueError(f"replication id {self.hex} does not fit the 64-bit header form")
        return incarnation << COUNTER_BITS | counter

    @property
    def hex(self) -> str:
        return self.value.hex()

    def __str__(self) -> str:
        return self.hex


def id_in_header(value: bytes) -> tuple[ReplicationId, bool] | None:
    """The replication id in our header's encoded field value (type octet
    and data), and whether the headers table is ours alone; None when the
    value is not one of ours. An int64 (negative: the table is ours alone),
    or the 32 hex digits of messages published by an earlier version."""
    try:
        if len(value) == 9 and value[0] == ord("l"):
            wire = _I64_FROM(value, 1)[0]
            return ReplicationId.from_wire(~wire if wire < 0 else wire), wire < 0
        if len(value) == 5 + 32 and value[0] == ord("S"):
            return ReplicationId.from_hex(value[5:].decode("ascii")), False
    except ValueError:  # incl. UnicodeDecodeError: not one of ours
        return None
    return None


class IdSource:
    """Hands out replication ids for one process incarnation.

    ``first`` is the first counter (tests start near the end). When fewer
    than :data:`RENEW_MARGIN` counters are left, ``on_low`` is called once:
    the node records a new incarnation and hands it over with :meth:`renew`
    (at 100,000 messages a second that margin lasts half a day; the counter
    itself lasts five years). Running out before that raises
    :class:`IdsExhausted` rather than reusing an id.

    Across sites: each site numbers its incarnations from its own sequence,
    so both sites can hold the same incarnation number. That is safe while a
    VPN's ids are made only on its active site; promoting a standby (not
    built yet) must first move the site's ``node_incarnation`` sequence past
    every incarnation in that VPN's replicated state and :meth:`renew` the
    running node's source, so the new active never repeats an id the old
    one handed out.
    """

    def __init__(
        self, incarnation: int, *, first: int = 1, on_low: Callable[[], None] | None = None
    ) -> None:
        self.on_low = on_low
        self.renew(incarnation, first)

    def renew(self, incarnation: int, first: int = 1) -> None:
        """Continue with ``incarnation`` (a new one, never used before)."""
        if not 1 <= incarnation < INCARNATION_LIMIT:
            raise ValueError(
                f"incarnation {incarnation} does not fit a replication id "
                f"(1 to {INCARNATION_LIMIT - 1})"
            )
        if not 1 <= first < COUNTER_LIMIT:
            raise ValueError(f"first counter {first} out of range")
        self.incarnation = incarnation
        self._prefix = incarnation.to_bytes(8, "big")
        self._base = incarnation << COUNTER_BITS
        self._counter = itertools.count(first)
        self._low_at = COUNTER_LIMIT - RENEW_MARGIN
        self._asked = False

    def next(self) -> ReplicationId:
        return self.next_with_wire()[0]

    def next_with_wire(self, alone: bool = False) -> tuple[ReplicationId, bytes]:
        """The next id and its header value as 8 big-endian bytes (the
        listener's hot path: cheaper than :attr:`ReplicationId.wire`).

        ``alone``: the header goes into a headers table the publisher did
        not send; the value is then the id's wire form complemented (a
        negative int64), which tells the listener to remove the whole table
        again on delivery (:func:`id_in_header`)."""
        n = next(self._counter)
        if n >= self._low_at:
            self._running_low(n)
        # 16 bytes by construction: skip the validating __init__ (hot path)
        rid = _new_id(ReplicationId)
        _set(rid, "value", self._prefix + _U64(n))
        if alone:
            return rid, _I64(~(self._base | n))
        return rid, _U64(self._base | n)

    def _running_low(self, n: int) -> None:
        if n >= COUNTER_LIMIT:
            raise IdsExhausted(
                f"incarnation {self.incarnation} has used all {COUNTER_LIMIT - 1} replication "
                "ids and no new incarnation was recorded: restart the node"
            )
        if not self._asked:
            self._asked = True
            if self.on_low is not None:
                self.on_low()


class Published(NamedTuple):
    """A persistent publish routed to in-scope queues of a replicated VPN.

    Events are NamedTuples rather than frozen dataclasses: one is made per
    replicated message, and a tuple is built several times faster; they are
    just as immutable.

    ``properties`` is the content header's property bytes (flags and values)
    exactly as the broker received them, replication header included, so the
    standby can materialise the message byte for byte.
    """

    vpn: str
    repl_id: ReplicationId
    exchange: str
    routing_key: str
    properties: bytes
    body: bytes
    queues: tuple[str, ...]


class Consumed(NamedTuple):
    """A replicated message left ``queue`` for good (ack, nack/reject without
    requeue, or delivery to a no-ack consumer)."""

    vpn: str
    repl_id: ReplicationId
    queue: str


class Purged(NamedTuple):
    """``queue`` of a replicated VPN was emptied through the listener, so
    every replicated message of it published before this event leaves it.

    ``queue.purge-ok``: ``spared`` holds the ids of the queue's messages
    that were delivered and not yet settled on this listener's connections
    (RabbitMQ's purge leaves them in the queue; they may still be requeued).
    ``queue.delete-ok``, or the close of the connection owning an exclusive
    queue: ``deleted``, nothing spared (the queue's unacked messages go with
    it). Sent for every queue of a replicated VPN, whatever the scope (a
    topic filter can put any queue's messages in scope); a site with no row
    for the queue applies nothing.
    """

    vpn: str
    queue: str
    spared: tuple[ReplicationId, ...] = ()
    deleted: bool = False


class DeadLettered(NamedTuple):
    """A replicated message left ``queue`` by a reject or nack without
    requeue, and the queue's dead-letter exchange routed it to ``to`` (its
    in-scope queues; empty: dropped). Both sites move the message's row;
    its properties stay as published (the ``x-death`` header the broker adds
    is not replicated)."""

    vpn: str
    repl_id: ReplicationId
    queue: str
    to: tuple[str, ...]


Event = Published | Consumed | Purged | DeadLettered

#: each event type's name: the ledger's ``kind`` column and the ``kind``
#: label of the ``vpnrepl_events_total`` metric
EVENT_KINDS: dict[type, str] = {
    Published: "published",
    Consumed: "consumed",
    Purged: "purged",
    DeadLettered: "dead-lettered",
}

#: (channel, publish sequence number): which client confirm an event releases
ConfirmKey = tuple[int, int]


@dataclass(frozen=True, slots=True)
class LocalTransaction:
    """The replicated events of one ``tx.commit`` on one channel."""

    vpn: str
    connection: int
    channel: int
    sequence: int
    events: tuple[Event, ...]
    #: the listener process's incarnation: with it the id is unique for ever
    incarnation: int = 0

    @property
    def txid(self) -> str:
        """``incarnation.connection.channel.sequence``: unique across restarts."""
        return f"{self.incarnation}.{self.connection}.{self.channel}.{self.sequence}"


def future_callback(future: asyncio.Future[bool]) -> Callable[[bool], None]:
    """An ``on_durable`` callback that resolves ``future`` with its first
    verdict (for a caller that awaits durability instead of being called)."""

    def resolve(ok: bool) -> None:
        if not future.done():
            future.set_result(ok)

    return resolve


class TransactionRefused(Exception):
    """The sink could not prepare a transaction; ``reason`` goes to the client."""


#: commits under way through the default :meth:`ReplicationSink.commit_soon`
#: (the loop keeps only weak references to tasks)
_COMMITTING: set[asyncio.Task[None]] = set()


class ReplicationSink(abc.ABC):
    """Where the listener's events go. Implemented by the bridge."""

    @abc.abstractmethod
    def append(self, event: Event, on_durable: Callable[[bool], None] | None) -> None:
        """Take ``event`` in listener order.

        ``on_durable(ok)`` is called once the event is as durable as its VPN's
        mode requires; ``ok=False`` means the client's confirm must be a nack.
        It may be called before ``append`` returns.
        """

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

    @abc.abstractmethod
    def prepare(self, txn: LocalTransaction) -> Awaitable[None]:
        """Persist ``txn`` as prepared; the awaitable raises
        :class:`TransactionRefused` if not (or the call itself does). An
        ``async def`` does; a sink may also start the work at the call, so
        it begins before the listener's task for the rest is scheduled."""

    @abc.abstractmethod
    async def commit(self, txn: LocalTransaction) -> None:
        """Persist the commit decision of a prepared ``txn`` and apply it."""

    def commit_soon(
        self, txn: LocalTransaction, done: Callable[[BaseException | None], None]
    ) -> None:
        """:meth:`commit`, reporting through ``done(error)`` (``None``:
        committed; :class:`TransactionRefused`: not recorded) instead of
        being awaited. A sink that learns the outcome in a callback of its
        own overrides this and calls ``done`` there, so the listener
        answers the client in that same callback, not one event-loop turn
        and a task wake-up later."""
        task = asyncio.ensure_future(self.commit(txn))
        _COMMITTING.add(task)

        def finished(task: asyncio.Task[None]) -> None:
            _COMMITTING.discard(task)
            done(asyncio.CancelledError() if task.cancelled() else task.exception())

        task.add_done_callback(finished)

    @abc.abstractmethod
    async def abort(self, txn: LocalTransaction) -> None:
        """Forget a prepared ``txn`` whose broker commit did not happen."""

    async def resolve(self, txn: LocalTransaction) -> None:
        """``txn``'s tx.commit reached the broker but its commit-ok was never
        seen (the connection broke): settle it by its commit marker."""
        return None

    def full(self) -> bool:
        """True while the sink holds as many not-yet-durable events as it may;
        the listener then stops reading the client (TCP backpressure)."""
        return False

    async def wait_for_room(self) -> None:
        """Return once :meth:`full` is False again (at once for a sink that
        is never full)."""
        return None


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

    async def prepare(self, txn: LocalTransaction) -> None:
        self.prepared.append(txn)

    async def commit(self, txn: LocalTransaction) -> None:
        self.committed.append(txn)
        self.events.extend(txn.events)

    async def abort(self, txn: LocalTransaction) -> None:
        self.aborted.append(txn)
