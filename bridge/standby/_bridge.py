"""The standby site's end of the bridge: keeps a link to the active up and
applies each VPN's stream.

:meth:`StandbyBridge.run` connects (TLS when configured), retries with
exponential back-off and jitter, and per VPN the active lists: settles it
here (:class:`~bridge.standby._adoption.VpnAdoption`: enabled as standby,
settings, epoch, config-sync), sends ``SyncRequest`` from the applied
index, then installs the checkpoint and applies the events, each
acknowledged once durable. Each VPN has a worker of its own, fed in
arrival order through a queue; what the worker follows of its stream is
the sans-IO :class:`~bridge.standby._stream.StandbyStream`.

Invariant: nothing confirmed on the active is lost or applied twice here,
whatever the link does. The worker applies every batch with
:meth:`StandbyApplier.apply_batch`, which stores the applied index in the
same transaction as the effects, and acknowledges only after that commit.
Every (re)synchronisation starts from that stored index (never from what
was merely received), so a link cut at any byte, a standby killed
mid-apply, or a gap resumes exactly after the last durable entry; replayed
duplicates are skipped by index.

Limits: the standby holds a checkpoint's rows in memory until its last
chunk arrived (the applier installs it in one transaction).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import psycopg
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_random_exponential

from bridge._errors import (
    BridgeError,
    Gap,
    LocalProtocolError,
    PeerFailure,
    RemoteProtocolError,
    StaleEpoch,
    Unauthorised,
    UnknownVpn,
    VersionMismatch,
)
from bridge._failpoints import failpoint
from bridge._settings import HostPort, InvalidSettings, Role, TlsConfig
from bridge.broker import ManagementAPI
from bridge.link import (
    Link,
    LinkClosed,
    LinkError,
    PeerUnreachable,
    TlsRefused,
    describe_error,
    dial,
    make_client_context,
)
from bridge.store import (
    CONNECTED,
    DISCONNECTED,
    SYNCING,
    BridgeStateWriter,
    Pool,
    applied_position,
    epoch_taken,
    known_epochs,
    open_pool,
    reset_states,
)
from bridge.wire import (
    CAP_TOPOLOGY,
    CAPABILITIES,
    PREVIOUS_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Ack,
    BridgeConnection,
    Checkpoint,
    Error,
    Events,
    GetAllResources,
    Hello,
    PeerCheck,
    Repair,
    ResourceList,
    SyncAccepted,
    SyncFinished,
    SyncRequest,
    TxnCommit,
    TxnOutcome,
    TxnPrepare,
    VpnResource,
    certificate_names,
)

from ._adoption import VpnAdoption
from ._applier import NotStandby, StandbyApplier, StandbyError
from ._stream import StandbyStream
from ._txnlink import StandbyTxnLink

__all__ = ["StandbyBridge"]

log = logging.getLogger(__name__)

#: items a VPN's worker queue holds before the reader waits for it
_QUEUE_SIZE: Final = 64


@dataclass(frozen=True, slots=True)
class _Relisted:
    """Worker item: the active (re)listed the VPN."""

    resource: VpnResource


@dataclass(frozen=True, slots=True)
class _Resync:
    """Worker item: resynchronise from the applied index (after a Gap)."""

    reason: str


_Item = _Relisted | _Resync | SyncAccepted | Checkpoint | Events | SyncFinished | TxnCommit | Repair


@dataclass(eq=False)
class _Worker:
    """One VPN's apply worker: its queue, its task, and its view of the stream."""

    stream: StandbyStream
    queue: asyncio.Queue[_Item] = field(default_factory=lambda: asyncio.Queue(_QUEUE_SIZE))
    task: asyncio.Task[None] | None = None

    @property
    def vpn(self) -> str:
        return self.stream.vpn


@dataclass(eq=False)
class _Session:
    link: Link
    workers: dict[str, _Worker] = field(default_factory=dict)
    established: bool = False
    failure: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        reason = exc if isinstance(exc, BridgeError) else PeerFailure(describe_error(exc))
        self.link.fail(reason)


class StandbyBridge:
    """The standby site's end of the bridge (module docstring)."""

    def __init__(
        self,
        site: str,
        dsn: str,
        peer: HostPort | Sequence[HostPort],
        *,
        management_url: str | None = None,
        keep_users: tuple[str, ...] = (),
        tls: TlsConfig | None = None,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        connect_timeout: float = 10.0,
        min_backoff: float = 0.2,
        max_backoff: float = 10.0,
        relist_interval: float = 30.0,
        max_apply_batch: int = 5000,
        peer_site: str = "",
        copy_tags: tuple[str, ...] = (),
        plaintext_too: bool = False,
    ) -> None:
        """``peer_site``: the active's site name, which its certificate and
        its Hello must carry (the named-site rule, :mod:`bridge.wire._identity`).
        ``plaintext_too`` (the pair moves to TLS): each dial tries TLS
        first and plain TCP when the TLS handshake fails."""
        self.site = site
        self._check = PeerCheck.of([peer_site])
        self._dsn = dsn
        #: the active site's bridge addresses (its nodes), dialled in order
        self.addresses = (peer,) if isinstance(peer, HostPort) else tuple(peer)
        if not self.addresses:
            raise ValueError("a bridge client needs the active's address")
        #: the address dialled last
        self.peer = self.addresses[0]
        self._api = (
            ManagementAPI(management_url, keep_users=keep_users, copy_tags=copy_tags)
            if management_url
            else None
        )
        self._tls = tls
        self._ssl = make_client_context(tls) if tls is not None else None
        self._plaintext_too = plaintext_too and tls is not None
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.connect_timeout = connect_timeout
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self.relist_interval = relist_interval
        self.max_apply_batch = max_apply_batch
        self._stop = asyncio.Event()
        self._stopped = asyncio.Event()
        self._session_task: asyncio.Task[None] | None = None
        self._link: Link | None = None  # the current session's, while one is up
        self._states: dict[str, str] = {}
        self._writes: BridgeStateWriter | None = None
        self._pool: Pool | None = None
        self._applier: StandbyApplier | None = None
        self._adoption: VpnAdoption | None = None
        #: Established sessions so far (tests and status).
        self.sessions = 0
        #: the bridge protocol version the next connection proposes: the
        #: newest, or the previous one for an active that refused the newest
        #: (an active not yet upgraded); back to the newest after a session
        self.version = PROTOCOL_VERSION
        #: the transaction link: the participant's prepares and outcomes, and
        #: early commits (the node sets its participant)
        self.txn_link = StandbyTxnLink(dsn)
        #: set once the peer's first listing was handled (its epochs are known)
        self.listed = asyncio.Event()
        #: the peer's site name, from its Hello
        self.peer_site = ""
        #: ``(vpn, epoch, site)``: the peer holds a VPN that is active here at
        #: a higher epoch; this site's VPN was recorded fenced (set by the node)
        self.on_fenced: Callable[[str, int, str], None] | None = None
        #: ``(vpn)``: a VPN the active lists was enabled here as standby (set
        #: by the node, whose listener must refuse its clients from now on)
        self.on_adopted: Callable[[str], None] | None = None

    def bridge_state(self, vpn: str) -> str:
        return self._states.get(vpn, DISCONNECTED)

    @property
    def users_not_ours(self) -> int:
        """Users config-sync left alone: this site made them itself."""
        return len(self._api.not_ours) if self._api is not None else 0

    def follows(self, vpn: str) -> bool:
        """The active site serves ``vpn`` to this one right now: a link is
        up and the VPN's stream is syncing or connected."""
        return self._link is not None and self._states.get(vpn, DISCONNECTED) != DISCONNECTED

    def _set_state(self, vpn: str, state: str) -> None:
        if self._states.get(vpn, DISCONNECTED) != state:
            log.info("bridge: VPN %s is %s", vpn, state)
            if self._writes is not None:
                self._writes.bridge_state(vpn, state)
        self._states[vpn] = state

    # -- lifecycle -------------------------------------------------------------

    async def run(self) -> None:
        """Connect and replicate until :meth:`close`; a lost link is redialled
        after a back-off that grows from ``min_backoff`` to ``max_backoff``
        (with full jitter) and restarts when a session got established."""
        self._stop.clear()
        self._stopped.clear()
        self._pool = open_pool(self._dsn, "bridge-standby")
        self._applier = StandbyApplier(self._dsn)
        self.txn_link.applier = self._applier
        self._adoption = VpnAdoption(self._pool, self._api, self.on_fenced, self.on_adopted)
        try:
            await self._pool.open(wait=False)
            await reset_states(self._pool, Role.STANDBY)
            self._writes = BridgeStateWriter(self._pool, 0.05)
            self._writes.start()
            while not self._stop.is_set():
                retrying = AsyncRetrying(
                    retry=retry_if_exception_type(Exception),
                    wait=wait_random_exponential(multiplier=self.min_backoff, max=self.max_backoff),
                    sleep=self._sleep,
                    before_sleep=self._log_retry,
                    reraise=True,
                )
                async for attempt in retrying:
                    with attempt:
                        await self._attempt()
                await self._sleep(self.min_backoff)
        finally:
            for vpn in list(self._states):
                self._set_state(vpn, DISCONNECTED)
            if self._writes is not None:
                await self._writes.close()
                self._writes = None
            await self._pool.close()
            await self.txn_link.close()
            await asyncio.to_thread(self._applier.close)
            self._stopped.set()

    async def close(self) -> None:
        """Stop :meth:`run` (dropping the link) and wait for it to return."""
        self._stop.set()
        if self._session_task is not None:
            self._session_task.cancel()
        if self._pool is not None:
            await self._stopped.wait()

    async def _attempt(self) -> None:
        """Run one session as a task :meth:`close` can cancel, whatever it
        is waiting for (a connect, the database, the peer)."""
        task = asyncio.create_task(self._run_session(), name="bridge-session")
        self._session_task = task
        try:
            await asyncio.wait([task])
        finally:
            if not task.done():  # run() itself is being cancelled
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            self._session_task = None
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop.wait()

    def _log_retry(self, state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        delay = state.next_action.sleep if state.next_action is not None else 0.0
        if error is not None and not isinstance(
            error, BridgeError | StandbyError | psycopg.Error | InvalidSettings | OSError
        ):
            log.error("bridge: unexpected failure", exc_info=error)
        log.warning(
            "bridge to %s: %s; retrying in %.1f s (attempt %d)",
            self.peer,
            describe_error(error) if error is not None else "?",
            delay,
            state.attempt_number,
        )

    # -- one session -------------------------------------------------------------

    async def _run_session(self) -> None:
        """One connection. Returns after an established session ended (the
        back-off restarts); raises when it failed before that."""
        if self._stop.is_set():
            return
        link = await self._connect()
        session = _Session(link)
        self._link = link
        heartbeats = asyncio.create_task(link.heartbeats(self.heartbeat_interval))
        relists = asyncio.create_task(self._relist(link))
        try:
            await self._converse(session)
        except Exception as e:
            cause = session.failure or e
            if self._stop.is_set():
                return
            if not session.established:
                if cause is e:
                    raise
                raise cause from e
            log.warning("bridge to %s lost: %s; reconnecting", self.peer, describe_error(cause))
        else:
            if session.failure is not None and not self._stop.is_set():
                log.warning(
                    "bridge to %s lost: %s; reconnecting",
                    self.peer,
                    describe_error(session.failure),
                )
        finally:
            tasks = [heartbeats, relists, *(w.task for w in session.workers.values() if w.task)]
            for task in tasks:
                task.cancel()
            try:
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:  # a second cancellation here must not leave the link open
                for vpn in session.workers:
                    self._set_state(vpn, DISCONNECTED)
                self._link = None
                if session.established:  # the active may have been upgraded since
                    self.version = PROTOCOL_VERSION
                await link.close()

    async def _connect(self) -> Link:
        failure: LinkError | None = None
        for address in self.addresses:
            self.peer = address
            try:
                reader, writer = await self._dial(address)
            except PeerUnreachable as e:  # the site's next node, if it has one
                failure = e
                continue
            break
        else:
            assert failure is not None  # noqa: S101 - at least one address
            raise failure
        why = self._check.certificate(certificate_names(writer.get_extra_info("peercert")))
        if why is not None:  # before this site says anything
            writer.transport.abort()
            raise Unauthorised(f"refused the active at {self.peer}: {why}")
        try:
            epochs = await self._known_epochs()
            conn = BridgeConnection(
                Role.STANDBY, self.site, known_epochs=epochs, version=self.version
            )
        except BaseException:
            # No Link owns the connection yet (its close() is the session's
            # finally): a database error, or close() cancelling the session
            # here, would leave it to the garbage collector.
            writer.transport.abort()
            raise
        return Link(conn, reader, writer, str(self.peer), self.heartbeat_timeout)

    async def _dial(self, address: HostPort) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await dial(address, self._ssl, self.connect_timeout)
        except (TlsRefused, PeerUnreachable) as e:
            if not self._plaintext_too:
                raise
            # an active not moved to TLS yet reads the ClientHello as a bad frame
            log.info("bridge: TLS to %s failed (%s); trying plain TCP", address, e)
            return await dial(address, None, self.connect_timeout)

    async def _known_epochs(self) -> dict[str, int]:
        assert self._pool is not None  # noqa: S101 - run() opened it
        async with self._pool.connection() as conn:
            return await known_epochs().run_async(conn)

    async def _greet(self, link: Link) -> None:
        try:
            link.send(link.conn.our_hello())
            answer = await link.next_frame()
        except LinkClosed as e:
            raise self._hung_up(link, e.text) from e
        if answer is None:
            raise self._hung_up(link, "it closed the link before answering Hello")
        if isinstance(answer, Error):
            refusal = answer.exception()
            if isinstance(refusal, VersionMismatch) and self.version > PREVIOUS_PROTOCOL_VERSION:
                # An active of the previous release: speak its version from
                # the next dial on (the standby is upgraded first).
                self.version = PREVIOUS_PROTOCOL_VERSION
                log.info(
                    "bridge: the active at %s refused protocol version %d (%s); "
                    "speaking version %d",
                    self.peer,
                    PROTOCOL_VERSION,
                    refusal.text,
                    self.version,
                )
            raise refusal
        if not isinstance(answer, Hello):  # pragma: no cover - the protocol allows nothing else
            raise PeerFailure(f"expected Hello, got {type(answer).__name__}")
        names = certificate_names(link.writer.get_extra_info("peercert"))
        why = self._check.hello(answer.site, names)
        if why is not None:
            raise Unauthorised(f"refused the active at {self.peer}: {why}")
        log.info(
            "bridge: connected to active site %r at %s (protocol version %d)",
            answer.site,
            self.peer,
            answer.version,
        )
        lacking = link.conn.lacking()
        if lacking:
            log.warning(
                "bridge: the active site %r (protocol version %d) lacks %s%s",
                answer.site,
                answer.version,
                ", ".join(lacking),
                f": topology changes reach this site only by its listings, every "
                f"{self.relist_interval:.0f} s"
                if CAPABILITIES[CAP_TOPOLOGY] in lacking
                else "",
            )
        self.peer_site = answer.site
        link.send(GetAllResources())

    def _hung_up(self, link: Link, text: str) -> LinkError:
        if link.plain:
            return LinkClosed(text)
        return TlsRefused(
            f"the active hung up right after the TLS handshake ({text}): it most likely "
            "refused this site's certificate (not signed by the CA it trusts)"
        )

    def reload_tls(self, tls: TlsConfig | None = None, plaintext_too: bool = False) -> None:
        """Dial with ``tls`` from now on (its files read again: a rotation),
        falling back to plain TCP or not. Raises
        :class:`~bridge.TlsSetupError` (nothing changes then). Without
        ``plaintext_too``, a link up over plain TCP is dropped: the next
        dial is TLS."""
        context = make_client_context(tls) if tls is not None else None
        self._tls, self._ssl = tls, context
        self._plaintext_too = plaintext_too and tls is not None
        link = self._link
        if tls is not None and not plaintext_too and link is not None and link.plain:
            log.warning("bridge: dropping the plain TCP link to %s: TLS only", self.peer)
            link.writer.transport.abort()

    def relist_now(self) -> None:
        """Ask the active for its VPNs now (a VPN here changed role), not at
        the next periodic relist."""
        if self._link is not None:
            self._link.try_send(GetAllResources())

    async def _relist(self, link: Link) -> None:
        """Ask for the resources again now and then: new VPNs, new definitions."""
        while True:
            await asyncio.sleep(self.relist_interval)
            link.try_send(GetAllResources())

    async def _converse(self, session: _Session) -> None:
        link = session.link
        await self._greet(link)
        while True:
            item = await link.next_frame()
            if item is None:
                if session.failure is None:
                    session.failure = LinkClosed("the active closed the link")
                return
            if isinstance(item, RemoteProtocolError):
                await self._vpn_fault(session, item)
            elif isinstance(item, ResourceList):
                if not session.established:
                    session.established = True
                    self.sessions += 1
                await self._listed(session, item)
            elif isinstance(
                item, SyncAccepted | Checkpoint | Events | SyncFinished | TxnCommit | Repair
            ):
                # a TxnCommit goes in line with the stream: it is applied
                # after what came before it and before what comes after
                worker = session.workers.get(item.vpn)
                if worker is not None:
                    await worker.queue.put(item)
            elif isinstance(item, TxnPrepare | TxnOutcome):
                self.txn_link.spawn(self.txn_link.received(link, item))
            elif isinstance(item, Error):
                if item.closes_connection:
                    raise item.exception()
                self._refused(session, item)

    async def _vpn_fault(self, session: _Session, fault: RemoteProtocolError) -> None:
        worker = session.workers.get(fault.vpn)
        if isinstance(fault, Gap) and worker is not None:
            log.warning("bridge: %s; resyncing from the applied index", fault)
            # Queued behind what was received before the gap: the request
            # goes out once that is applied, from the index it reached.
            await worker.queue.put(_Resync(str(fault)))
        elif isinstance(fault, StaleEpoch):
            log.error(
                "bridge: VPN %s: refused a frame from the active at %s: %s; "
                "waiting for an active with a current epoch",
                fault.vpn,
                self.peer,
                fault,
            )
            session.link.try_send(Error.from_exception(fault))
            if worker is not None:
                worker.stream.refused(stale_at=fault.known or 0)
            self._set_state(fault.vpn, DISCONNECTED)
        else:
            log.debug("bridge: %s", fault)

    def _refused(self, session: _Session, error: Error) -> None:
        exc = error.exception()
        worker = session.workers.get(error.vpn)
        stale_at = None
        if isinstance(exc, StaleEpoch):
            log.error(
                "bridge: VPN %s: the active at %s is fenced (%s); not replicating from it",
                error.vpn,
                self.peer,
                exc.text,
            )
            stale_at = session.link.conn.known_epoch(error.vpn)
        else:
            log.warning("bridge: VPN %s: the active refused to sync: %s", error.vpn, exc)
        if worker is not None:
            worker.stream.refused(stale_at)
        self._set_state(error.vpn, DISCONNECTED)

    async def _listed(self, session: _Session, listing: ResourceList) -> None:
        assert self._adoption is not None  # noqa: S101 - run() made it
        listed = {r.name: r for r in listing.vpns}
        for vpn in [v for v in session.workers if v not in listed]:
            gone = session.workers.pop(vpn)
            if gone.task is not None:
                gone.task.cancel()
            log.info("bridge: VPN %s is no longer replicated by the active", vpn)
            self._set_state(vpn, DISCONNECTED)
        # Settled here, not only in the VPNs' workers: which VPNs are standby
        # here and which active ones are fenced. A starting node waits for
        # this (:attr:`listed`) before it admits clients.
        for resource in listing.vpns:
            await self._adoption.adopt(resource, self.peer_site)
        self.listed.set()
        for resource in listing.vpns:
            worker = session.workers.get(resource.name)
            if worker is None:
                worker = _Worker(StandbyStream(resource.name))
                worker.task = asyncio.create_task(
                    self._work(session, worker), name=f"bridge-apply-{resource.name}"
                )
                session.workers[resource.name] = worker
            await worker.queue.put(_Relisted(resource))

    # -- one VPN's apply worker ------------------------------------------------

    async def _work(self, session: _Session, worker: _Worker) -> None:
        try:
            held: _Item | None = None
            while True:
                item = held if held is not None else await worker.queue.get()
                held = await self._handle_item(session, worker, item)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            session.fail(e)

    async def _handle_item(self, session: _Session, worker: _Worker, item: _Item) -> _Item | None:
        """Apply one item; returns an item taken from the queue but not used."""
        stream = worker.stream
        if isinstance(item, _Relisted):
            await self._relisted(session, worker, item.resource)
        elif isinstance(item, _Resync):
            await self._request_sync(session, worker)
        elif stream.drops(item):
            pass  # the tail of a stream this side left
        elif isinstance(item, SyncAccepted):
            stream.accepted()
        elif isinstance(item, Checkpoint):
            stream.rows.extend(item.rows)
            if item.last:
                await self._install(session, worker, item)
        elif isinstance(item, Events):
            return await self._apply(session, worker, item)
        elif isinstance(item, TxnCommit):
            await self._commit_early(session, worker, item)
        elif isinstance(item, Repair):
            await self._repair(session, worker, item)
        elif stream.finished():  # the SyncFinished of a stream not refused meanwhile
            self._set_state(worker.vpn, CONNECTED)
            self.txn_link.spawn(self.txn_link.ask_in_doubt(session.link, worker.vpn))
        return None

    async def _relisted(self, session: _Session, worker: _Worker, resource: VpnResource) -> None:
        assert self._adoption is not None  # noqa: S101 - run() made it
        if not await self._adoption.config_sync(resource, self.peer_site):
            self._set_state(resource.name, DISCONNECTED)
            return
        known = session.link.conn.known_epoch(resource.name)
        if not worker.stream.wants_sync(resource.epoch, known):
            return
        await self._request_sync(session, worker)

    async def _request_sync(self, session: _Session, worker: _Worker) -> None:
        assert self._pool is not None  # noqa: S101 - run() opened it
        vpn = worker.vpn
        async with self._pool.connection() as conn:
            found = await applied_position(vpn).run_async(conn)
            applied, applied_epoch = found if found is not None else (0, 0)
            if applied == 0:
                applied_epoch = 0
            epoch = max(session.link.conn.known_epoch(vpn), applied_epoch, 1)
            # who took the epoch and where: an active it fences records them
            taken = await epoch_taken(vpn, epoch).run_async(conn)
        by, at = taken if taken is not None else ("", 0)
        try:
            session.link.send(SyncRequest(vpn, epoch, applied, applied_epoch, by, at))
        except LocalProtocolError as e:
            log.debug("bridge: VPN %s: no sync request now: %s", vpn, e)
            return
        worker.stream.requested()
        log.info("bridge: VPN %s: sync requested from index %d", vpn, applied + 1)
        self._set_state(vpn, SYNCING)

    async def _install(self, session: _Session, worker: _Worker, last: Checkpoint) -> None:
        assert self._applier is not None  # noqa: S101 - run() created it
        rows = worker.stream.take_checkpoint()
        try:
            await asyncio.to_thread(
                self._applier.install_checkpoint, worker.vpn, last.epoch, last.index, rows
            )
        except (NotStandby, UnknownVpn) as e:
            self._abandon(session, worker, e)
            return
        worker.stream.early = 0  # the checkpoint holds what was committed early
        # The replay goes on after the checkpoint: the topology changes
        # between this site's last listing and it come with a new listing.
        session.link.try_send(GetAllResources())
        log.info(
            "bridge: VPN %s: installed a checkpoint of %d live messages at index %d",
            worker.vpn,
            len(rows),
            last.index,
        )
        self._ack(session, worker, last.index)

    async def _apply(self, session: _Session, worker: _Worker, first: Events) -> _Item | None:
        assert self._applier is not None  # noqa: S101 - run() created it
        entries = list(first.entries)
        held: _Item | None = None
        while len(entries) < self.max_apply_batch and not worker.queue.empty():
            more = worker.queue.get_nowait()
            if not isinstance(more, Events):
                held = more
                break
            entries.extend(more.entries)
        vpn = worker.vpn
        try:
            applied = await self.txn_link.skip_committed(vpn, entries)
            if applied is None:
                applied = await asyncio.to_thread(self._applier.apply_batch, vpn, entries)
        except Gap as e:
            log.warning("bridge: %s; resyncing from the applied index", e)
            await self._request_sync(session, worker)
            return held
        except (StaleEpoch, NotStandby, UnknownVpn) as e:
            self._abandon(session, worker, e)
            return held
        failpoint("participant.after-apply")
        self._ack(session, worker, applied)
        return held

    async def _repair(self, session: _Session, worker: _Worker, frame: Repair) -> None:
        """A reconcile repair, in stream order (after what came before it)."""
        assert self._applier is not None  # noqa: S101 - run() created it
        try:
            await asyncio.to_thread(
                self._applier.apply_repair, worker.vpn, frame.rows, frame.absent
            )
        except (NotStandby, UnknownVpn) as e:
            self._abandon(session, worker, e)
            return
        log.info(
            "bridge: VPN %s: reconcile repair applied: %d rows set, %d removed",
            worker.vpn,
            len(frame.rows),
            len(frame.absent),
        )

    async def _commit_early(self, session: _Session, worker: _Worker, frame: TxnCommit) -> None:
        """The active asks to commit a transaction early (in stream order)."""
        await self.txn_link.commit_early(session.link, worker.stream, frame)

    def _abandon(self, session: _Session, worker: _Worker, why: BridgeError) -> None:
        """Stop applying this VPN's stream and tell the active why."""
        log.error("bridge: VPN %s: not applying the stream: %s", worker.vpn, why.text)
        session.link.try_send(Error.from_exception(why, vpn=worker.vpn))
        worker.stream.abandoned(stale_at=(why.known or 0) if isinstance(why, StaleEpoch) else None)
        self._set_state(worker.vpn, DISCONNECTED)

    def _ack(self, session: _Session, worker: _Worker, index: int) -> None:
        conn = session.link.conn
        following = conn.next_index(worker.vpn)
        if following is None:
            return
        index = min(index, following - 1)
        stream = worker.stream
        if index <= stream.acked:
            return
        if session.link.try_send(Ack(worker.vpn, conn.known_epoch(worker.vpn), index)):
            stream.acked = index
