"""The client's side of a connection whose broker cannot be reached.

A client expects ``connection.start`` after its protocol header; closing
the socket instead looks like a network fault, and some clients retry at
once. So the listener plays the server's first step, and answers the
client's ``start-ok`` with ``connection.close`` 320 naming the reason. The
invariant: **the client always gets an AMQP answer it can parse**: our
protocol header for a wrong one, else ``connection.start`` and then the
close; nothing reaches any broker.
"""

from __future__ import annotations

from pamqp import commands

from bridge import amqp
from bridge.amqp import AMQPError, FrameSplitter, Method

__all__ = ["HANDSHAKE_FRAME_MAX", "BrokerUnavailable", "TooManyConnections"]

#: frame-max before tune-ok: RabbitMQ's own ceiling for handshake frames.
HANDSHAKE_FRAME_MAX = 131072


class BrokerUnavailable:
    """Refuse a client cleanly when the broker cannot be reached."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        #: the close's text (320, so a client tries again or elsewhere)
        self.text = f"broker unavailable: {reason}"
        self._header = b""
        self._splitter = FrameSplitter(HANDSHAKE_FRAME_MAX)
        self.done = False

    def client_data(self, data: bytes) -> list[bytes]:
        out: list[bytes] = []
        if self.done:
            return out
        if len(self._header) < 8:
            need = 8 - len(self._header)
            self._header += data[:need]
            data = data[need:]
            if len(self._header) < 8:
                return out
            if self._header != amqp.PROTOCOL_HEADER:
                self.done = True
                return [amqp.PROTOCOL_HEADER]
            start = commands.Connection.Start(
                server_properties={"product": "vpnrepl"},
                mechanisms="PLAIN AMQPLAIN",
                locales="en_US",
            )
            out.append(amqp.marshal_method(start, 0))
        buf, frames, fault = self._splitter.feed(data)
        if fault is not None:
            self.done = True
            return out
        for f in frames:
            if f.type == amqp.FRAME_METHOD and f.channel == 0:
                try:
                    ids = amqp.method_id(buf, f)
                except AMQPError:
                    ids = (0, 0)
                if ids == Method.CONNECTION_CLOSE_OK:
                    self.done = True
                elif ids in (
                    Method.CONNECTION_START_OK,
                    Method.CONNECTION_CLOSE,
                ):  # or the client gives up
                    error = amqp.ConnectionForced(self.text)
                    close = commands.Connection.Close(
                        reply_code=error.reply_code,
                        reply_text=error.reply_text,
                        class_id=0,
                        method_id=0,
                    )
                    out.append(amqp.marshal_method(close, 0))
        return out


class TooManyConnections(BrokerUnavailable):
    """Refuse a client cleanly when this listener holds its maximum of
    client connections (``listen.max_connections``): the same AMQP answer,
    320 with the reason, and no broker connection is made."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"{limit} client connections")
        self.text = (
            f"this vpnrepl listener has {limit} client connections open already "
            "(listen.max_connections): try again later, or another of the site's nodes"
        )
