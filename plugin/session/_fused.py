"""The fused publish path: a whole ``basic.publish`` handled in one step.

Most publishes arrive whole in one read (method, content header, one body);
the relay hands such a triple to :meth:`FusedPublish.whole` (a replicated
connection) or :meth:`FusedCheck.whole` (a vhost not replicated) instead of
the general, frame-by-frame path. The invariant: the fused path gives
exactly what the general path would, or declines — everything that can fail
is checked before anything changes, and anything unusual returns
:data:`DECLINED` with every state untouched, so the general path takes the
frames and reports any fault at the exact frame
(``tests/unit/plugin/session/test_session.py`` compares the two paths).
"""

from __future__ import annotations

import enum
import struct

from bridge import RESERVED_PREFIX, Published, amqp
from bridge.amqp import AMQPError, FrameSpan, Method

from ._channel import Channel, ChannelContext
from ._publish import in_scope_queues, stamped

__all__ = ["DECLINED", "PUBLISH_IDS", "Declined", "FusedCheck", "FusedPublish"]


class Declined(enum.Enum):
    """A fused step leaves the frames to the general path."""

    DECLINED = 0


DECLINED = Declined.DECLINED

#: class and method id of basic.publish as they appear in a method frame
PUBLISH_IDS = bytes((0, 60, 0, 40))
#: the layout of a persistent publish without headers (for routing only)
_PERSISTENT = amqp.PropertyLayout(0x1000, 14, 14, 2, 0)
#: distinct (exchange, routing key) pairs remembered per connection
_ROUTES_LIMIT = 1024
_BODY_SIZE = struct.Struct(">Q")

_new_tuple = tuple.__new__


class FusedPublish:
    """Whole publishes of a connection on a replicated vhost (``ctx.vpn``,
    set before this is made)."""

    __slots__ = ("_channels", "_ids", "_routes", "_routes_generation", "_template", "_vpn")

    def __init__(self, ctx: ChannelContext, channels: dict[int, Channel]) -> None:
        assert ctx.vpn is not None  # noqa: S101 - made at connection.open of a replicated vhost
        self._vpn = ctx.vpn
        self._ids = ctx.ids
        self._template = ctx.templates.of
        self._channels = channels
        #: _route's memo, valid for one topology generation
        self._routes: dict[bytes, tuple[str, str, tuple[str, ...]]] = {}
        self._routes_generation = -1

    def whole(
        self, buf: bytes, f: FrameSpan, h: FrameSpan, b: FrameSpan
    ) -> bytes | None | Declined:
        """Method ``f`` (its ids are ``basic.publish``), header ``h``, body ``b``.

        Returns the replacement of the header frame (None: relay all three
        as they are), or ``DECLINED`` — leaving every state untouched — when
        the frames are not one well-formed publish with a single body frame
        on an open channel.
        """
        channel = f.channel
        ch = self._channels.get(channel)
        if (
            f.type != amqp.FRAME_METHOD
            or ch is None
            or ch.closing
            or ch.held is not None
            or ch.publish is not None
            or ch.xa_frozen
            or h.type != amqp.FRAME_HEADER
            or b.type != amqp.FRAME_BODY
            or h.channel != channel
            or b.channel != channel
            or b.end - b.start == 8  # an empty body frame: a zero size has none
        ):
            return DECLINED
        vpn = self._vpn
        try:
            payload = buf[h.start + 7 : h.end - 1]
            template = self._template(payload)
            if _BODY_SIZE.unpack_from(payload, 4)[0] != b.end - b.start - 8:
                return DECLINED
            exchange, routing_key, queues = self._route(buf, f)
            if exchange.startswith(RESERVED_PREFIX) or (
                not exchange and (routing_key.startswith(RESERVED_PREFIX) or template.reserved)
            ):
                return DECLINED  # an XA request, or a refusal: the general path's
            if template.layout.delivery_mode != 2:
                queues = ()
            elif template.layout.flags & 0x2000:  # headers may change the route (CC, BCC, x-match)
                queues = in_scope_queues(vpn, exchange, routing_key, payload, template.layout)
        except AMQPError:
            return DECLINED
        confirms = ch.confirms
        seq = confirms.hold() if confirms is not None else None
        if not queues:
            return None
        repl_id, wire = self._ids.next_with_wire(template.alone)
        properties, header = stamped(template, payload, channel, wire)
        # tuple.__new__: Published's own __new__ is a Python function (hot path)
        event: Published = _new_tuple(
            Published,
            (
                vpn.name,
                repl_id,
                exchange,
                routing_key,
                properties,
                buf[b.start + 7 : b.end - 1],
                queues,
            ),
        )
        ch.record(seq, event)
        return header

    def _route(self, buf: bytes, f: FrameSpan) -> tuple[str, str, tuple[str, ...]]:
        """Exchange, routing key and in-scope queues (for a persistent publish
        without headers) of the basic.publish ``f``, memoised by the raw bytes
        of its exchange and routing key while the topology is unchanged."""
        start = f.start + 13  # frame head, ids, reserved-1
        try:
            end = start + 1 + buf[start]
            end += 1 + buf[end]
        except IndexError as e:
            raise amqp.SyntaxError_("malformed basic.publish", Method.BASIC_PUBLISH) from e
        raw = buf[start:end]
        generation = self._vpn.topology.generation
        if generation != self._routes_generation:
            self._routes.clear()
            self._routes_generation = generation
        hit = self._routes.get(raw)
        if hit is None:
            exchange, routing_key, _ = amqp.decode_publish(buf, f)
            queues = in_scope_queues(self._vpn, exchange, routing_key, b"", _PERSISTENT)
            hit = (exchange, routing_key, queues)
            if len(self._routes) >= _ROUTES_LIMIT:
                self._routes.clear()
            self._routes[raw] = hit
        elif end >= f.end - 1:  # the mandatory/immediate octet is missing
            raise amqp.SyntaxError_("malformed basic.publish", Method.BASIC_PUBLISH)
        return hit


class FusedCheck:
    """Whole publishes of a connection on a vhost that is not replicated:
    the checks of :class:`~plugin.session._checks.FrameChecks` at once.

    ``content``: the frame checker's channels inside content (read only).
    """

    __slots__ = ("_content",)

    def __init__(self, content: dict[int, int]) -> None:
        self._content = content

    def whole(self, buf: bytes, f: FrameSpan, h: FrameSpan, b: FrameSpan) -> None | Declined:
        """None when method ``f`` (its ids are ``basic.publish``), header
        ``h`` and body ``b`` pass every check the frame-by-frame path makes
        and leave its state as it was (a complete publish with one body
        frame on a channel not inside content); else ``DECLINED``."""
        channel = f.channel
        if (
            f.type == amqp.FRAME_METHOD
            and f.end - f.start >= 12
            and channel not in self._content
            and h.type == amqp.FRAME_HEADER
            and h.channel == channel
            and h.end - h.start >= 22
            and b.type == amqp.FRAME_BODY
            and b.channel == channel
            and b.end - b.start > 8
            and _BODY_SIZE.unpack_from(buf, h.start + 11)[0] == b.end - b.start - 8
        ):
            return None
        return DECLINED
