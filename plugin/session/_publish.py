"""A client's publish on a replicated connection: its queues and our id header.

Both publish paths use these. A publish is replicated when it is persistent
and reaches a queue in the VPN's scope (:func:`in_scope_queues`); it then
carries our id header (:data:`~bridge.REPLICATION_HEADER`), spliced into the
client's content header (:func:`stamped`) from a :class:`HeaderTemplate`,
made with :func:`~bridge.amqp.splice_header` once per distinct property
bytes and split around the id's eight bytes, so each message gets exactly
the bytes splicing would give (docs/behaviour.md, "The id header is
invisible to consumers"). Making a template checks its headers table, for
every publish, persistent or not: RabbitMQ 3.10 crashes the channel on a
headers table it cannot parse.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from bridge import REPLICATION_HEADER, RESERVED_PREFIX, amqp
from plugin.topology import Refused, VpnView, header_routes

__all__ = ["HeaderTemplate", "HeaderTemplates", "header_frame", "in_scope_queues", "stamped"]

#: distinct content-header property byte strings remembered per connection
_TEMPLATES_LIMIT = 256
#: class 60 (basic), weight 0: the first four bytes of a valid content header
_BASIC_NO_WEIGHT = bytes((0, 60, 0, 0))
#: stands for the id while a header template is made (an int64, like an id)
_ID_PLACEHOLDER = amqp.long_field(0)
_ID_SIZE = 8  # the placeholder's data, replaced per message
_HEADER_FRAME_HEAD = struct.Struct(">BHI")


class HeaderTemplate(NamedTuple):
    """A checked content header's layout and its property bytes with our id
    header spliced in: ``before_id + id (int64) + after_id``; ``alone``: the
    headers table is ours alone (the id's value says so, see
    :data:`~bridge.REPLICATION_HEADER`); ``reserved``: the first ``CC`` or
    ``BCC`` route naming one of the product's queues (on the default
    exchange such a publish would reach it), else None."""

    layout: amqp.PropertyLayout
    before_id: bytes
    after_id: bytes
    alone: bool
    reserved: str | None


class HeaderTemplates:
    """The templates of one connection, memoised by property bytes (a
    publisher sends the same properties again and again).

    ``expose_id``: the VPN shows consumers our id header, so a table that is
    ours alone is not marked as such (it is not cut out again)."""

    __slots__ = ("_expose_id", "_memo")

    def __init__(self, expose_id: bool) -> None:
        self._expose_id = expose_id
        self._memo: dict[bytes, HeaderTemplate] = {}

    def of(self, payload: bytes) -> HeaderTemplate:
        """The template of a content header's ``payload`` (class, weight,
        body size, properties); raises AMQPError if it does not parse."""
        if payload[:4] == _BASIC_NO_WEIGHT:
            hit = self._memo.get(payload[12:])
            if hit is not None:
                return hit
        layout = amqp.property_layout(payload)
        reserved = None
        if layout.flags & 0x2000:
            # checked for every publish, persistent or not: RabbitMQ 3.10
            # crashes the channel on a headers table it cannot parse
            reserved = _reserved_route(amqp.decode_headers(payload, layout))
        spliced = amqp.splice_header(payload, layout, REPLICATION_HEADER, _ID_PLACEHOLDER)
        # our entry ends the headers table; what follows the table is unchanged
        end = len(spliced) - (len(payload) - layout.headers_end)
        at = end - _ID_SIZE
        alone = not layout.flags & 0x2000 and not self._expose_id
        template = HeaderTemplate(layout, spliced[12:at], spliced[end:], alone, reserved)
        if len(self._memo) >= _TEMPLATES_LIMIT:
            self._memo.clear()
        self._memo[payload[12:]] = template
        return template


def _reserved_route(headers: dict[str, object] | None) -> str | None:
    if not headers:
        return None
    try:
        routes = header_routes(headers)
    except Refused:
        return None  # the broker refuses the publish itself
    return next((r for r in routes if r.startswith(RESERVED_PREFIX)), None)


def stamped(
    template: HeaderTemplate, payload: bytes, channel: int, wire: bytes
) -> tuple[bytes, bytes]:
    """The properties with an id in our header (``wire``: its int64 header
    value, 8 bytes), and the content header frame carrying them (class,
    weight and body size as the client sent)."""
    properties = template.before_id + wire + template.after_id
    frame = b"".join(
        (
            _HEADER_FRAME_HEAD.pack(amqp.FRAME_HEADER, channel, 12 + len(properties)),
            payload[:12],
            properties,
            b"\xce",
        )
    )
    return properties, frame


def header_frame(channel: int, payload: bytes) -> bytes:
    """A content header frame around ``payload`` (class, weight, body size
    and properties)."""
    return b"".join(
        (_HEADER_FRAME_HEAD.pack(amqp.FRAME_HEADER, channel, len(payload)), payload, b"\xce")
    )


def in_scope_queues(
    vpn: VpnView, exchange: str, routing_key: str, payload: bytes, layout: amqp.PropertyLayout
) -> tuple[str, ...]:
    """The in-scope queues a publish reaches if it is persistent, sorted
    (empty: the publish is not replicated)."""
    if layout.delivery_mode != 2:
        return ()
    headers = amqp.decode_headers(payload, layout) if layout.flags & 0x2000 else None
    routed = vpn.topology.route(exchange, routing_key, headers)
    if not routed:
        return ()
    queues = vpn.scope.in_scope(exchange, routing_key, routed)
    if len(queues) == 1:
        return tuple(queues)
    return tuple(sorted(queues))
