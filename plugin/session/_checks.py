"""Frame checks for a connection on a vhost that is not replicated.

After ``connection.open-ok`` the session tracks none of such a connection's
frames, but it still checks the client's (:class:`FrameChecks`), so a client
gets the same reply codes on every vhost: RabbitMQ 3.10 itself drops the TCP
connection on an unknown method and accepts a body longer than declared.
The invariant: a channel's content follows its publish exactly — a content
header only right after a ``basic.publish``, bodies only up to the declared
size, no method while content is due (505, 501; an unknown method 503, a
heartbeat on a channel 501). Per channel only the body size still due is kept.
"""

from __future__ import annotations

from collections.abc import Callable

from bridge import amqp
from bridge.amqp import FrameSpan, Method

__all__ = ["FrameChecks"]


class FrameChecks:
    """The checks of one connection's client frames. ``client_closed`` is
    called when the client's ``connection.close`` passes."""

    __slots__ = ("_client_closed", "_received", "content")

    def __init__(self, client_closed: Callable[[], None]) -> None:
        self._client_closed = client_closed
        #: channel -> declared body size (-1: the content header is due)
        self.content: dict[int, int] = {}
        #: channel -> body bytes received so far
        self._received: dict[int, int] = {}

    def check(self, buf: bytes, f: FrameSpan) -> None:
        """Check frame ``f`` of ``buf``; raises the AMQPError of its fault."""
        ftype, channel = f.type, f.channel
        expect = self.content
        if ftype == amqp.FRAME_METHOD:
            self._check_method(amqp.method_id(buf, f), channel)
        elif ftype == amqp.FRAME_BODY:
            due = expect.get(channel, -1)
            if due < 0:
                raise amqp.FrameOutOfOrder(f"content body on channel {channel} without a header")
            got = self._received.get(channel, 0) + f.end - f.start - 8
            if got > due:
                raise amqp.FrameError(
                    f"content body of {got} bytes exceeds the declared size {due}"
                )
            if got < due:
                self._received[channel] = got
            else:
                del expect[channel]
                self._received.pop(channel, None)
        elif ftype == amqp.FRAME_HEADER:
            if expect.get(channel) != -1:
                raise amqp.FrameOutOfOrder(f"content header on channel {channel} without a publish")
            size = amqp.content_body_size(buf, f)
            if size:
                expect[channel] = size
            else:
                del expect[channel]
        elif channel != 0:
            raise amqp.FrameError(f"heartbeat frame on channel {channel}")
        return None

    def _check_method(self, ids: tuple[int, int], channel: int) -> None:
        if channel in self.content:
            raise amqp.FrameOutOfOrder(
                f"method frame on channel {channel} while content was expected"
            )
        if ids == Method.BASIC_PUBLISH:
            self.content[channel] = -1
        elif ids == Method.CONNECTION_CLOSE and channel == 0:
            self._client_closed()
