"""What a VPN's commit-marker stream holds, read as an operator would."""

from __future__ import annotations

import pika

from bridge import MARKER_QUEUE


def marker_bodies(url: str) -> list[bytes]:
    """Every message in the marker stream of ``url``'s vhost, oldest first
    (a stream read from its start: nothing is taken)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=1000)
        bodies = []
        for method, _props, body in ch.consume(
            MARKER_QUEUE, arguments={"x-stream-offset": "first"}, inactivity_timeout=1.0
        ):
            if method is None:
                break
            bodies.append(body)
            ch.basic_ack(method.delivery_tag)
        return bodies
    finally:
        conn.close()


def marker_names(url: str) -> list[str]:
    """The names of the markers in the stream (tags dropped; probes left out)."""
    names = [body.decode().rpartition(" ")[0] for body in marker_bodies(url)]
    return [name for name in names if not name.startswith("#probe/")]
