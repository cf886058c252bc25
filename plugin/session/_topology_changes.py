"""Topology requests seen on the wire, as values applied when the broker agrees.

A client's ``exchange.*`` or ``queue.*`` request becomes a frozen value as it
passes (:func:`change_of`), holding exactly what its method carried; its
connection's :class:`TopologyRequests` keeps it until the broker's ``-ok``,
then applies it to the VPN's :class:`~plugin.topology._topology.Topology`,
so the model never routes by what the broker refused. A ``nowait`` request
applies at once, except those whose refusal the standby could not undo
(:data:`REFUSABLE`), made synchronous. :class:`TopologyRequests` also keeps
the connection's exclusive queues and makes ``Purged`` events (a purge's
with the :class:`~plugin.session._actions.LedgerMark` of its request) and
``TopologyChanged`` ones (:meth:`change_event`); an empty queue name
(:data:`NAMES_A_QUEUE`) is resolved as the change applies, after the
channel's earlier ``declare-ok``. Why each: docs/behaviour.md, "Purges and
deletes" and "Topology in the stream".
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pamqp import base, commands

from bridge import (
    RESERVED_PREFIX,
    Purged,
    ReplicationId,
    TopologyChanged,
    amqp,
    binding_item,
    exchange_item,
    name_item,
    queue_item,
)
from bridge.amqp import FrameSpan, Method
from plugin.topology import Topology

from ._actions import LedgerMark

if TYPE_CHECKING:  # the channel keeps the requests: only typed here
    from ._channel import Channel, ChannelContext

__all__ = [
    "NAMES_A_QUEUE",
    "OK_METHODS",
    "REFUSABLE",
    "REQUEST_METHODS",
    "BindExchange",
    "BindQueue",
    "DeclareExchange",
    "DeclareQueue",
    "DeleteExchange",
    "DeleteQueue",
    "PurgeQueue",
    "TopologyChange",
    "TopologyRequests",
    "UnbindExchange",
    "UnbindQueue",
    "change_event",
    "change_of",
    "reserved_name",
]


@dataclass(frozen=True, slots=True)
class DeclareExchange:
    exchange: str
    exchange_type: str
    arguments: Mapping[str, object] = field(default_factory=dict)
    internal: bool = False
    auto_delete: bool = False
    durable: bool = False

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
    durable: bool = False
    auto_delete: bool = False

    def apply(self, topology: Topology, name: str | None = None) -> None:
        topology.declare_queue(self.queue if name is None else name, dict(self.arguments))


@dataclass(frozen=True, slots=True)
class DeleteQueue:
    queue: str

    def apply(self, topology: Topology) -> None:
        topology.delete_queue(self.queue)


@dataclass(frozen=True, slots=True)
class PurgeQueue:
    """The topology has no messages: a purge changes only the sites' stores.
    ``sent``: where the request went to the broker in the ledger's order
    (its ``Purged`` event's ``sent_at``; on a replicated VPN)."""

    queue: str
    sent: LedgerMark | None = field(default=None, compare=False)

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

#: the class and method ids of the requests, and of the broker's answers
REQUEST_METHODS = (
    Method.EXCHANGE_DECLARE,
    Method.EXCHANGE_DELETE,
    Method.EXCHANGE_BIND,
    Method.EXCHANGE_UNBIND,
    Method.QUEUE_DECLARE,
    Method.QUEUE_DELETE,
    Method.QUEUE_PURGE,
    Method.QUEUE_BIND,
    Method.QUEUE_UNBIND,
)
OK_METHODS = (
    Method.EXCHANGE_DECLARE_OK,
    Method.EXCHANGE_DELETE_OK,
    Method.EXCHANGE_BIND_OK,
    Method.EXCHANGE_UNBIND_OK,
    Method.QUEUE_DECLARE_OK,
    Method.QUEUE_DELETE_OK,
    Method.QUEUE_PURGE_OK,
    Method.QUEUE_BIND_OK,
    Method.QUEUE_UNBIND_OK,
)

#: changes whose empty queue name means the channel's last declared queue
NAMES_A_QUEUE = (BindQueue, UnbindQueue, PurgeQueue, DeleteQueue)

#: nowait requests the broker may refuse (if-unused, if-empty, another
#: connection's exclusive queue, access) with a change the standby cannot
#: undo: the session makes them synchronous
REFUSABLE = (DeleteQueue, PurgeQueue, DeleteExchange)
#: the topology methods with a nowait flag
_NOWAIT_METHODS = (
    commands.Queue.Delete,
    commands.Queue.Purge,
    commands.Queue.Declare,
    commands.Queue.Bind,
    commands.Exchange.Delete,
    commands.Exchange.Declare,
    commands.Exchange.Bind,
    commands.Exchange.Unbind,
)

log = logging.getLogger(__name__)


def reserved_name(m: base.Frame) -> str | None:
    """The name a topology request gives that the product reserves
    (``vpnrepl.*``), if any; a passive declare of one too (it would tell
    whether a VPN has had a local transaction)."""
    for attr in ("queue", "exchange", "source", "destination"):
        name = getattr(m, attr, "")
        if isinstance(name, str) and name.startswith(RESERVED_PREFIX):
            return name
    # a queue that dead-letters (or an exchange that falls back) into one
    arguments = getattr(m, "arguments", None) or {}
    for key in ("x-dead-letter-exchange", "x-dead-letter-routing-key", "alternate-exchange"):
        name = arguments.get(key)
        if isinstance(name, bytes):
            name = name.decode("utf-8", "replace")
        if isinstance(name, str) and name.startswith(RESERVED_PREFIX):
            return name
    return None


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
            durable=m.durable,
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
        return DeclareQueue(
            m.queue,
            dict(m.arguments or {}),
            exclusive=m.exclusive,
            durable=m.durable,
            auto_delete=m.auto_delete,
        )
    if isinstance(m, commands.Queue.Delete):
        return DeleteQueue(m.queue)
    if isinstance(m, commands.Queue.Purge):
        return PurgeQueue(m.queue)
    if isinstance(m, commands.Queue.Bind):
        return BindQueue(m.queue, m.exchange, m.routing_key, dict(m.arguments or {}))
    if isinstance(m, commands.Queue.Unbind):
        return UnbindQueue(m.queue, m.exchange, m.routing_key, dict(m.arguments or {}))
    return None


def change_event(
    vpn: str, change: TopologyChange, declared: str | None, exclusive: list[str]
) -> TopologyChanged | None:
    """The event a change applied on ``vpn`` replicates (None: nothing to
    replicate). ``declared``: the name a declare-ok gave; ``exclusive``:
    the connection's exclusive queues, which do not replicate."""
    if isinstance(change, DeclareQueue):
        name = change.queue if declared is None else declared
        if change.exclusive or not name:
            return None
        item = queue_item(
            name, change.arguments, durable=change.durable, auto_delete=change.auto_delete
        )
        return TopologyChanged(vpn, "queue.declare", item)
    if isinstance(change, DeleteQueue):
        if change.queue in exclusive:
            return None
        return TopologyChanged(vpn, "queue.delete", name_item(change.queue))
    if isinstance(change, DeclareExchange):
        item = exchange_item(
            change.exchange,
            change.exchange_type,
            change.arguments,
            durable=change.durable,
            auto_delete=change.auto_delete,
            internal=change.internal,
        )
        return TopologyChanged(vpn, "exchange.declare", item)
    if isinstance(change, DeleteExchange):
        return TopologyChanged(vpn, "exchange.delete", name_item(change.exchange))
    if isinstance(change, BindQueue | UnbindQueue):
        if change.queue in exclusive:
            return None
        op = "bind" if isinstance(change, BindQueue) else "unbind"
        item = binding_item(change.exchange, change.queue, "queue", change.routing_key,
                            change.arguments)  # fmt: skip
        return TopologyChanged(vpn, op, item)
    if isinstance(change, BindExchange | UnbindExchange):
        op = "bind" if isinstance(change, BindExchange) else "unbind"
        item = binding_item(change.source, change.destination, "exchange", change.routing_key,
                            change.arguments)  # fmt: skip
        return TopologyChanged(vpn, op, item)
    return None  # a purge changes no definition


class TopologyRequests:
    """The topology requests of one connection, from the wire to the VPN's
    topology.

    A request's change applies at the broker's -ok; a nowait one's at once,
    except a queue.delete, queue.purge or exchange.delete (:data:`REFUSABLE`):
    the broker may refuse those, and the change is destructive on the standby
    (its Purged event drops the queue's messages there while the active keeps
    them). Such a request goes to the broker synchronous instead; its -ok,
    which the client did not ask for, is swallowed, and the client's later
    frames on the channel wait for it (``release_held`` lets them go), so the
    change takes its place among the channel's events exactly where the
    broker made it.

    ``unsettled(vpn, queue)``: the ids of the queue's messages delivered on
    the listener's connections and not settled yet, which a purge leaves in
    the queue. ``exclusive_queues``: the queues this connection declared
    exclusive, gone with it (:meth:`connection_lost`).
    """

    __slots__ = ("_ctx", "_release_held", "_unsettled", "exclusive_queues")

    def __init__(
        self,
        ctx: ChannelContext,
        unsettled: Callable[[str, str], tuple[ReplicationId, ...]],
        release_held: Callable[[Channel], None],
    ) -> None:
        self._ctx = ctx
        self._unsettled = unsettled
        self._release_held = release_held
        self.exclusive_queues: list[str] = []

    def request(self, ch: Channel, buf: bytes, f: FrameSpan) -> bytes | None:
        """A client's topology request on channel ``ch``: what replaces its
        frame (None: relay it)."""
        m = amqp.decode_method(buf, f)
        reserved = reserved_name(m)
        if reserved is not None:
            return ch.refuse_reserved(f"{m.name.lower()} of {reserved!r}")
        change = change_of(m)
        if isinstance(change, PurgeQueue) and self._ctx.replicating:
            # Only messages published before the request goes out can have
            # been purged at the broker: the driver records where that is.
            out, mark = self._ctx.out, LedgerMark()
            change = dataclasses.replace(change, sent=mark)
            out.marks.append((len(out.events), mark))
        if not getattr(m, "nowait", False):
            # one entry per request, so each -ok pops its own request
            ch.requests.append((change, False))
        elif self._waits_for_ok(change) and f.channel != 0:
            ch.requests.append((change, True))
            ch.hold_frames()
            assert isinstance(m, _NOWAIT_METHODS)  # noqa: S101 - the methods with nowait
            m.nowait = False
            return amqp.marshal_method(m, f.channel)
        elif change is not None:
            self._apply(ch, change, None)
        return None

    def _waits_for_ok(self, change: TopologyChange | None) -> bool:
        """A nowait request made synchronous: one the broker may refuse with
        a change the standby cannot undo (:data:`REFUSABLE`), and on a
        replicated VPN any that replicates (a refused declare or bind must
        not reach the standby's definitions)."""
        if isinstance(change, REFUSABLE):
            return True
        if change is None or not self._ctx.replicating:
            return False
        return not (isinstance(change, DeclareQueue) and change.exclusive)

    def answered(self, ch: Channel, buf: bytes, f: FrameSpan) -> bytes | None:
        """The broker's -ok to the oldest request of ``ch``."""
        if not ch.requests:
            return None
        change, ours = ch.requests.popleft()
        declared = None
        if amqp.method_id(buf, f) == Method.QUEUE_DECLARE_OK:
            ok = amqp.decode_method(buf, f)
            declared = ch.last_queue = getattr(ok, "queue", "")  # passive declares count too
        if change is not None:
            self._apply(ch, change, declared)
        if not ours:
            return None
        self._release_held(ch)
        return b""  # the client sent it nowait: it expects no answer

    def _apply(self, ch: Channel, change: TopologyChange, declared: str | None) -> None:
        """Apply ``change`` to the VPN's topology; ``declared``: the queue a
        declare-ok named (None: a nowait declare, whose answer is unknown)."""
        vpn = self._ctx.vpn
        if vpn is None:
            return
        if isinstance(change, NAMES_A_QUEUE) and not change.queue:
            if not ch.last_queue:
                return
            change = dataclasses.replace(change, queue=ch.last_queue)
        topology = vpn.topology
        try:
            if isinstance(change, DeclareQueue):
                # a nowait exclusive declare of a queue that exists and is not
                # this connection's own is refused (405): not counted as the
                # connection's (its end would delete a live queue, on both sites)
                name = change.queue if declared is None else declared
                refused = declared is None and name in topology.queues
                change.apply(topology, name)
                if change.exclusive and not refused and name not in self.exclusive_queues:
                    self.exclusive_queues.append(name)
            elif isinstance(change, DeleteQueue):
                change.apply(topology)
                self._emptied(change.queue, deleted=True)
            elif isinstance(change, PurgeQueue):
                sent_at = change.sent.index if change.sent is not None else 0
                self._emptied(change.queue, deleted=False, sent_at=sent_at)
            else:
                change.apply(topology)
            self._stream(change, declared)
            if isinstance(change, DeleteQueue) and change.queue in self.exclusive_queues:
                # gone: a queue of that name declared later is not this exclusive one
                self.exclusive_queues.remove(change.queue)
        except Exception:  # a topology mismatch must never break the relay
            log.exception("connection %d: topology update failed", self._ctx.connection_id)

    def _stream(self, change: TopologyChange, declared: str | None) -> None:
        """The change as a ``TopologyChanged`` event, on a replicated VPN."""
        ctx = self._ctx
        vpn = ctx.vpn
        if vpn is None or not ctx.replicating:
            return
        event = change_event(vpn.name, change, declared, self.exclusive_queues)
        if event is not None:
            ctx.out.events.append((event, None))

    def _emptied(self, queue: str, *, deleted: bool, sent_at: int = 0) -> None:
        """``queue`` was purged (or deleted): a :class:`Purged` event, on a
        replicated VPN, sparing what a purge leaves in the queue and, with
        ``sent_at``, what was published after its request went out."""
        ctx = self._ctx
        vpn = ctx.vpn
        if vpn is None or not ctx.replicating:
            return
        spared = () if deleted else self._unsettled(vpn.name, queue)
        ctx.out.events.append((Purged(vpn.name, queue, spared, deleted, sent_at), None))

    def connection_lost(self) -> None:
        """The connection is gone, and its exclusive queues with it."""
        vpn = self._ctx.vpn
        if vpn is not None:
            for queue in self.exclusive_queues:
                vpn.topology.delete_queue(queue)
                self._emptied(queue, deleted=True)
        self.exclusive_queues.clear()
