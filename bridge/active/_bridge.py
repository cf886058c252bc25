"""The active's end of the bridge: serves every standby that dials in.

Per standby (:class:`~bridge.active._stream.ConnectedStandby`) it checks
the named-site rule, answers ``Hello`` and ``GetAllResources``
(:mod:`bridge.active._listing`), runs a VPN's stream per ``SyncRequest``
(:class:`~bridge.active._stream.ActiveStream`: replay, checkpoint, live),
and hands the transaction frames to the transaction link. An ``Ack``
releases sync-mode confirms (:meth:`Replicator.standby_acked`), is recorded
in ``vpn_state`` and lets the ledger be pruned behind it
(:mod:`bridge.active._pruner`). A standby that shows a higher epoch fences
the VPN here: its publishes are refused and ``vpn_state.fenced`` recorded.
Nothing confirmed here is lost or applied twice on a standby: the streams'
invariant (:mod:`bridge.active._stream`) and the pruner's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence

import psycopg

from bridge import LiveKey
from bridge._entry import LedgerEntry, entries_by_vpn
from bridge._errors import (
    BridgeError,
    Fenced,
    LocalProtocolError,
    PeerFailure,
    RemoteProtocolError,
    StaleEpoch,
    Unauthorised,
    UnknownVpn,
)
from bridge._settings import HostPort, InvalidSettings, Role, TlsConfig
from bridge.broker import ManagementAPI
from bridge.ledger import LedgerError, LedgerWriter
from bridge.link import Link, LinkClosed, LinkError, TlsServer, describe_error, peer_address
from bridge.store import (
    CONNECTED,
    DISCONNECTED,
    SYNCING,
    BridgeStateWriter,
    Pool,
    open_pool,
    reset_states,
)
from bridge.wire import (
    CAP_TOPOLOGY,
    CAPABILITIES,
    Ack,
    BridgeConnection,
    ConnectionPhase,
    Error,
    Frame,
    GetAllResources,
    Hello,
    PeerCheck,
    SyncRequest,
    TxnApplied,
    TxnQuery,
    TxnVote,
    certificate_names,
)

from ._listing import ResourceLister
from ._pruner import LedgerPruner
from ._replicator import Replicator
from ._stream import ActiveStream, ConnectedStandby, RepairSent, StreamLimits
from ._txnlink import ActiveTxnLink

__all__ = ["ActiveBridge"]

log = logging.getLogger(__name__)

_MIB = 2**20


class ActiveBridge:
    """The active site's end of the bridge (module docstring)."""

    def __init__(
        self,
        site: str,
        dsn: str,
        writer: LedgerWriter,
        replicator: Replicator,
        *,
        peers: Iterable[str] = (),
        management_url: str | Sequence[str] | None = None,
        tls: TlsConfig | None = None,
        plaintext_too: bool = False,
        retain_seconds: float = 300.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        handshake_timeout: float = 10.0,
        batch_size: int = 500,
        checkpoint_chunk_bytes: int = 4 * _MIB,
        max_queued_bytes: int = 64 * _MIB,
        ack_flush_interval: float = 0.05,
        max_connections: int = 16,
    ) -> None:
        self.site = site
        self._dsn = dsn
        self.writer = writer
        self.replicator = replicator
        #: ``on_fenced(vpn, epoch, site)``: a standby showed a newer epoch
        #: of an active VPN here (the node closes its clients)
        self.on_fenced: Callable[[str, int, str], None] | None = None
        api = ManagementAPI(management_url) if management_url else None
        self._lister = ResourceLister(writer, api, replicator.fenced)
        #: the named-site rule: only these peer sites are served
        self._check = PeerCheck.of(peers)
        self._pruner = LedgerPruner(writer.reader, retain_seconds)
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        #: the TLS handshake and then the standby's Hello must each come
        #: within this many seconds of the connection
        self.handshake_timeout = handshake_timeout
        #: accepts connections: TLS (TlsSetupError names a bad file), plain
        #: TCP, or either while the pair moves to TLS (``plaintext_too``)
        self._acceptor = TlsServer(
            "bridge",
            tls,
            self._stream_protocol,
            handshake_timeout,
            plaintext_too=plaintext_too,
            peer="standby at",
            whose="the standby's",
            hangup_hint="did it refuse this site's certificate?",
            max_pending=max_connections,
        )
        #: connections served at once, authenticated or not: past it a new
        #: one is closed at once (a stranger cannot exhaust the node)
        self.max_connections = max_connections
        self.limits = StreamLimits(batch_size, checkpoint_chunk_bytes)
        self.max_queued_bytes = max_queued_bytes
        self._ack_flush_interval = ack_flush_interval
        self._listening = False
        self._pool: Pool | None = None
        self._states: BridgeStateWriter | None = None
        self._peers: set[ConnectedStandby] = set()
        #: a task per connection served, with the connection's writer
        self._handlers: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._shown: dict[str, str] = {}
        self._unsubscribe: Callable[[], None] | None = None
        #: the coordinator's ParticipantLink (the node wires the two together)
        self.txn_link = ActiveTxnLink(self._standby_of)

    @property
    def retain_seconds(self) -> float:
        """Acknowledged ledger entries are kept this long before a prune."""
        return self._pruner.retain_seconds

    # -- lifecycle -----------------------------------------------------------

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port``; the ledger writer must be started."""
        self._pool = open_pool(self._dsn, "bridge-active")
        await self._pool.open(wait=False)
        await reset_states(self._pool, Role.ACTIVE)
        self._states = BridgeStateWriter(self._pool, self._ack_flush_interval, self._pruner.acked)
        self._states.start()
        self._unsubscribe = self.writer.subscribe(self._on_durable)
        try:
            await self._acceptor.start(host, port)
        except OSError as e:
            await self.close()
            raise LinkError(f"cannot listen for standbys on {HostPort(host, port)}: {e}") from e
        self._listening = True
        log.info("bridge: listening for standbys on %s (%s)", HostPort(host, port), self._how())

    def _how(self) -> str:
        tls = self._acceptor.tls
        how = "mutual TLS" if tls and tls.ca else "TLS" if tls else "plain TCP"
        return how + (" or plain TCP" if self._acceptor.plaintext_too else "")

    def _stream_protocol(self) -> asyncio.Protocol:
        return asyncio.StreamReaderProtocol(asyncio.StreamReader(), self._accepted)

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection the acceptor handed over (its TLS handshake done),
        called as it is made: its handler task is tracked from this moment,
        so ``close()`` closes it even if the task never got to run."""
        if not self._listening:
            writer.transport.abort()
            return
        if len(self._handlers) >= self.max_connections:
            log.warning(
                "bridge: refused a connection from %s: %d bridge connections are open already",
                peer_address(writer),
                self.max_connections,
            )
            writer.transport.abort()
            return
        task = asyncio.ensure_future(self._handle(reader, writer))
        self._handlers[task] = writer
        task.add_done_callback(lambda done: self._handlers.pop(done, None))

    def reload_tls(self, tls: TlsConfig | None = None, plaintext_too: bool = False) -> None:
        """Serve new connections with ``tls`` (its files read again: a
        rotation), and plain TCP too or not. Raises
        :class:`~bridge.TlsSetupError` (nothing changes then). Without
        ``plaintext_too``, links that came in as plain TCP are dropped: the
        standby dials again, with TLS."""
        self._acceptor.configure(tls, plaintext_too)
        log.info("bridge: new standby connections: %s", self._how())
        if tls is None or plaintext_too:
            return
        for peer in list(self._peers):
            if peer.link.plain:
                log.warning("bridge: dropping plain TCP link of standby %s: TLS only", peer.name)
                peer.link.writer.transport.abort()

    @property
    def port(self) -> int:
        """The port listened on (useful after ``start(host, 0)``)."""
        if not self._listening:
            raise LinkError("the bridge server is not listening")
        return self._acceptor.port

    async def close(self) -> None:
        """Stop listening, drop every standby, record their state."""
        listening, self._listening = self._listening, False
        if listening:
            self._acceptor.close()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        for task, writer in list(self._handlers.items()):
            task.cancel()  # a task that never ran cannot close its connection itself
            writer.transport.abort()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if listening:
            await self._acceptor.wait_closed()
        if self._states is not None:
            await self._states.close()
            self._states = None
        await self._pruner.close()
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    def bridge_state(self, vpn: str) -> str:
        """``connected`` when some standby streams ``vpn`` live, ``syncing``
        while one catches up, else ``disconnected``."""
        best = DISCONNECTED
        for peer in self._peers:
            out = peer.streams.get(vpn)
            if out is not None:
                if out.state == CONNECTED:
                    return CONNECTED
                best = SYNCING
        return best

    async def repair(self, vpn: str, keys: Sequence[LiveKey]) -> RepairSent:
        """Send a reconcile repair of ``keys`` to the standby streaming
        ``vpn`` live, below the live entries' priority; returns what was
        sent. Raises :class:`BridgeError` when no standby streams it live
        (the caller bounds the wait with ``asyncio.timeout``)."""
        for peer in self._peers:
            out = peer.stream_live(vpn)
            if out is not None and peer.failure is None:
                break
        else:
            raise BridgeError("no standby is connected and streaming this VPN live", vpn)
        if not keys:
            return RepairSent(0, 0)
        return await out.repair(keys)

    async def relist(self) -> None:
        """Send every standby a fresh ResourceList (after VPNs were enabled,
        disabled or changed): new VPNs get synced, dropped ones stop."""
        for peer in list(self._peers):
            if peer.link.conn.phase is ConnectionPhase.READY:
                try:
                    await self._send_resources(peer)
                except (BridgeError, psycopg.Error) as e:
                    log.warning(
                        "bridge: cannot relist VPNs to %s: %s", peer.name, describe_error(e)
                    )

    # -- state -----------------------------------------------------------------

    def _state_changed(self, vpn: str) -> None:
        state = self.bridge_state(vpn)
        if self._shown.get(vpn, DISCONNECTED) != state:
            self._shown[vpn] = state
            log.info("bridge: VPN %s is %s", vpn, state)
            if self._states is not None:
                self._states.bridge_state(vpn, state)

    def _acked(self, vpn: str, index: int, epoch: int) -> None:
        """The standby holds ``vpn`` durably up to ``index``."""
        self.replicator.standby_acked(vpn, index)
        if self._states is not None:
            self._states.acked(vpn, index, epoch)

    def _fence(
        self,
        vpn: str,
        reason: BridgeError,
        newer: tuple[int, str, int] | None = None,
        by: str = "",
    ) -> None:
        """``vpn`` is fenced: a standby knows a newer epoch. ``newer``: that
        epoch, the site that took it and the index it took it over at, when
        the standby's SyncRequest said (recorded as a listing's would be:
        the epoch history, and a split brain if this site confirmed past
        that index)."""
        first = vpn not in self.replicator.fenced
        if first:
            log.error(
                "bridge: VPN %s is fenced: a standby knows a newer epoch (%s); "
                "this site refuses its publishes from now on",
                vpn,
                reason.text,
            )
        self.replicator.fenced.add(vpn)
        if self._states is not None:
            self._states.fenced(vpn, newer)
        if first and self.on_fenced is not None:
            # the node closes the VPN's clients (320) and refuses new ones
            epoch = newer[0] if newer else getattr(reason, "known", None) or 0
            self.on_fenced(vpn, epoch, newer[1] if newer else by)

    def _on_durable(self, entries: Sequence[LedgerEntry]) -> None:
        """Ledger subscriber: queue live entries per stream; never blocks."""
        by_vpn = entries_by_vpn(entries)
        for peer in list(self._peers):
            peer.push_live(by_vpn, self.max_queued_bytes)

    # -- one standby -------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address = peer_address(writer)
        try:
            names = certificate_names(writer.get_extra_info("peercert"))
            why = self._check.certificate(names)
            if why is not None:
                log.warning("bridge: refused standby at %s: %s", address, why)
                writer.transport.abort()
                return
            conn = BridgeConnection(Role.ACTIVE, self.site)
            peer = ConnectedStandby(Link(conn, reader, writer, address, self.heartbeat_timeout))
            peer.certificate_names = names
            self._peers.add(peer)
            try:
                await self._serve(peer)
            finally:
                self._peers.discard(peer)
                for out in peer.streams.values():
                    if out.task is not None:
                        out.task.cancel()
                await asyncio.gather(
                    *(o.task for o in peer.streams.values() if o.task), return_exceptions=True
                )
                for vpn in list(peer.streams):
                    self._state_changed(vpn)
                self.txn_link.gone(peer)
                await peer.link.close()
        except asyncio.CancelledError:
            # Only close() cancels a handler, and waits for it: returning
            # (not re-raising) keeps the cancellation out of the log.
            return
        except Exception:
            log.exception("bridge: serving %s failed", address)
        finally:
            if not writer.is_closing():
                writer.close()

    async def _serve(self, peer: ConnectedStandby) -> None:
        link = peer.link
        heartbeats = asyncio.create_task(link.heartbeats(self.heartbeat_interval))
        try:
            await self._converse(peer)
        except LinkError as e:
            cause = peer.failure or e
            log.warning("bridge: standby %s lost: %s", peer.name, describe_error(cause))
        except RemoteProtocolError as e:
            log.error("bridge: standby %s broke the protocol: %s; closing", peer.name, e)
            link.fail(e)
        except (psycopg.Error, LedgerError, InvalidSettings) as e:
            log.error(
                "bridge: serving standby %s failed: %s; closing", peer.name, describe_error(e)
            )
            link.fail(PeerFailure(f"the active failed: {describe_error(e)}"))
        finally:
            heartbeats.cancel()
            await asyncio.gather(heartbeats, return_exceptions=True)

    async def _converse(self, peer: ConnectedStandby) -> None:
        link = peer.link
        while True:
            item = await self._next_frame(link)
            if item is None:
                if peer.failure is not None:
                    raise LinkClosed(describe_error(peer.failure))
                log.info("bridge: standby %s closed the link", peer.name)
                return
            if isinstance(item, RemoteProtocolError):
                self._vpn_fault(peer, item)
            elif isinstance(item, Hello | Error):
                if self._ends(peer, item):
                    return
            elif isinstance(item, GetAllResources):
                await self._send_resources(peer)
            elif isinstance(item, SyncRequest):
                self._start_stream(peer, item)
            elif isinstance(item, Ack):
                self._acked(item.vpn, item.index, item.epoch)
            elif isinstance(item, TxnVote | TxnQuery | TxnApplied):
                self.txn_link.received(peer, item)

    async def _next_frame(self, link: Link) -> Frame | RemoteProtocolError | None:
        """The standby's next frame; its Hello within the handshake deadline."""
        if link.conn.peer_site is not None:
            return await link.next_frame()
        try:
            return await asyncio.wait_for(link.next_frame(), self.handshake_timeout)
        except TimeoutError:
            raise LinkClosed(f"no Hello within {self.handshake_timeout:g} s") from None

    def _ends(self, peer: ConnectedStandby, item: Hello | Error) -> bool:
        """A Hello (answered, or refused by the named-site rule) or an Error
        (a VPN's stream abandoned, or the link closed); True when the link
        ends."""
        if isinstance(item, Hello):
            return not self._greeted(peer, item)
        if item.closes_connection:
            log.warning("bridge: standby %s closed the link: %s", peer.name, item.exception())
            return True
        self._abandoned(peer, item)
        return False

    def _standby_of(self, vpn: str) -> ConnectedStandby | None:
        for peer in self._peers:
            if vpn in peer.epochs and peer.failure is None:
                return peer
        return None

    def _greeted(self, peer: ConnectedStandby, hello: Hello) -> bool:
        """Answer a standby's Hello, and say once what its release lacks;
        False (the link ends) when the named-site rule refuses it."""
        link = peer.link
        why = self._check.hello(hello.site, peer.certificate_names)
        if why is not None:
            log.warning("bridge: refused standby at %s: %s", link.peer, why)
            text = f"site {hello.site!r} is not a peer of this site"
            link.try_send(Error(Unauthorised.code, "", text))
            return False
        link.send(link.conn.our_hello())
        log.info(
            "bridge: standby site %r connected from %s (protocol version %d)",
            hello.site,
            link.peer,
            link.conn.version,
        )
        lacking = link.conn.lacking()
        if lacking:
            log.warning(
                "bridge: standby site %r (protocol version %d) lacks %s%s",
                hello.site,
                link.conn.version,
                ", ".join(lacking),
                ": topology changes reach it only by its periodic listings"
                if CAPABILITIES[CAP_TOPOLOGY] in lacking
                else "",
            )
        return True

    def _vpn_fault(self, peer: ConnectedStandby, fault: RemoteProtocolError) -> None:
        if isinstance(fault, StaleEpoch):
            # A stale SyncRequest still owes an answer; a stale Ack needs none.
            if peer.link.try_send(Error.from_exception(fault)):
                log.warning(
                    "bridge: refused a sync of VPN %s from %s: %s", fault.vpn, peer.name, fault
                )
        elif isinstance(fault, UnknownVpn):
            log.debug("bridge: %s: %s", peer.name, fault)
        else:
            log.warning("bridge: %s: %s", peer.name, fault)

    def _abandoned(self, peer: ConnectedStandby, error: Error) -> None:
        exc = error.exception()
        log.warning("bridge: standby %s abandoned VPN %s: %s", peer.name, error.vpn, exc)
        out = peer.streams.pop(error.vpn, None)
        if out is not None and out.task is not None:
            out.task.cancel()
        if isinstance(exc, StaleEpoch):
            self._fence(error.vpn, exc, by=peer.name)
        self._state_changed(error.vpn)

    async def _send_resources(self, peer: ConnectedStandby) -> None:
        assert self._pool is not None  # noqa: S101 - started
        listing = await self._lister.read(self._pool)
        peer.link.send(listing)
        peer.epochs = {r.name: r.epoch for r in listing.vpns}
        for vpn in [v for v in peer.streams if v not in peer.epochs]:
            out = peer.streams.pop(vpn)
            if out.task is not None:
                out.task.cancel()
            self._state_changed(vpn)

    # -- one VPN stream --------------------------------------------------------

    def _start_stream(self, peer: ConnectedStandby, request: SyncRequest) -> None:
        vpn = request.vpn
        old = peer.streams.pop(vpn, None)
        if old is not None and old.task is not None:
            old.task.cancel()
        out = ActiveStream(vpn, peer.epochs.get(vpn, request.epoch))
        out.task = asyncio.create_task(self._stream(peer, out, request, old), name=f"bridge-{vpn}")
        peer.streams[vpn] = out
        self._state_changed(vpn)

    async def _stream(
        self,
        peer: ConnectedStandby,
        out: ActiveStream,
        request: SyncRequest,
        old: ActiveStream | None,
    ) -> None:
        if old is not None and old.task is not None:
            await asyncio.wait([old.task])  # cancelled: it sends nothing more
        assert self._pool is not None  # noqa: S101 - started
        try:
            await out.serve(
                peer.link,
                request,
                self.writer,
                self._pool,
                self.limits,
                self._acked,
                self._state_changed,
            )
        except Fenced as e:
            by, at = request.taken_over_by, request.taken_over_at
            self._fence(out.vpn, e, (request.epoch, by, at) if by else None)
            if peer.streams.get(out.vpn) is out:
                del peer.streams[out.vpn]
            self._state_changed(out.vpn)
            # An Error answers a pending SyncRequest; a live stream is ended
            # by listing the VPNs without it (fenced ones are not listed).
            if not peer.link.try_send(Error.from_exception(e)):
                with contextlib.suppress(BridgeError, psycopg.Error):
                    await self._send_resources(peer)
        except (LinkError, LocalProtocolError) as e:
            # The link went, or the stream was superseded (a resync, a relist).
            log.debug("bridge: VPN %s stream to %s ended: %s", out.vpn, peer.name, e)
        except (LedgerError, psycopg.Error, BridgeError) as e:
            log.error(
                "bridge: VPN %s: serving %s failed: %s; closing the link (it will resync)",
                out.vpn,
                peer.name,
                describe_error(e),
            )
            peer.fail(e)
        except Exception as e:  # a bug: never a stream that stops without a word
            log.exception(
                "bridge: VPN %s: serving %s failed unexpectedly; closing the link (it will resync)",
                out.vpn,
                peer.name,
            )
            peer.fail(e)
