"""A server socket that sees its refused TLS handshakes (the AMQPS listener,
the bridge).

Invariant: with a TLS configuration a client reaches the protocol only after
a completed handshake ``context`` accepted, and each refused handshake is
one WARNING line naming the peer and the reason (no traceback, no call to
the loop's exception handler). With ``plaintext_too`` (a pair moving to
mutual TLS, README) it serves both, told apart by the first octet, peeked
before any transport owns the socket: 0x16 opens every TLS handshake, and
no bridge frame starts with it.

``loop.create_server(ssl=...)`` hides a failed handshake from the
application, and ``loop.start_tls`` on an accepted connection loses a
ClientHello that uvloop reads first; so this class accepts the sockets (a
reader callback: no accept in flight when the server closes) and hands each
to ``loop.connect_accepted_socket(ssl=...)``, which reads nothing before the
TLS layer is in place. Closing the server closes the sockets no transport
owns yet and waits until the transports have released the others.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
import weakref
from collections.abc import Callable

from bridge._settings import HostPort, TlsConfig
from bridge._tasks import BackgroundTasks

from ._tls import describe_tls_error, make_server_context

__all__ = ["TLS_RECORD", "TLS_SHUTDOWN_TIMEOUT", "TlsServer"]

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
BACKLOG = 100
#: connections in their TLS handshake (or, moving to TLS, before their first
#: octet) at once; past it a new one is closed at once
MAX_PENDING = 1024
#: how long a closing connection waits for the client's TLS close_notify
TLS_SHUTDOWN_TIMEOUT = 3.0
#: how long accepting pauses when the process is out of file descriptors
#: (asyncio's own servers pause as long)
ACCEPT_RETRY_DELAY = 1.0
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
#: the first octet of a TLS handshake record
TLS_RECORD = 0x16


def _address(addr: object) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return str(HostPort(str(addr[0]), int(addr[1])))
    return str(addr)


class TlsServer:
    """Listens on ``host:port``; each connection gets a TLS handshake with
    the certificate and key of ``tls`` (TLS 1.2 or later; with ``tls.ca``,
    a client certificate signed by it is required), then ``factory()``'s
    protocol over the TLS transport. ``tls`` None: plain TCP;
    ``plaintext_too``: TLS or plain TCP, as the client opens (module
    docstring). ``peer``: how log lines name a client (``client``, or the
    bridge's ``standby at``), ``whose`` its certificate; ``hangup_hint``:
    said when a client hangs up during the handshake (else that is logged
    at DEBUG only: a TCP health check does it). ``max_pending``: how many
    connections may be in their handshake at once (a stranger cannot hold
    more sockets open than that, each for the handshake deadline)."""

    def __init__(
        self,
        what: str,
        tls: TlsConfig | None,
        factory: Callable[[], asyncio.Protocol],
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        *,
        plaintext_too: bool = False,
        peer: str = "client",
        whose: str = "its",
        hangup_hint: str | None = None,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self.what = what  # names the server in log lines
        self.factory = factory
        self.handshake_timeout = handshake_timeout
        self.peer = peer
        self.whose = whose  # "its certificate", "the standby's certificate"
        self.hangup_hint = hangup_hint
        self.max_pending = max_pending
        self.tls: TlsConfig | None = None
        self.context: ssl.SSLContext | None = None
        self.plaintext_too = False
        self.configure(tls, plaintext_too)
        self.sockets: list[socket.socket] = []
        self._tasks = BackgroundTasks()
        #: accepted sockets whose handshake task has not started
        self._unstarted: set[socket.socket] = set()
        #: every accepted socket not yet released by its transport
        self._accepted: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._closed = False

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            for family, kind, proto, _, addr in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                self.sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
                sock.listen(BACKLOG)
                sock.setblocking(False)
        except OSError as e:
            self.close()
            reason = f"{self.what}: cannot listen on {host}:{port}: {e.strerror or e}"
            raise OSError(e.errno, reason) from e
        for sock in self.sockets:
            loop.add_reader(sock, self._accept, sock)

    def configure(self, tls: TlsConfig | None, plaintext_too: bool = False) -> None:
        """Serve new connections with ``tls`` (its files read now: a
        :class:`~bridge.TlsSetupError` leaves the server as it was)."""
        context = make_server_context(tls) if tls is not None else None
        self.tls, self.context = tls, context
        self.plaintext_too = plaintext_too and context is not None

    @property
    def port(self) -> int:
        return int(self.sockets[0].getsockname()[1])

    def _accept(self, sock: socket.socket) -> None:
        """The listening socket is readable: accept what is waiting."""
        loop = asyncio.get_running_loop()
        for _ in range(BACKLOG):
            try:
                conn, addr = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client left before we accepted it
            except OSError as e:
                level = logging.WARNING if e.errno in _OUT_OF_RESOURCES else logging.ERROR
                log.log(
                    level,
                    "%s: cannot accept a connection (%s); pausing for %g s",
                    self.what,
                    e.strerror or e,
                    ACCEPT_RETRY_DELAY,
                )
                loop.remove_reader(sock)
                loop.call_later(ACCEPT_RETRY_DELAY, self._resume, sock)
                return
            if len(self._tasks) >= self.max_pending:
                log.warning(
                    "%s: refused %s %s: %d connections are in their handshake already",
                    self.what,
                    self.peer,
                    _address(addr),
                    self.max_pending,
                )
                conn.close()
                continue
            conn.setblocking(False)
            self._unstarted.add(conn)
            self._accepted.add(conn)
            self._tasks.spawn(self._handshake(conn, _address(addr)))

    def _resume(self, sock: socket.socket) -> None:
        if not self._closed:
            asyncio.get_running_loop().add_reader(sock, self._accept, sock)

    async def _first_octet(self, conn: socket.socket) -> int | None:
        """The connection's first octet, peeked (left for the transport);
        None when the client sent nothing within the handshake deadline or
        hung up."""
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()

        def ready() -> None:
            if not readable.done():
                readable.set_result(None)

        fd = conn.fileno()  # close() may close the socket while this waits
        loop.add_reader(fd, ready)
        try:
            async with asyncio.timeout(self.handshake_timeout):
                await readable
        except TimeoutError:
            return None
        finally:
            loop.remove_reader(fd)
        try:
            first = conn.recv(1, socket.MSG_PEEK)
        except OSError:
            return None
        return first[0] if first else None

    async def _handshake(self, conn: socket.socket, peer: str) -> None:
        loop = asyncio.get_running_loop()
        context = self.context
        if context is not None and self.plaintext_too:
            first = await self._first_octet(conn)
            if first is None:
                self._unstarted.discard(conn)
                conn.close()
                log.debug("%s: %s %s sent nothing", self.what, self.peer, peer)
                return
            if first != TLS_RECORD:
                context = None  # a peer not moved to TLS yet
        self._unstarted.discard(conn)  # from here on, the transport closes it
        if context is None:
            await loop.connect_accepted_socket(self.factory, conn)
            return
        try:
            await loop.connect_accepted_socket(
                self.factory,
                conn,
                ssl=context,
                ssl_handshake_timeout=self.handshake_timeout,
                ssl_shutdown_timeout=TLS_SHUTDOWN_TIMEOUT,
            )
        except ssl.SSLError as e:
            log.warning(
                "%s: refused %s %s: TLS handshake failed: %s",
                self.what,
                self.peer,
                peer,
                self._why(e),
            )
        except ConnectionAbortedError:  # the loop's handshake timeout
            log.warning(
                "%s: refused %s %s: no TLS handshake within %g s",
                self.what,
                self.peer,
                peer,
                self.handshake_timeout,
            )
        except OSError as e:
            if self.hangup_hint is not None:
                log.warning(
                    "%s: TLS handshake with %s %s failed: %s (%s)",
                    self.what,
                    self.peer,
                    peer,
                    e.strerror or type(e).__name__,
                    self.hangup_hint,
                )
                return
            # A client that hangs up before or during the handshake (a TCP
            # health check does) has not been refused: nothing to act on.
            log.debug("%s: %s %s left during the TLS handshake: %s", self.what, self.peer, peer, e)

    def _why(self, e: ssl.SSLError) -> str:
        reason = describe_tls_error(e)
        ca = self.tls.ca if self.tls is not None else None
        if isinstance(e, ssl.SSLCertVerificationError) and ca is not None:
            reason += f" ({self.whose} certificate is not signed by {ca})"
        elif getattr(e, "reason", None) == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
            reason += f" (a certificate signed by {ca} is required)"
        elif getattr(e, "reason", None) in ("WRONG_VERSION_NUMBER", "HTTP_REQUEST"):
            reason += " (not TLS: a plain client on the TLS port?)"
        return reason

    def close(self) -> None:
        """Stop accepting and abandon handshakes in progress (their
        connections are dropped); established connections are the
        caller's."""
        self._closed = True
        loop = asyncio.get_running_loop()
        for sock in self.sockets:
            loop.remove_reader(sock)
            sock.close()
        self._tasks.cancel()
        for conn in self._unstarted:
            conn.close()
        self._unstarted.clear()

    async def wait_closed(self) -> None:
        """Wait for the abandoned handshakes, and for every connection's
        socket to be released: a transport lets go of it some loop turns
        after ``close()`` (after the TLS close_notify exchange, which
        :data:`TLS_SHUTDOWN_TIMEOUT` bounds). A loop stopped before that leaves
        the descriptor open, and uvloop's ``loop.close()`` then waits for
        it forever."""
        await self._tasks.wait()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TLS_SHUTDOWN_TIMEOUT + 1.0
        held = self._accepted  # no event says when a transport lets go of its socket
        while any(s.fileno() != -1 for s in held) and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
