"""A client channel's consumers and deliveries: each delivery mapped to its
replication id, each settlement a replication event.

A part of :class:`~plugin.session._channel.Channel`. A consumer's or a get's
queue is remembered from the request, each delivery mapped to the id in its
content header (cut out on the way unless the VPN exposes it), and the
client's ack, nack or reject becomes a :class:`~bridge.Consumed` or
:class:`~bridge.DeadLettered` event. A consumption event always follows its
publish: a delivery is mapped when its header passes, before the client can
ack it, and events leave in the order frames arrive. A requeue or a close
only forgets the mapping (docs/behaviour.md, "The AMQP listener").
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from pamqp import commands

from bridge import (
    REPLICATION_HEADER,
    RESERVED_PREFIX,
    Consumed,
    DeadLettered,
    Event,
    ReplicationId,
    amqp,
    id_in_header,
)
from bridge.amqp import AMQPError, FrameSpan
from plugin.topology import VpnView

from ._channel_state import ChannelState, Incoming
from ._publish import header_frame

__all__ = ["ChannelDeliveries"]

#: our entry's name as it stands in a headers table (length octet and name)
_ID_ENTRY_PREFIX = 1 + len(REPLICATION_HEADER)
_ID_SIZE = 8  # an int64 id header's data
_WIRE = struct.Struct(">q")


class ChannelDeliveries(ChannelState):
    """A channel's consumers, gets and unsettled deliveries."""

    __slots__ = ()

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
        if (
            vpn is not None
            and inc.queue is not None
            and not inc.is_return
            # a stream's consumers read from an offset: their acks remove nothing
            and not vpn.topology.keeps_consumed(inc.queue)
        ):
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
