"""The state of one client channel through the listener, and how it ends.

Every part of :class:`~plugin.session._channel.Channel` reads and writes the
one state declared here, in one ``__slots__``. Invariants: a channel we
close (:meth:`ChannelState.close_both_sides`: a refused transaction, a
reserved name, work on an ended XA branch) is closed towards the client
with its reply code and towards the broker with 200, and both close-oks are
swallowed, so neither side is answered a close it did not send; and nothing
a channel held outlives it silently (:meth:`ChannelState.gone`): a
transaction whose ``tx.commit`` reached the broker without its commit-ok is
left to its marker (``unresolved``), one being prepared is aborted, an XA
branch on it told.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pamqp import commands

from bridge import RESERVED_PREFIX, Event, IdSource, LocalTransaction, ReplicationId, amqp
from plugin.topology import VpnView
from txn import MarkerKey

from ._actions import Output
from ._confirms import HeldConfirms
from ._publish import HeaderTemplates
from ._topology_changes import TopologyChange

if TYPE_CHECKING:
    from ._channel import Channel

__all__ = ["ChannelContext", "ChannelState", "Incoming", "Publish"]


class ChannelContext:
    """What the channels of one connection share: the VPN and its settings,
    which the session sets at connection.open; ``out``, the output of the
    call the session is being fed; and the session's ``closed``."""

    __slots__ = (
        "closed",
        "connection_id",
        "expose_id",
        "ids",
        "marker_key",
        "out",
        "replicating",
        "templates",
        "vpn",
    )

    def __init__(
        self,
        ids: IdSource,
        connection_id: int,
        closed: Callable[[Channel, bytes], None],
        marker_key: MarkerKey,
    ) -> None:
        self.ids = ids
        #: tags the commit markers (the site's key: recovery checks the tags)
        self.marker_key = marker_key
        self.connection_id = connection_id
        #: a channel's close handshake is over: its number is free, and the
        #: bytes (the client's frames on it meanwhile) are to be relayed now
        self.closed = closed
        self.vpn: VpnView | None = None
        #: the VPN is active here: fixed at connection.open (settings apply
        #: to new connections)
        self.replicating = False
        #: the VPN shows consumers our id header (``vpn enable --expose-id``)
        self.expose_id = False
        self.templates = HeaderTemplates(expose_id=False)
        self.out = Output()


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
    #: an XA request (to ``vpnrepl.xa``): taken out of the stream
    control: bool = False
    correlation_id: str | None = None
    reply_to: str | None = None
    #: the method frame, held from the broker until the content header
    #: shows where the publish goes (to the default exchange)
    method: bytes = b""


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


class ChannelState:
    """The listener's state of one client channel, and how the channel ends."""

    __slots__ = (
        "closed_by_us",
        "closing",
        "confirms",
        "consumers",
        "consumes",
        "ctx",
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
        "xa",
        "xa_acked",
        "xa_frozen",
        "xa_waiter",
    )

    def __init__(self, number: int, ctx: ChannelContext) -> None:
        self.number = number
        self.ctx = ctx
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
        self.confirms: HeldConfirms | None = None
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
        #: the XA branch whose work this channel's transaction is (its id)
        self.xa: str | None = None
        #: the branch is being prepared or is prepared: no more work here
        self.xa_frozen = False
        #: the prepared branch's acks: unacked again if it is rolled back
        self.xa_acked: dict[int, tuple[ReplicationId, str]] = {}
        #: told of the broker's answer to our tx.commit or tx.rollback
        #: (True), or of the channel's end before it (False)
        self.xa_waiter: Callable[[bool], None] | None = None
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

    # -- refusals of ours -----------------------------------------------------

    def refuse_reserved(self, what: str) -> bytes:
        """A client's method on a name the product reserves (its commit
        markers steer crash recovery): the channel is closed, 403, and the
        method never reaches the broker."""
        self.close_both_sides(
            amqp.AccessRefused.reply_code,
            f"ACCESS_REFUSED - {what}: names starting with {RESERVED_PREFIX!r} are "
            "vpn-replication's own",
        )
        return b""

    def _refuse_work(self) -> bytes:
        """Work on a channel whose XA branch is prepared (or being prepared)
        would join a broker transaction the prepared row does not hold."""
        self.close_both_sides(
            amqp.PreconditionFailed.reply_code,
            f"XA branch {self.xa} is ended: no more work on its channel before its commit"
            " or rollback",
        )
        return b""

    def _refuse_tx(self, what: str) -> bytes:
        self.close_both_sides(
            amqp.PreconditionFailed.reply_code,
            f"{what} on a channel holding XA branch {self.xa}: commit or roll it back with XA",
        )
        return b""

    # -- held frames and the end ----------------------------------------------

    def hold_frames(self) -> None:
        """The client's later frames wait for the broker's answer to the
        request just sent."""
        self.held = []

    def release_held(self) -> bytes:
        """The frames that waited (b"": none)."""
        held, self.held = self.held, None
        return b"".join(held) if held else b""

    def close_both_sides(self, code: int, text: str) -> None:
        """Close the channel towards the client (``code`` and ``text``) and
        the broker (200): a channel exception of ours. Both close-oks are
        swallowed when they come
        (:meth:`~plugin.session._channel.Channel.on_closing_frame`)."""
        out = self.ctx.out
        out.to_client.append(
            amqp.marshal_method(
                commands.Channel.Close(reply_code=code, reply_text=text, class_id=90, method_id=20),
                self.number,
            )
        )
        out.to_broker.append(
            amqp.marshal_method(
                commands.Channel.Close(
                    reply_code=200, reply_text="channel closed by vpnrepl", class_id=0, method_id=0
                ),
                self.number,
            )
        )
        self.closing = True
        self.closed_by_us = 2
        self.gone()

    def gone(self) -> None:
        """The channel is closed (or its connection lost): a transaction
        whose tx.commit reached the broker without its commit-ok coming back
        is left to its marker (``unresolved``), one still being prepared is
        aborted."""
        out = self.ctx.out
        if self.xa is not None:
            out.xa_gone.append(self.number)
            waiter, self.xa_waiter = self.xa_waiter, None
            if waiter is not None:
                waiter(False)
        if self.tx_committing is not None:
            out.unresolved.append(self.tx_committing)
            self.tx_committing = None
        if self.tx_prepared is not None:
            out.abort.append(self.tx_prepared)
            self.tx_prepared = None
