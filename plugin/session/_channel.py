"""One AMQP channel of a client connection through the listener.

The session (``plugin.session._session``) is the connection's reader: it splits the
byte streams, keeps the connection's lifecycle and hands each method on a
channel to that channel's :class:`Channel`, as RabbitMQ's ``rabbit_reader``
hands frames to ``rabbit_channel``. A channel decodes the methods it must
see and remembers what the listener needs per channel: the publish whose
content is on its way, the confirms it holds
(:class:`~plugin.session._confirms.HeldConfirms`), the consumers and gets whose
deliveries it maps to replication ids, the deliveries not settled yet, the
transaction buffer, and the topology requests awaiting the broker's answer.
A handler returns what replaces the frame (None: relay it as it is, b"":
drop it), exactly as the session's own handlers do.

Invariants, and why the code keeps them:

* **A consumption event always follows its publish.** A delivery is mapped
  (:meth:`Channel.on_delivered_header`) when its content header passes,
  before the client can ack it; :meth:`Channel.on_ack` only finds deliveries
  mapped so, and events reach the output in the order frames arrive.
* **Requeues and closes produce no event.** An unacked delivery that
  returns to its queue (nack/reject with requeue, ``basic.recover``, channel
  or connection close) just forgets its mapping.
* **Transactions are all-or-nothing towards the sink.** Events of a
  transactional channel are buffered; ``tx.commit`` is held until the sink
  has prepared them (:meth:`Channel.on_tx_commit`), ``tx.commit-ok`` until
  the sink has committed them; ``tx.rollback`` and a close discard them
  (acks rolled back are restored, as the deliveries stay unacked at the
  broker).
* **An XA request is ours only where nothing counts it.** A publish to
  ``vpnrepl.xa`` on a channel without confirms is taken out of the stream
  (method, header and body) and handed up as an ``XaCall``; on a confirm
  channel it is relayed, since the client numbers that channel's
  publishes. A channel holding an XA branch accepts no ``tx.commit`` or
  ``tx.rollback`` of the client's, and no work once the branch is being
  prepared (406): its broker transaction is what the prepared row holds.
  Our own ``tx.commit``/``tx.rollback`` on it (``xa_broker_commit``,
  ``xa_broker_rollback``) are answered to the branch, their ``-ok`` never
  reaching the client.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pamqp import commands, frame, header
from pamqp.body import ContentBody

from bridge import (
    MARKER_QUEUE,
    REPLICATION_HEADER,
    RESERVED_PREFIX,
    Consumed,
    DeadLettered,
    Event,
    IdSource,
    LocalTransaction,
    Published,
    ReplicationId,
    amqp,
    id_in_header,
)
from bridge.amqp import AMQPError, FrameSpan, Method
from plugin.topology import VpnView
from txn import MarkerKey
from txn.xa import XA_EXCHANGE

from ._actions import Output, XaCall
from ._confirms import HeldConfirms
from ._publish import HeaderTemplate, HeaderTemplates, header_frame, in_scope_queues, stamped
from ._topology_changes import TopologyChange

__all__ = ["Channel", "ChannelContext", "Incoming", "Publish", "commit_marker"]

#: the largest XA request body (a JSON object naming an XA id and a verb:
#: a few hundred bytes)
XA_MAX_BODY = 64 * 1024

#: our entry's name as it stands in a headers table (length octet and name)
_ID_ENTRY_PREFIX = 1 + len(REPLICATION_HEADER)
_ID_SIZE = 8  # an int64 id header's data
_WIRE = struct.Struct(">q")


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


class Channel:
    """The listener's state of one client channel, and what happens to it."""

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

    # -- publishes from the client (the fused path is plugin.session._fused) --------

    def on_publish(self, buf: bytes, f: FrameSpan) -> bytes | None:
        exchange, key, _ = amqp.decode_publish(buf, f)
        if exchange == XA_EXCHANGE and self.ctx.replicating and self.confirms is None:
            # an XA request: no confirm numbering depends on it, so it is ours
            self.publish = Publish(exchange, key, None, control=True)
            return b""
        if self.ctx.replicating and (exchange or key).startswith(RESERVED_PREFIX):
            # (to the default exchange, the routing key names the queue)
            return self.refuse_reserved(f"publish to {exchange or key!r}")
        if self.xa_frozen:
            return self._refuse_work()
        confirms = self.confirms
        seq = None
        if confirms is not None:
            seq = confirms.hold() if self.ctx.replicating else confirms.number()
        self.publish = Publish(exchange, key, seq)
        if not exchange and self.ctx.replicating:
            # to the default exchange, a CC/BCC header names queues: the
            # method waits for its content header to show it names none of ours
            self.publish.method = buf[f.start : f.end]
            return b""
        return None

    def on_content_header(self, buf: bytes, f: FrameSpan) -> bytes | None:
        p = self.publish
        if p is None or p.body_size >= 0:
            raise amqp.FrameOutOfOrder(f"content header on channel {f.channel} without a publish")
        p.body_size = amqp.content_body_size(buf, f)
        if p.control:
            if p.body_size > XA_MAX_BODY:
                # held back from the broker, so no broker limit applies: ours,
                # from the header, before one body byte is buffered
                self.publish = None
                self.close_both_sides(
                    amqp.PreconditionFailed.reply_code,
                    f"an XA request body is at most {XA_MAX_BODY} bytes; this one announces "
                    f"{p.body_size}",
                )
                return b""
            props = amqp.decode_properties(buf, f)
            p.correlation_id, p.reply_to = props.correlation_id, props.reply_to
            if p.body_size == 0:
                self._publish_complete()
            return b""
        if not self.ctx.replicating:
            if p.body_size == 0:
                self._publish_complete()
            return None
        payload = buf[f.start + 7 : f.end - 1]
        template = self.ctx.templates.of(payload)
        method, p.method = p.method, b""
        if method and template.reserved is not None:
            self.publish = None
            return self.refuse_reserved(f"publish with a CC/BCC route {template.reserved!r}")
        replacement = self._stamp(p, payload, template)
        if p.body_size == 0:
            self._publish_complete()
        if method:
            return method + (replacement or buf[f.start : f.end])
        return replacement

    def _stamp(self, p: Publish, payload: bytes, template: HeaderTemplate) -> bytes | None:
        """Decide whether a publish is replicated; splice its id if so."""
        ctx = self.ctx
        vpn = ctx.vpn
        assert vpn is not None  # noqa: S101 - only called when replicated
        queues = in_scope_queues(vpn, p.exchange, p.routing_key, payload, template.layout)
        if not queues:
            return None
        p.repl_id, wire = ctx.ids.next_with_wire(template.alone)
        p.queues = queues
        p.properties, replacement = stamped(template, payload, self.number, wire)
        return replacement

    def on_body(self, buf: bytes, f: FrameSpan) -> bytes | None:
        p = self.publish
        if p is None or p.body_size < 0:
            raise amqp.FrameOutOfOrder(f"content body on channel {f.channel} without a header")
        p.received += f.end - f.start - 8
        if p.received > p.body_size:
            raise amqp.FrameError(
                f"content body of {p.received} bytes exceeds the declared size {p.body_size}"
            )
        if p.repl_id is not None or p.control:
            p.chunks.append(buf[f.start + 7 : f.end - 1])
        if p.received == p.body_size:
            self._publish_complete()
        return b"" if p.control else None

    def _publish_complete(self) -> None:
        p = self.publish
        assert p is not None  # noqa: S101 - caller checked
        self.publish = None
        if p.control:
            body = b"".join(p.chunks)
            call = XaCall(self.number, p.routing_key, p.correlation_id, p.reply_to, body)
            self.ctx.out.xa_calls.append(call)
            return
        vpn = self.ctx.vpn
        if p.repl_id is None or vpn is None:
            return
        event = Published(
            vpn=vpn.name,
            repl_id=p.repl_id,
            exchange=p.exchange,
            routing_key=p.routing_key,
            properties=p.properties,
            body=b"".join(p.chunks),
            queues=p.queues,
        )
        self.record(p.seq, event)

    def record(self, seq: int | None, event: Published) -> None:
        """A replicated publish is complete: into the transaction, or to the
        sink (with its confirm key when its confirm is held)."""
        if self.tx:
            self.tx_events.append(event)
        elif seq is not None and self.confirms is not None:  # a seq means confirms
            self.confirms.replicated(seq, event)
            self.ctx.out.events.append((event, (self.number, seq)))
        else:
            self.ctx.out.events.append((event, None))

    def on_confirm_select(self, buf: bytes, f: FrameSpan) -> bytes | None:
        if self.confirms is None:
            self.confirms = HeldConfirms(self.number)
        return None

    def on_confirm(self, buf: bytes, f: FrameSpan) -> bytes | None:
        """The broker's basic.ack or basic.nack: held while a replicated
        publish is pending, the client's confirms released as they may be."""
        confirms = self.confirms
        if confirms is None or not confirms.pending:
            return None  # nothing replicated is waiting: relay as is
        tag, multiple, _ = amqp.decode_ack(buf, f)
        changed = confirms.broker_answered(tag, multiple, buf[f.payload_start + 3] == 80)
        out = self.ctx.out
        confirms.release(changed, out.to_client, out.events)
        return b""

    # -- consumers and deliveries -------------------------------------------

    def on_consume(self, buf: bytes, f: FrameSpan) -> bytes | None:
        if not self.ctx.replicating:
            return None
        m = amqp.decode_method(buf, f)
        assert isinstance(m, commands.Basic.Consume)  # noqa: S101
        if m.queue.startswith(RESERVED_PREFIX):
            return self.refuse_reserved(f"basic.consume from {m.queue!r}")
        if m.nowait:
            self.consumers[m.consumer_tag] = (m.queue, m.no_ack)
        else:
            self.consumes.append((m.queue, m.no_ack))
        return None

    def on_consume_ok(self, buf: bytes, f: FrameSpan) -> bytes | None:
        if self.consumes:
            m = amqp.decode_method(buf, f)
            assert isinstance(m, commands.Basic.ConsumeOk)  # noqa: S101
            self.consumers[m.consumer_tag or ""] = self.consumes.popleft()
        return None

    def on_cancel(self, buf: bytes, f: FrameSpan) -> bytes | None:
        """The broker's basic.cancel or cancel-ok: the consumer is forgotten;
        its deliveries may still be acked."""
        if self.consumers:
            m = amqp.decode_method(buf, f)
            self.consumers.pop(getattr(m, "consumer_tag", ""), None)
        return None

    def on_get(self, buf: bytes, f: FrameSpan) -> bytes | None:
        if not self.ctx.replicating:
            return None
        m = amqp.decode_method(buf, f)
        assert isinstance(m, commands.Basic.Get)  # noqa: S101
        if m.queue.startswith(RESERVED_PREFIX):
            return self.refuse_reserved(f"basic.get from {m.queue!r}")
        self.gets.append((m.queue, m.no_ack))
        return None

    def on_get_ok(self, buf: bytes, f: FrameSpan) -> bytes | None:
        if not self.ctx.replicating:
            return None
        if self.gets:
            queue, no_ack = self.gets.popleft()
            key = None if no_ack else self._routing_key_kept(queue, buf, f)
            self.incoming = Incoming(queue, amqp.decode_get_ok(buf, f), no_ack, routing_key=key)
        else:
            self.incoming = Incoming(None, 0, True)
        return None

    def on_get_empty(self, buf: bytes, f: FrameSpan) -> bytes | None:
        if self.gets:
            self.gets.popleft()
        return None

    def on_deliver(self, buf: bytes, f: FrameSpan) -> bytes | None:
        if not self.ctx.replicating:
            return None
        consumer_tag, delivery_tag = amqp.decode_deliver(buf, f)
        consumer = self.consumers.get(consumer_tag)
        if consumer is not None:
            queue, no_ack = consumer
            key = None if no_ack else self._routing_key_kept(queue, buf, f)
            self.incoming = Incoming(queue, delivery_tag, no_ack, routing_key=key)
        else:  # a consumer we do not know: its header is still ours to cut
            self.incoming = Incoming(None, delivery_tag, True)
        return None

    def on_return(self, buf: bytes, f: FrameSpan) -> bytes | None:
        if self.ctx.replicating:
            self.incoming = Incoming(None, 0, True, is_return=True)
        return None

    def _routing_key_kept(self, queue: str, buf: bytes, f: FrameSpan) -> str | None:
        """A delivery's routing key, if its queue dead-letters rejects with
        the message's own key (decoded only then)."""
        vpn = self.ctx.vpn
        if vpn is None:
            return None
        target = vpn.topology.dead_letter(queue)
        if target is None or target[1] is not None:
            return None
        m = amqp.decode_method(buf, f)
        return str(getattr(m, "routing_key", ""))

    def on_delivered_header(self, buf: bytes, f: FrameSpan) -> bytes | None:
        """The content header of a message on its way to the client (deliver,
        get-ok, return): the delivery is mapped to its replication id, and
        our id header is cut out of it (unless the VPN exposes it), so the
        consumer sees the properties exactly as the publisher encoded them.
        The entry's bytes are spliced out; nothing else is re-encoded."""
        inc, self.incoming = self.incoming, None
        assert inc is not None  # noqa: S101 - caller checked
        payload = buf[f.payload_start : f.payload_end]
        try:
            layout = amqp.property_layout(payload)
        except AMQPError:
            return None  # not a header we made: the broker's to deliver as it is
        at = amqp.header_entry(payload, layout, REPLICATION_HEADER)
        if at is None:
            return None
        start, end = at
        found = id_in_header(payload[start + _ID_ENTRY_PREFIX : end])
        if found is None:
            return None  # a header of that name that is not one of ours
        repl_id, alone = found
        ctx = self.ctx
        vpn = ctx.vpn
        if vpn is not None and inc.queue is not None and not inc.is_return:
            if inc.no_ack:
                ctx.out.events.append((Consumed(vpn.name, repl_id, inc.queue), None))
            else:
                self.deliveries[inc.delivery_tag] = (repl_id, inc.queue)
                if inc.routing_key is not None:
                    self.routing_keys[inc.delivery_tag] = inc.routing_key
        if not ctx.expose_id:
            payload = amqp.without_entry(payload, layout, start, end, drop_empty=alone)
        elif alone:  # published before the VPN exposed ids: show the plain id
            payload = payload[: end - _ID_SIZE] + _WIRE.pack(repl_id.wire) + payload[end:]
        else:
            return None
        return header_frame(f.channel, payload)

    def on_ack(self, buf: bytes, f: FrameSpan) -> bytes | None:
        """The client's basic.ack, basic.nack or basic.reject: each settled
        delivery becomes a :class:`Consumed` event, or :class:`DeadLettered`
        when a reject dead-letters it; into the transaction if one is open.
        Requeued ones are forgotten."""
        if self.xa_frozen:
            return self._refuse_work()
        deliveries = self.deliveries
        if not deliveries:
            return None
        tag, multiple, requeue = amqp.decode_ack(buf, f)
        rejected = buf[f.payload_start + 3] != 80  # basic.reject or basic.nack
        vpn = self.ctx.vpn
        name = vpn.name if vpn is not None else ""
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
            event: Event = Consumed(name, repl_id, queue)
            if rejected and vpn is not None:
                to = _dead_letter_route(vpn, queue, routing_key)
                if to is not None:
                    event = DeadLettered(name, repl_id, queue, to)
            if self.tx:
                self.tx_events.append(event)
                self.tx_acked[t] = (repl_id, queue)
            else:
                self.ctx.out.events.append((event, None))
        return None

    def on_recover(self, buf: bytes, f: FrameSpan) -> bytes | None:
        """basic.recover: the unacked deliveries come again under new tags."""
        self.deliveries.clear()
        self.routing_keys.clear()
        return None

    def unsettled(self, queue: str) -> Iterator[ReplicationId]:
        """Ids of ``queue``'s messages delivered here and not settled yet
        (acks inside an open transaction included: the broker holds those
        until the commit)."""
        for held in (self.deliveries, self.tx_acked):
            for repl_id, q in held.values():
                if q == queue:
                    yield repl_id

    # -- transactions ---------------------------------------------------------

    def on_tx_select(self, buf: bytes, f: FrameSpan) -> bytes | None:
        self.tx = True
        return None

    def on_tx_commit(self, buf: bytes, f: FrameSpan) -> bytes | None:
        """tx.commit: held until the sink has prepared the transaction (see
        ``Session.transaction_prepared``); passed at once if it replicates
        nothing."""
        if self.xa is not None:
            return self._refuse_tx("tx.commit")
        ctx = self.ctx
        if not self.tx_events or ctx.vpn is None:
            self._forget_tx_acks()
            return None
        self.tx_sequence += 1
        txn = LocalTransaction(
            vpn=ctx.vpn.name,
            connection=ctx.connection_id,
            channel=self.number,
            sequence=self.tx_sequence,
            events=tuple(self.tx_events),
            incarnation=ctx.ids.incarnation,
        )
        self.tx_events.clear()
        self._forget_tx_acks()
        self.tx_prepared = txn
        self.held_commit = buf[f.start : f.end]
        ctx.out.prepare.append(txn)
        return b""

    def on_tx_rollback(self, buf: bytes, f: FrameSpan) -> bytes | None:
        if self.xa is not None:
            return self._refuse_tx("tx.rollback")
        self.tx_events.clear()
        self.deliveries.update(self.tx_acked)  # rolled-back acks: still unacked
        self.tx_acked.clear()
        return None

    def _forget_tx_acks(self) -> None:
        """The transaction's acks are committed: their deliveries are settled."""
        for tag in self.tx_acked:
            self.routing_keys.pop(tag, None)
        self.tx_acked.clear()

    def prepared(self) -> tuple[LocalTransaction, bytes] | None:
        """The transaction the sink has answered for, and its held
        tx.commit (None: no commit is held)."""
        txn, self.tx_prepared = self.tx_prepared, None
        held, self.held_commit = self.held_commit, b""
        return None if txn is None else (txn, held)

    def commit(self, txn: LocalTransaction, held: bytes) -> bytes:
        """The frames that commit the prepared ``txn`` at the broker: the
        commit marker, then the client's held tx.commit."""
        self.tx_committing = txn
        return self._marker(txn.txid) + held

    # -- XA branches (txn.branches drives them through plugin.listener._xa_gateway) --

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

    def xa_take_work(self, xid: str) -> LocalTransaction | None:
        """The replicated events of the channel's transaction, as XA branch
        ``xid``'s transaction (None: nothing replicated); the channel takes
        no more work until the branch ends."""
        self.xa_frozen = True
        ctx = self.ctx
        if not self.tx_events or ctx.vpn is None:
            return None
        self.tx_sequence += 1
        txn = LocalTransaction(
            vpn=ctx.vpn.name,
            connection=ctx.connection_id,
            channel=self.number,
            sequence=self.tx_sequence,
            events=tuple(self.tx_events),
            incarnation=ctx.ids.incarnation,
            xid=xid,
        )
        self.tx_events.clear()
        self.xa_acked = dict(self.tx_acked)
        self._forget_tx_acks()
        return txn

    def xa_unbind(self) -> None:
        """The branch is over: the channel's next transaction is its own."""
        self.xa, self.xa_frozen, self.xa_waiter = None, False, None
        self.xa_acked = {}

    def xa_broker_commit(self, txid: str | None, answer: Callable[[bool], None]) -> bytes:
        """The frames committing the branch's broker transaction (behind
        ``txid``'s marker); ``answer`` hears of the commit-ok."""
        self.xa_waiter = answer
        commit = amqp.marshal_method(commands.Tx.Commit(), self.number)
        return commit if txid is None else self._marker(txid) + commit

    def _marker(self, txid: str) -> bytes:
        vpn = self.ctx.vpn
        assert vpn is not None  # noqa: S101 - only a replicated VPN's transactions have markers
        return commit_marker(self.number, self.ctx.marker_key.body(vpn.name, txid))

    def xa_broker_rollback(self, answer: Callable[[bool], None]) -> bytes:
        """The frame rolling the branch's broker transaction back."""
        self.xa_waiter = answer
        return amqp.marshal_method(commands.Tx.Rollback(), self.number)

    def _xa_answered(self, ok: bool) -> bytes | None:
        """The broker's answer to our tx.commit or tx.rollback: swallowed."""
        waiter, self.xa_waiter = self.xa_waiter, None
        if waiter is None:
            return None
        if ok:
            self.tx_events.clear()
        waiter(True)
        return b""

    def on_tx_rollback_ok(self, buf: bytes, f: FrameSpan) -> bytes | None:
        if self.xa_waiter is None:
            return None
        # the rolled-back acks: their deliveries are unacked again
        self.deliveries.update(self.xa_acked)
        self.deliveries.update(self.tx_acked)
        self.tx_acked.clear()
        self.xa_acked = {}
        return self._xa_answered(True)

    def on_tx_commit_ok(self, buf: bytes, f: FrameSpan) -> bytes | None:
        if self.xa_waiter is not None:
            self._forget_tx_acks()
            return self._xa_answered(True)
        txn = self.commit_ok()
        if txn is None:
            return None
        self.ctx.out.commit.append(txn)
        return b""  # held until the sink has committed

    def commit_ok(self) -> LocalTransaction | None:
        """The broker's tx.commit-ok: the transaction it committed (None:
        not one of ours)."""
        txn, self.tx_committing = self.tx_committing, None
        return txn

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

    # -- held frames and the close handshake -------------------------------

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
        swallowed when they come (:meth:`on_closing_frame`)."""
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

    def on_closing_frame(self, buf: bytes, f: FrameSpan, client: bool) -> bytes | None:
        """A frame on a closing channel, from the client or the broker: only
        the close handshake matters. When it is over, the channel tells its
        session (``ctx.closed``)."""
        ids = amqp.method_id(buf, f) if f.type == amqp.FRAME_METHOD else None
        out = self.ctx.out
        if ids == Method.TX_COMMIT_OK and not client:
            # the broker committed before the close: the transaction stands
            txn = self.commit_ok()
            if txn is not None:
                out.commit.append(txn)
        if not self.closed_by_us:
            if ids == Method.CHANNEL_CLOSE_OK:
                self.gone()
                self.ctx.closed(self, b"")
            return None
        if client and self.reopening is not None:
            # the client is done with the old channel and may reuse its number
            # (pika does at once); the broker is not done yet: hold it
            self.reopening.append(buf[f.start : f.end])
        elif ids == Method.CHANNEL_CLOSE and client:  # the client closed too: answer it
            out.to_client.append(amqp.marshal_method(commands.Channel.CloseOk(), self.number))
        elif ids == Method.CHANNEL_CLOSE_OK:
            self.closed_by_us -= 1
            if client:
                self.reopening = []
            if not self.closed_by_us:
                self.ctx.closed(self, b"".join(self.reopening or ()))
        return b""  # nothing of ours reaches the other side any more


def _dead_letter_route(vpn: VpnView, queue: str, routing_key: str) -> tuple[str, ...] | None:
    """The in-scope queues a message rejected from ``queue`` goes to (None:
    the queue does not dead-letter). Routed as RabbitMQ routes a
    dead-lettered message, with the queue's dead-letter routing key or the
    message's own; without its headers (a headers exchange as the
    dead-letter exchange, or CC headers, are not followed)."""
    target = vpn.topology.dead_letter(queue)
    if target is None:
        return None
    exchange, key = target
    key = routing_key if key is None else key
    routed = vpn.topology.route(exchange, key, None)
    return tuple(sorted(vpn.scope.in_scope(exchange, key, routed)))


def commit_marker(channel: int, body: bytes) -> bytes:
    """A persistent publish of a marker's ``body`` to
    :data:`~bridge.MARKER_QUEUE`: method, content header and body frames."""
    return b"".join(
        (
            amqp.marshal_method(
                commands.Basic.Publish(exchange="", routing_key=MARKER_QUEUE), channel
            ),
            frame.marshal(
                header.ContentHeader(
                    body_size=len(body),
                    properties=commands.Basic.Properties(delivery_mode=2),
                ),
                channel,
            ),
            frame.marshal(ContentBody(body), channel),
        )
    )
