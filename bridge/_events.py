"""What the listener tells replication: typed events, and the local
transaction that groups a channel's events between two ``tx.commit``.

These are the vocabulary every layer shares: the listener (``plugin``) makes
them in the order it saw them on the wire, so a consumption always follows
its publish; the ledger stores them, the bridge ships them, the standby
applies them, and the transaction coordinator (``txn``) commits them as
one group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from ._ids import ReplicationId

if TYPE_CHECKING:
    import asyncio

__all__ = [
    "EVENT_KINDS",
    "MARKER_QUEUE",
    "RESERVED_PREFIX",
    "ConfirmKey",
    "Consumed",
    "DeadLettered",
    "Event",
    "LocalTransaction",
    "Published",
    "Purged",
    "TOPOLOGY_OPS",
    "TopologyChanged",
    "XA_TXID_PREFIX",
    "TransactionRefused",
    "Voted",
    "future_callback",
    "xid_of_txid",
]

#: The stream of each replicated VPN that holds commit markers: the listener
#: publishes a local transaction's id there inside the client's own broker
#: transaction, and recovery looks for it (``txn``'s marker store) to learn
#: whether the broker committed.
MARKER_QUEUE = "vpnrepl.commit-markers"

#: names of queues and exchanges that are the product's own in every VPN:
#: a client gets 403 for any method on them through the listener, except
#: the XA request path (a publish to ``vpnrepl.xa``, see ``txn``)
RESERVED_PREFIX = "vpnrepl."


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
    ``sent_at`` is the ledger index the VPN's next event took when the purge
    request went to the broker: only messages published below it can have
    been purged there (one another connection published meanwhile, whose
    event may precede this one, may have reached the queue after the purge),
    so both sites remove only those (0: not known, the purge's own index).
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
    sent_at: int = 0


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


class TopologyChanged(NamedTuple):
    """An exchange or a queue declared or deleted, or a binding made or
    removed, through the listener of a replicated VPN, once the broker
    answered ``-ok``. It is a ledger entry like the messages, so the standby
    applies it in order with them: a publish routed to a queue always
    follows that queue's declare.

    ``op`` is one of :data:`TOPOLOGY_OPS`; ``item`` the object as RabbitMQ's
    definitions export has it, canonical JSON (sorted keys, no vhost): a
    queue ``{name, durable, auto_delete, arguments}``, an exchange ``{name,
    type, durable, auto_delete, internal, arguments}``, a binding ``{source,
    destination, destination_type, routing_key, arguments}``; a delete names
    the object only (``{name}``). :mod:`bridge._definitions` builds and
    applies them."""

    vpn: str
    op: str
    item: str


#: what a :class:`TopologyChanged` does, in the order of its wire code (1...)
TOPOLOGY_OPS = (
    "exchange.declare",
    "exchange.delete",
    "queue.declare",
    "queue.delete",
    "bind",
    "unbind",
)

Event = Published | Consumed | Purged | DeadLettered | TopologyChanged

#: each event type's name: the ledger's ``kind`` column and the ``kind``
#: label of the ``vpnrepl_events_total`` metric
EVENT_KINDS: dict[type, str] = {
    Published: "published",
    Consumed: "consumed",
    Purged: "purged",
    DeadLettered: "dead-lettered",
    TopologyChanged: "topology",
}

#: a standby's yes vote on a local transaction: each of its events' ledger
#: encoding and the event, as the participant decoded them
Voted = tuple[tuple[bytes, Event], ...]

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
    #: a client's XA branch: its XA id in text form (``txn.Xid``)
    xid: str | None = None

    @property
    def txid(self) -> str:
        """``incarnation.connection.channel.sequence``: unique across restarts;
        an XA branch's is ``xa/<xid>/`` before it (:func:`xid_of_txid`), so
        the standby knows its rows for XA branches from the id alone."""
        local = f"{self.incarnation}.{self.connection}.{self.channel}.{self.sequence}"
        return local if self.xid is None else f"{XA_TXID_PREFIX}{self.xid}/{local}"


#: how an XA branch's transaction id starts
XA_TXID_PREFIX = "xa/"


def xid_of_txid(txid: str) -> str | None:
    """The XA id (text form) of an XA branch's transaction id; None for a
    local transaction's."""
    if not txid.startswith(XA_TXID_PREFIX):
        return None
    return txid[len(XA_TXID_PREFIX) :].partition("/")[0] or None


class TransactionRefused(Exception):
    """The sink could not prepare a transaction; ``reason`` goes to the client."""


def future_callback(future: asyncio.Future[bool]) -> Callable[[bool], None]:
    """An ``on_durable`` callback that resolves ``future`` with its first
    verdict (for a caller that awaits durability instead of being called)."""

    def resolve(ok: bool) -> None:
        if not future.done():
            future.set_result(ok)

    return resolve
