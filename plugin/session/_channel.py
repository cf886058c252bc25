"""One AMQP channel of a client connection through the listener: its
publishes, their confirms, and its close handshake.

The session hands each method on a channel to that channel's
:class:`Channel`, one class in parts, a module each: its state and its end
(``plugin.session._channel_state``), consumers and deliveries
(``plugin.session._deliveries``), transactions and XA branches
(``plugin.session._transactions``), and this one. A handler returns what
replaces the frame (None: relay it as it is, b"": drop it).

Invariants: a replicated publish becomes an event once its content is whole
(a body past the declared size is 501), its confirm held until the sink has
it durable (:class:`~plugin.session._confirms.HeldConfirms`); and a publish
to ``vpnrepl.xa`` is taken out of the stream only on a channel without
confirms, since on a confirm channel the client numbers it.
"""

from __future__ import annotations

from pamqp import commands

from bridge import RESERVED_PREFIX, Published, amqp
from bridge.amqp import FrameSpan, Method
from txn.xa import XA_EXCHANGE

from ._actions import XaCall
from ._channel_state import ChannelContext, Publish
from ._confirms import HeldConfirms
from ._deliveries import ChannelDeliveries
from ._publish import HeaderTemplate, in_scope_queues, stamped
from ._transactions import ChannelTransactions

__all__ = ["Channel", "ChannelContext"]

#: the largest XA request body (a JSON object naming an XA id and a verb:
#: a few hundred bytes)
XA_MAX_BODY = 64 * 1024


class Channel(ChannelDeliveries, ChannelTransactions):
    """The listener's state of one client channel, and what happens to it."""

    __slots__ = ()

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

    # -- the close handshake ----------------------------------------------------

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
