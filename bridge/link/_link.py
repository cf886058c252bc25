"""One bridge connection's socket: TCP or TLS, framing, heartbeats, and the
errors of the link.

A :class:`Link` carries one sans-IO :class:`~bridge.BridgeConnection` over
an asyncio stream. Invariant: the bytes on the wire are exactly the frames
the protocol accepted, in the order it accepted them — :meth:`Link.send`
checks a frame and writes its bytes in the same step, with no ``await`` in
between. Socket and TLS errors become :class:`LinkError` here and nowhere
else, so the active and standby sides above see one taxonomy: the peer was
unreachable, refused TLS, went silent, or closed the link. (asyncio sets
TCP_NODELAY on every TCP socket it creates.)
"""

from __future__ import annotations

import asyncio
import ssl

import psycopg

from bridge._errors import BridgeError, LocalProtocolError, RemoteProtocolError
from bridge._settings import HostPort
from bridge.wire import NEED_DATA, BridgeConnection, Error, Frame, Heartbeat, Sentinel

from ._tls import describe_tls_error

__all__ = [
    "Link",
    "LinkClosed",
    "LinkError",
    "PeerSilent",
    "PeerUnreachable",
    "TlsRefused",
    "describe_error",
    "dial",
    "peer_address",
]

_READ_SIZE = 256 * 1024


class LinkError(BridgeError):
    """The link to the peer could not be made or broke; the standby reconnects
    (with back-off) and resynchronises from its applied index."""


class PeerUnreachable(LinkError):
    """No TCP connection to the peer's bridge address."""


class TlsRefused(LinkError):
    """The TLS handshake failed: a certificate one side does not trust, or
    a peer that hung up during or right after the handshake."""


class PeerSilent(LinkError):
    """Nothing arrived from the peer for longer than the heartbeat timeout."""


class LinkClosed(LinkError):
    """The peer closed or reset the connection."""


def describe_error(e: BaseException) -> str:
    """An error in one line, without statement data."""
    if isinstance(e, psycopg.Error):
        text = e.diag.message_primary or (str(e).strip().splitlines() or [""])[0]
        return f"database: {text or type(e).__name__}"
    if isinstance(e, BridgeError):
        return str(e)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def peer_address(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return str(HostPort(str(peer[0]), int(peer[1])))
    return str(peer or "?")


async def dial(
    peer: HostPort, context: ssl.SSLContext | None, within: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to ``peer`` (TLS with ``context``) within ``within``
    seconds, or a :class:`LinkError`."""
    try:
        async with asyncio.timeout(within):
            return await asyncio.open_connection(peer.host, peer.port, ssl=context)
    except TimeoutError as e:
        raise PeerUnreachable(f"no answer within {within:g} s") from e
    except ssl.SSLError as e:
        raise TlsRefused(f"TLS handshake with the active failed: {describe_tls_error(e)}") from e
    except OSError as e:
        raise PeerUnreachable(f"cannot connect: {e.strerror or e}") from e


class Link:
    """One TCP (TLS) connection carrying one :class:`BridgeConnection`."""

    def __init__(
        self,
        conn: BridgeConnection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str,
        heartbeat_timeout: float,
    ) -> None:
        self.conn = conn
        self.reader = reader
        self.writer = writer
        self.peer = peer
        self.heartbeat_timeout = heartbeat_timeout

    @property
    def plain(self) -> bool:
        """The link is plain TCP, not TLS."""
        return self.writer.get_extra_info("sslcontext") is None

    def send(self, frame: Frame) -> None:
        if self.writer.is_closing():
            raise LinkClosed("the link is closed")
        self.writer.write(self.conn.send(frame))

    def try_send(self, frame: Frame) -> bool:
        """Send ``frame`` if the protocol and the link allow it now."""
        try:
            self.send(frame)
        except (LocalProtocolError, LinkError):
            return False
        return True

    async def flush(self) -> None:
        """Wait until the transport's buffer is below its high-water mark."""
        try:
            await self.writer.drain()
        except ssl.SSLError as e:
            raise TlsRefused(describe_tls_error(e)) from e
        except (ConnectionError, OSError) as e:
            raise LinkClosed(e.strerror or describe_error(e)) from e

    async def next_frame(self) -> Frame | RemoteProtocolError | None:
        """The next frame, a VPN-level fault the caller handles (the frame
        was discarded), or None when the conversation is over. Faults that
        close the connection are raised."""
        while True:
            try:
                event = self.conn.next_event()
            except RemoteProtocolError as e:
                if e.closes_connection:
                    raise
                return e
            if event is NEED_DATA:
                self.conn.receive_data(await self._receive())
                continue
            if isinstance(event, Sentinel):  # CLOSED
                return None
            return event

    async def _receive(self) -> bytes:
        try:
            async with asyncio.timeout(self.heartbeat_timeout):
                return await self.reader.read(_READ_SIZE)
        except TimeoutError as e:
            raise PeerSilent(f"nothing received for {self.heartbeat_timeout:g} s") from e
        except ssl.SSLError as e:
            raise TlsRefused(describe_tls_error(e)) from e
        except (ConnectionError, OSError) as e:
            raise LinkClosed(e.strerror or describe_error(e)) from e

    async def heartbeats(self, interval: float) -> None:
        """Send a Heartbeat every ``interval`` once the protocol allows it."""
        while not self.writer.is_closing():
            self.try_send(Heartbeat())
            await asyncio.sleep(interval)

    def fail(self, exc: BridgeError) -> None:
        """Tell the peer why (connection-level Error), then close."""
        self.try_send(Error.from_exception(exc, vpn=""))
        self.writer.close()

    def abort(self) -> None:
        self.writer.transport.abort()

    async def close(self) -> None:
        """Close after flushing what is buffered, for at most two seconds: a
        peer that reads nothing any more must not keep the socket open."""
        if not self.writer.is_closing():
            self.writer.close()
        try:
            async with asyncio.timeout(2.0):
                await self.writer.wait_closed()
        except TimeoutError:
            self.abort()
        except (ConnectionError, OSError, ssl.SSLError):
            pass
