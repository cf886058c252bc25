"""The standby's bridge: keeps a link to the active up.

:meth:`StandbyBridge.run` dials the active's nodes in turn (TLS when
configured, plain TCP too while the pair moves to TLS), checks the
named-site rule before saying anything, greets in the newest protocol
version the active speaks, and runs a session
(:class:`~bridge.standby._session.StandbySession`) until the link ends;
then it redials after a back-off that grows with jitter and restarts once a
session got established. What a session does with each VPN's stream is in
:mod:`bridge.standby._session` and :mod:`bridge.standby._worker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import psycopg
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_random_exponential

from bridge._errors import (
    BridgeError,
    PeerFailure,
    Unauthorised,
    VersionMismatch,
)
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
    DISCONNECTED,
    BridgeStateWriter,
    Pool,
    known_epochs,
    open_pool,
    reset_states,
)
from bridge.wire import (
    CAP_TOPOLOGY,
    CAPABILITIES,
    PREVIOUS_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    BridgeConnection,
    Error,
    GetAllResources,
    Hello,
    PeerCheck,
    certificate_names,
)

from ._adoption import VpnAdoption
from ._applier import StandbyApplier, StandbyError
from ._session import StandbySession
from ._txnlink import StandbyTxnLink
from ._worker import SiteParts

__all__ = ["StandbyBridge"]

log = logging.getLogger(__name__)


class StandbyBridge:
    """The standby site's end of the bridge (module docstring)."""

    def __init__(
        self,
        site: str,
        dsn: str,
        peer: HostPort | Sequence[HostPort],
        *,
        management_url: str | Sequence[str] | None = None,
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
        self._parts: SiteParts | None = None
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
        applier = StandbyApplier(self._dsn)
        self.txn_link.applier = applier
        adoption = VpnAdoption(self._pool, self._api, self.on_fenced, self.on_adopted)
        self._parts = SiteParts(
            self._pool, applier, adoption, self.txn_link, self._set_state, self.max_apply_batch
        )
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
            await asyncio.to_thread(applier.close)
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
        assert self._parts is not None  # noqa: S101 - run() made them
        link = await self._connect()
        session = StandbySession(
            link, self._parts, peer=self.peer, listed=self.listed, on_established=self._established
        )
        self._link = link
        heartbeats = asyncio.create_task(link.heartbeats(self.heartbeat_interval))
        relists = asyncio.create_task(self._relist(link))
        try:
            await self._greet(link)
            await session.converse(self.peer_site)
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

    def _established(self) -> None:
        self.sessions += 1

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
