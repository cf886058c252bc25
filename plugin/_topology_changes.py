"""Topology requests seen on the wire, as values applied when the broker agrees.

A client's ``exchange.*`` and ``queue.*`` request becomes one of these
frozen values when it passes the listener (:func:`change_of`); the session
keeps it until the broker's ``-ok`` and only then applies it to the VPN's
:class:`~plugin._topology.Topology` (``nowait`` requests, which get no
answer, apply at once). The invariant: **the topology model changes only
for a request the broker carried out**, so it never routes by a binding or
a queue the broker refused. A value holds exactly what its method carried;
nothing is decoded again when it applies.

Three changes reach beyond the topology, and the session carries those out
itself: a declared queue may be the connection's exclusive one, and a
deleted or purged queue's messages are gone on both sites (a ``Purged``
event). An empty queue name in a bind, unbind, purge or delete means the
channel's last declared queue (:data:`NAMES_A_QUEUE`), resolved when the
change applies, after every earlier ``declare-ok`` of the channel.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pamqp import base, commands

from ._topology import Topology

__all__ = [
    "NAMES_A_QUEUE",
    "REFUSABLE",
    "BindExchange",
    "BindQueue",
    "DeclareExchange",
    "DeclareQueue",
    "DeleteExchange",
    "DeleteQueue",
    "PurgeQueue",
    "TopologyChange",
    "UnbindExchange",
    "UnbindQueue",
    "change_of",
]


@dataclass(frozen=True, slots=True)
class DeclareExchange:
    exchange: str
    exchange_type: str
    arguments: Mapping[str, object] = field(default_factory=dict)
    internal: bool = False
    auto_delete: bool = False

    def apply(self, topology: Topology) -> None:
        topology.declare_exchange(
            self.exchange,
            self.exchange_type,
            dict(self.arguments),
            internal=self.internal,
            auto_delete=self.auto_delete,
        )


@dataclass(frozen=True, slots=True)
class DeleteExchange:
    exchange: str

    def apply(self, topology: Topology) -> None:
        topology.delete_exchange(self.exchange)


@dataclass(frozen=True, slots=True)
class BindExchange:
    destination: str
    source: str
    routing_key: str
    arguments: Mapping[str, object] = field(default_factory=dict)

    def apply(self, topology: Topology) -> None:
        topology.bind_exchange(
            self.destination, self.source, self.routing_key, dict(self.arguments)
        )


@dataclass(frozen=True, slots=True)
class UnbindExchange:
    destination: str
    source: str
    routing_key: str
    arguments: Mapping[str, object] = field(default_factory=dict)

    def apply(self, topology: Topology) -> None:
        topology.unbind_exchange(
            self.destination, self.source, self.routing_key, dict(self.arguments)
        )


@dataclass(frozen=True, slots=True)
class DeclareQueue:
    """``queue`` is empty for a server-named queue: the ``declare-ok``
    names it (:meth:`apply` takes that name)."""

    queue: str
    arguments: Mapping[str, object] = field(default_factory=dict)
    exclusive: bool = False

    def apply(self, topology: Topology, name: str | None = None) -> None:
        topology.declare_queue(self.queue if name is None else name, dict(self.arguments))


@dataclass(frozen=True, slots=True)
class DeleteQueue:
    queue: str

    def apply(self, topology: Topology) -> None:
        topology.delete_queue(self.queue)


@dataclass(frozen=True, slots=True)
class PurgeQueue:
    """The topology has no messages: a purge changes only the sites' stores."""

    queue: str

    def apply(self, topology: Topology) -> None:
        return None


@dataclass(frozen=True, slots=True)
class BindQueue:
    queue: str
    exchange: str
    routing_key: str
    arguments: Mapping[str, object] = field(default_factory=dict)

    def apply(self, topology: Topology) -> None:
        topology.bind_queue(self.queue, self.exchange, self.routing_key, dict(self.arguments))


@dataclass(frozen=True, slots=True)
class UnbindQueue:
    queue: str
    exchange: str
    routing_key: str
    arguments: Mapping[str, object] = field(default_factory=dict)

    def apply(self, topology: Topology) -> None:
        topology.unbind_queue(self.queue, self.exchange, self.routing_key, dict(self.arguments))


TopologyChange = (
    DeclareExchange
    | DeleteExchange
    | BindExchange
    | UnbindExchange
    | DeclareQueue
    | DeleteQueue
    | PurgeQueue
    | BindQueue
    | UnbindQueue
)

#: changes whose empty queue name means the channel's last declared queue
NAMES_A_QUEUE = (BindQueue, UnbindQueue, PurgeQueue, DeleteQueue)

#: nowait requests the broker may refuse (if-unused, if-empty, another
#: connection's exclusive queue, access) with a change the standby cannot
#: undo: the session makes them synchronous
REFUSABLE = (DeleteQueue, PurgeQueue, DeleteExchange)


def change_of(m: base.Frame) -> TopologyChange | None:
    """The change a topology request makes if the broker carries it out
    (None: it changes nothing, like a passive declare)."""
    if isinstance(m, commands.Exchange.Declare):
        if m.passive:
            return None
        return DeclareExchange(
            m.exchange,
            m.exchange_type,
            dict(m.arguments or {}),
            internal=m.internal,
            auto_delete=m.auto_delete,
        )
    if isinstance(m, commands.Exchange.Delete):
        return DeleteExchange(m.exchange)
    if isinstance(m, commands.Exchange.Bind):
        return BindExchange(m.destination, m.source, m.routing_key, dict(m.arguments or {}))
    if isinstance(m, commands.Exchange.Unbind):
        return UnbindExchange(m.destination, m.source, m.routing_key, dict(m.arguments or {}))
    if isinstance(m, commands.Queue.Declare):
        if m.passive:
            return None
        return DeclareQueue(m.queue, dict(m.arguments or {}), exclusive=m.exclusive)
    if isinstance(m, commands.Queue.Delete):
        return DeleteQueue(m.queue)
    if isinstance(m, commands.Queue.Purge):
        return PurgeQueue(m.queue)
    if isinstance(m, commands.Queue.Bind):
        return BindQueue(m.queue, m.exchange, m.routing_key, dict(m.arguments or {}))
    if isinstance(m, commands.Queue.Unbind):
        return UnbindQueue(m.queue, m.exchange, m.routing_key, dict(m.arguments or {}))
    return None
