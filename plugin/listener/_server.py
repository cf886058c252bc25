"""The AMQP listener: the asyncio shell around :class:`Session`.

One upstream broker connection per client connection, the handshake relayed
(RabbitMQ authenticates the client; this process holds no client
credentials). asyncio protocols, not streams, move the bytes: each
``data_received`` feeds the session and writes what it returns without a
task switch. Backpressure is TCP's (``pause_writing`` → ``pause_reading``),
and a publishing client is not read while the sink's backlog is over its
limit. Foreign errors (``OSError`` from connect) are translated here. TLS
(AMQPS, :meth:`Listener.start_tls`) ends in :class:`~bridge.TlsServer`; from
the completed handshake on, such a client is served like a plain one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, cast

from bridge import (
    ConfirmKey,
    Event,
    IdSource,
    LocalTransaction,
    Published,
    TlsConfig,
    TransactionRefused,
)
from bridge.link import TLS_SHUTDOWN_TIMEOUT, TlsServer, describe_tls_error
from plugin.admin import ListenerStats
from plugin.session import BrokerUnavailable, Output, Session, TooManyConnections
from plugin.tls import broker_context
from plugin.topology import VpnDirectory
from txn import MarkerKey

from ._brokers import BrokerAddress, BrokerNodes
from ._sink import ReplicationSink, append_events
from ._xa_gateway import XaGateway

__all__ = ["Listener"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0
CLOSE_TIMEOUT = 5.0
#: a refusal for the connection cap is logged at most this often (seconds)
LIMIT_LOG_SECONDS = 10.0


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class _BrokerSide(asyncio.Protocol):
    def __init__(self, conn: _ClientSide) -> None:
        self.conn = conn
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)
        _nodelay(transport)
        self.conn.listener._transport_opened()

    def data_received(self, data: bytes) -> None:
        self.conn.apply(self.conn.session.broker_data(data))

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.listener._transport_lost()
        self.conn.broker_lost(exc)

    def pause_writing(self) -> None:
        self.conn.pause_client()

    def resume_writing(self) -> None:
        self.conn.resume_client()


class _ClientSide(asyncio.Protocol):
    """One client connection and its upstream."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.session = Session(
            listener.directory,
            listener.ids,
            peers=listener.sessions,
            marker_key=listener.marker_key,
        )
        self.transport: asyncio.Transport | None = None
        self.broker: _BrokerSide | None = None
        self.refusal: BrokerUnavailable | None = None
        self._early: list[bytes] = []
        self._paused_by: set[str] = set()
        self._closed = False
        self._broker_died = False
        self._close_timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._durable: list[tuple[ConfirmKey, bool]] = []
        #: confirm key -> when its publish went to the sink (monotonic): the
        #: confirm-delay histogram's start
        self._held: dict[ConfirmKey, float] = {}

    # client transport callbacks ------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)
        _nodelay(transport)
        self.listener._transport_opened()
        if self.listener.stopped:
            # accepted as the listener stopped (a queued accept): no session
            # may start after close_all or close went over the connections
            self._closed = True
            transport.close()
            return
        self.listener.connections.add(self)
        stats = self.listener.stats
        stats.connections_open += 1
        stats.connections_total += 1
        if stats.connections_open > self.listener.max_connections:
            self.refusal = TooManyConnections(self.listener.max_connections)
            self.listener.refused_over_limit()
            return
        self._spawn(self._connect_upstream())

    def data_received(self, data: bytes) -> None:
        if self.refusal is not None:
            self._write_client(self.refusal.client_data(data))
            if self.refusal.done:
                self.close()
            return
        if self.broker is None or self.broker.transport is None:
            self._early.append(data)  # the upstream connect is in progress
            return
        self.apply(self.session.client_data(data))
        if self.listener.sink.full():
            self._pause("sink")
            self._spawn(self._wait_for_sink())

    def connection_lost(self, exc: Exception | None) -> None:
        self.listener._transport_lost()
        self.close()

    def pause_writing(self) -> None:
        if self.broker is not None and self.broker.transport is not None:
            self.broker.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.broker is not None and self.broker.transport is not None:
            self.broker.transport.resume_reading()

    # plumbing ---------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[None]) -> None:
        """A transaction's abort or resolve ended; one that failed (its
        database went away, say) leaves the row for recovery to settle."""
        self._tasks.discard(task)
        if not task.cancelled() and (e := task.exception()) is not None:
            log.warning(
                "settling a transaction failed (%s: %s); the next start's recovery settles it",
                type(e).__name__,
                e,
            )

    async def _connect_upstream(self) -> None:
        """Connect to the site's broker nodes in :class:`BrokerNodes`' order,
        the first that answers being this client's upstream; when none
        does, the client is refused as by an unreachable broker."""
        loop = asyncio.get_running_loop()
        nodes = self.listener.brokers
        reasons: list[str] = []
        for addr in nodes.order():
            broker = _BrokerSide(self)
            try:
                await asyncio.wait_for(
                    loop.create_connection(
                        lambda: broker,  # noqa: B023 - awaited within this iteration
                        addr.host,
                        addr.port,
                        ssl=self.listener.broker_ssl if addr.tls else None,
                        ssl_shutdown_timeout=TLS_SHUTDOWN_TIMEOUT if addr.tls else None,
                    ),
                    CONNECT_TIMEOUT,
                )
            except (OSError, TimeoutError) as e:
                why = describe_tls_error(e) if isinstance(e, ssl.SSLError) else e.strerror
                reasons.append(f"{addr}: {why or 'timed out'}")
                nodes.failed(addr)
                self.listener.stats.broker_connect_failures[str(addr)] += 1
                if self._closed:
                    return
                continue
            nodes.connected(addr)
            break
        else:
            reason = "; ".join(reasons)
            log.warning("broker unreachable for a client connection: %s", reason)
            self.refusal = BrokerUnavailable(reason)
            early, self._early = self._early, []
            for chunk in early:
                self.data_received(chunk)
            return
        if reasons:
            log.info("client upstream on %s after %s", addr, "; ".join(reasons))
        if self._closed:
            if broker.transport is not None:
                broker.transport.close()
            return
        self.broker = broker
        early, self._early = self._early, []
        for chunk in early:
            self.data_received(chunk)

    def apply(self, out: Output) -> None:
        """Carry out what the session asked for."""
        if out.to_broker and self.broker is not None and self.broker.transport is not None:
            _write_joined(self.broker.transport, out.to_broker)
        if out.to_client:
            self._write_client(out.to_client)
        sink = self.listener.sink
        if out.events or out.marks:
            # after to_broker: a mark is where a request went to the broker
            self._hold(out.events)
            vpn = self.session.vpn
            append_events(sink, vpn.name if vpn else "", out, self._durable_notice)
        for txn in out.prepare:
            self._spawn(self._prepare(txn, self._start_prepare(txn)))
        for txn in out.commit:
            self.listener.sink.commit_soon(txn, functools.partial(self._committed, txn))
        self._settle(out)
        if out.xa_calls or out.xa_gone:
            self._xa(out)
        if out.drop_broker and self.broker is not None and self.broker.transport is not None:
            self.broker.transport.close()
        if self.session.closing and not self._close_timer and not self._closed:
            self._close_timer = asyncio.get_running_loop().call_later(CLOSE_TIMEOUT, self.close)
        if self.session.client_done and (self.session.broker_done or out.drop_broker):
            self.close()

    def _hold(self, events: list[tuple[Event, ConfirmKey | None]]) -> None:
        now = time.monotonic()
        held = self._held
        for _, key in events:
            if key is not None:
                held[key] = now

    def _observe_held(self, done: list[tuple[ConfirmKey, bool]]) -> None:
        """Each released confirm's time in the sink, into the VPN's
        ``vpnrepl_confirm_delay_seconds`` buckets for its current mode."""
        vpn = self.session.vhost or ""
        view = self.listener.directory.lookup(vpn)
        buckets = self.listener.stats.confirm_delay(vpn, view.mode if view else "unknown")
        now = time.monotonic()
        held = self._held
        for key, _ in done:
            start = held.pop(key, None)
            if start is not None:
                buckets.observe(now - start)

    def _durable_notice(self, key: ConfirmKey, ok: bool) -> None:
        """The sink's verdict on one replicated publish; collected for one
        release pass per loop turn (:meth:`_flush_durable`)."""
        if not self._durable:
            asyncio.get_running_loop().call_soon(self._flush_durable)
        self._durable.append((key, ok))

    def _flush_durable(self) -> None:
        """Release held confirms for every durable notice of this loop turn
        at once: one pass over the pending confirms, one write."""
        done, self._durable = self._durable, []
        self._observe_held(done)
        if not self._closed:
            self.apply(self.session.replicated_done(done))

    def _settle(self, out: Output) -> None:
        """Transactions that will never reach the broker, or whose broker
        outcome was not seen, go back to the sink to be aborted or resolved."""
        sink = self.listener.sink
        for txn in out.abort:
            self._spawn(sink.abort(txn))
        for txn in out.unresolved:
            self._spawn(sink.resolve(txn))

    @property
    def closed(self) -> bool:
        return self._closed

    def _xa(self, out: Output) -> None:
        """XA requests to answer, XA branches whose channels closed."""
        gateway = self.listener.xa
        for call in out.xa_calls:
            gateway.requested(self, call)
        for number in out.xa_gone:
            gateway.channel_gone(self, number)

    def _start_prepare(self, txn: LocalTransaction) -> Awaitable[None]:
        """The sink's prepare, started now (see ReplicationSink.prepare)."""
        try:
            return self.listener.sink.prepare(txn)
        except TransactionRefused as e:
            return _raise(e)

    async def _prepare(self, txn: LocalTransaction, prepared: Awaitable[None]) -> None:
        refused: str | None = None
        try:
            await prepared
        except TransactionRefused as e:
            refused = str(e)
        if not self._closed:
            self.apply(self.session.transaction_prepared(txn.channel, refused))
        elif refused is None:  # the client left while we prepared
            await self.listener.sink.abort(txn)

    def _committed(self, txn: LocalTransaction, error: BaseException | None) -> None:
        """The sink's answer to a committed transaction: release
        ``tx.commit-ok``, in the sink's own callback (no event-loop turn)."""
        if error is None:
            if not self._closed:
                self.apply(self.session.transaction_committed(txn.channel))
            return
        # The broker committed but replication could not record it: the
        # client must not hear tx.commit-ok; as with any connection lost at
        # commit, its outcome is for the client to find out (the node records
        # it at its next start, from the commit marker).
        log.error("transaction %s: commit not recorded: %s", txn.txid, error)
        if not self._closed:
            self.apply(self.session.shutdown(f"transaction outcome unknown: {error}"))

    async def _wait_for_sink(self) -> None:
        await self.listener.sink.wait_for_room()
        self._resume("sink")

    def _write_client(self, chunks: list[bytes]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            _write_joined(self.transport, chunks)

    def _pause(self, why: str) -> None:
        if not self._paused_by and self.transport is not None:
            self.transport.pause_reading()
        self._paused_by.add(why)

    def _resume(self, why: str) -> None:
        self._paused_by.discard(why)
        if not self._paused_by and self.transport is not None and not self._closed:
            self.transport.resume_reading()

    def pause_client(self) -> None:
        self._pause("broker")

    def resume_client(self) -> None:
        self._resume("broker")

    def shutdown(self) -> None:
        """Close both sides with AMQP; :meth:`close` follows on the close-oks
        (or the close timer)."""
        if not self._closed:
            self.apply(self.session.shutdown("vpnrepl listener shutting down"))

    def broker_lost(self, exc: Exception | None) -> None:
        """The broker closed the TCP connection: so does the client's (its
        unconfirmed replicated publishes are uncertain, unless we were
        closing anyway)."""
        self._broker_died = not self._closed and not self.session.broker_done
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._close_timer is not None:
            self._close_timer.cancel()
        last = self.session.connection_lost(self._broker_died)
        if last.uncertain:
            self.listener.on_uncertain(last.uncertain)
        if last.events:  # the connection's exclusive queues are gone
            self.listener.sink.append_many(last.events, self._durable_notice)
        self._settle(last)
        self._xa(last)
        self.listener.xa.connection_gone(self)
        stats = self.listener.stats
        stats.connections_open -= 1
        if self.session.fault_code is not None:
            stats.protocol_closes[self.session.fault_code] += 1
        if self.transport is not None:
            self.transport.close()
        if self.broker is not None and self.broker.transport is not None:
            self.broker.transport.close()
        self.listener.connections.discard(self)
        if not self.listener.connections and self.listener._idle is not None:
            self.listener._idle.set()


class _NoReplies:
    """A listener without a node answers no XA request."""

    async def send(self, vhost: str, queue: str, correlation_id: str, body: bytes) -> None:
        raise RuntimeError("this listener has no broker connection to answer XA requests with")


class Listener:
    """Accepts AMQP clients on ``listen.amqp`` and relays them to the broker."""

    def __init__(
        self,
        broker: BrokerAddress | Sequence[BrokerAddress],
        directory: VpnDirectory,
        ids: IdSource,
        sink: ReplicationSink,
        broker_ssl: ssl.SSLContext | None = None,
        max_connections: int = 10_000,
        marker_key: MarkerKey | None = None,
    ) -> None:
        #: the site's RabbitMQ nodes (``broker.amqp_url``), clients spread over them
        self.brokers = BrokerNodes(broker)
        #: the site's commit-marker key (``txn/_marker_key.py``)
        self.marker_key = marker_key or MarkerKey.new()
        #: client connections served at once; past it one is refused (320)
        self.max_connections = max_connections
        self._refused_logged = -LIMIT_LOG_SECONDS
        self.directory = directory
        self.ids = ids
        self.sink = sink
        self.broker_ssl = broker_ssl or (broker_context() if self.brokers.tls else None)
        self.connections: set[_ClientSide] = set()
        #: no more clients: the node stops, or no longer leads its site
        self.stopped = False
        self.stats = ListenerStats()
        #: told of replicated publishes left unconfirmed by a dead broker
        #: connection (the node records them: ``plugin.node._uncertain``)
        self.on_uncertain: Callable[[list[Published]], None] = lambda events: None
        #: answers clients' XA requests (the node sets one with a resource manager)
        self.xa = XaGateway(None, _NoReplies())
        self._idle: asyncio.Event | None = None  # set when the last one closed
        #: client and broker transports not yet lost: a TLS one is lost only
        #: after the close_notify exchange, some loop turns after close()
        self._transports = 0
        self._released: asyncio.Event | None = None  # set when none is left
        self._server: asyncio.Server | None = None
        self._tls_server: TlsServer | None = None

    def refused_over_limit(self) -> None:
        """A client refused for the connection cap: counted, and logged at
        most every :data:`LIMIT_LOG_SECONDS` (a flood must not flood the log)."""
        self.stats.connections_refused += 1
        now = time.monotonic()
        if now - self._refused_logged >= LIMIT_LOG_SECONDS:
            self._refused_logged = now
            log.warning(
                "refused a client connection: %d are open already (listen.max_connections); "
                "%d refused so far",
                self.max_connections,
                self.stats.connections_refused,
            )

    def _transport_opened(self) -> None:
        self._transports += 1

    def _transport_lost(self) -> None:
        self._transports -= 1
        if not self._transports and self._released is not None:
            self._released.set()

    def sessions(self) -> Iterator[Session]:
        """The sessions of every open client connection."""
        return (c.session for c in self.connections)

    def close_vpn(self, vpn: str, reason: str) -> int:
        """Close every client connection to ``vpn`` with 320 and ``reason``
        (the VPN was fenced, or is switching over); returns how many."""
        closing = [c for c in self.connections if c.session.vhost == vpn]
        for conn in closing:
            conn.apply(conn.session.shutdown(reason))
        return len(closing)

    def close_all(self, reason: str) -> int:
        """Stop accepting and close every client connection with 320 and
        ``reason`` (this node no longer leads its site); returns how many."""
        self._stop_accepting()
        closing = list(self.connections)
        for conn in closing:
            conn.apply(conn.session.shutdown(reason))
        return len(closing)

    def _stop_accepting(self) -> None:
        self.stopped = True
        if self._server is not None:
            self._server.close()
        if self._tls_server is not None:
            self._tls_server.close()

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: _ClientSide(self), host, port, reuse_address=True
            )
        except OSError as e:
            raise OSError(e.errno, f"cannot listen for AMQP on {host}:{port}: {e.strerror}") from e

    async def start_tls(self, host: str, port: int, tls: TlsConfig) -> None:
        """Also accept AMQPS clients on ``host:port``, with the certificate
        and key of ``tls`` (a client certificate signed by ``tls.ca`` required
        when it is set); raises TlsSetupError naming an unusable file."""
        server = TlsServer("AMQPS listener", tls, lambda: _ClientSide(self))
        await server.start(host, port)
        self._tls_server = server

    @property
    def port(self) -> int:
        assert self._server is not None  # noqa: S101 - after start()
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def tls_port(self) -> int:
        assert self._tls_server is not None  # noqa: S101 - after start_tls()
        return self._tls_server.port

    async def close(self, grace: float = 3.0) -> None:
        """Stop accepting, close every client connection with AMQP (320),
        drop what has not finished closing after ``grace`` seconds, and wait
        until every transport is gone (a loop closed before that would leave
        sockets open; uvloop's ``loop.close()`` fails or waits on them)."""
        if self._server is not None:
            self._server.close()
        if self._tls_server is not None:
            self._tls_server.close()
        self._idle = asyncio.Event()
        for conn in list(self.connections):
            conn.shutdown()
        if self.connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace)
        for conn in list(self.connections):
            conn.close()
        if self._transports:
            self._released = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._released.wait(), TLS_SHUTDOWN_TIMEOUT + 1.0)
        if self._server is not None:
            await self._server.wait_closed()
        if self._tls_server is not None:
            await self._tls_server.wait_closed()


def _write_joined(transport: asyncio.WriteTransport, chunks: list[bytes]) -> None:
    """Write ``chunks`` as one buffer. ``writelines`` may send each chunk on
    its own (a read relayed with spliced headers is two chunks per message),
    and with TCP_NODELAY every chunk becomes a segment the broker must read
    separately; one copy of the read's bytes is far cheaper than that."""
    transport.write(chunks[0] if len(chunks) == 1 else b"".join(chunks))


async def _raise(error: BaseException) -> None:
    raise error
