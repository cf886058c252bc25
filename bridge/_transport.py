"""The bridge over TCP (and TLS): the asyncio shell around :class:`BridgeConnection`.

:class:`BridgeServer` runs on the active site and serves every standby that
dials in; :class:`BridgeClient` runs on the standby site and keeps one link to
the active up. Everything about what may be sent when is decided by the
sans-IO :class:`~bridge.BridgeConnection`; this module owns the sockets, the
database and the management API, and turns their errors into the bridge's
taxonomy where they happen (:class:`LinkError` and its subclasses).

Invariant: nothing confirmed on the active is lost or applied twice on the
standby, whatever the link does. Why:

* The standby applies every batch with :meth:`StandbyApplier.apply_batch`,
  which stores the applied index in the same transaction as the effects, and
  acknowledges only after that commit. Every (re)synchronisation starts from
  that stored index (never from what was merely received), so a link cut at
  any byte, a standby killed mid-apply, or a gap resumes exactly after the
  last durable entry; replayed duplicates are skipped by index.
* The active replays from its ledger and switches to live events in one step
  of the event loop: it checks ``durable_index`` and marks the stream live
  without an ``await`` in between, and the ledger calls its subscribers in the
  same step as it advances ``durable_index``, so no entry falls between the
  replay and the live feed. A live feed that falls behind by more than
  ``max_queued_bytes`` drops the standby instead of growing memory; it
  reconnects and resyncs from its applied index.
* A standby whose applied entry is not in the retained ledger with the same
  epoch (behind the pruned ledger, or a diverged history) gets a checkpoint:
  the active's ``live_message`` rows read in one ``REPEATABLE READ``
  snapshot together with the ``vpn_live_state.live_index`` they reflect (the
  ledger writer updates both in one transaction), then the replay of the
  ledger from there; the ledger is never pruned past ``live_index``.
  Pruning keeps the acknowledged entry itself, so a standby that reconnects
  after a quiet period can still prove it follows the ledger and does not
  need a checkpoint.
* Fencing is the protocol's: a standby that knows a higher epoch makes the
  active raise :class:`~bridge.Fenced`; the active then refuses the VPN's
  publishes (``Replicator.fenced``) and records ``vpn_state.fenced``.

What is persisted: on the active, ``vpn_state.applied_index/applied_epoch/
applied_at`` (the standby's last acknowledgement, coalesced to at most one
write per ``ack_flush_interval``), ``fenced`` and ``bridge_state``; on the
standby, ``bridge_state`` and, through the applier, the applied index; a VPN
the active lists is enabled on the standby as ``standby`` if the standby does
not have it yet, and at every listing its settings follow the active's, its
epoch is raised to the active's (never lowered) and the definitions the
active sent are kept (``vpn_config.definitions``) and imported into the
local broker, users and permissions included (``bridge._configsync``).

Limits: the standby holds a checkpoint's rows in memory until its last chunk
arrived (the applier installs it in one transaction); a VPN is streamed to
every standby that asks, each with its own live queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_random_exponential

from ._apply import GuardedApply, run_guarded_async
from ._configsync import ConfigSyncError, import_vpn_definitions, vpn_definitions
from ._entry import LedgerEntry
from ._errors import (
    BridgeError,
    Fenced,
    Gap,
    LocalProtocolError,
    PeerFailure,
    RemoteProtocolError,
    StaleEpoch,
    UnknownVpn,
)
from ._events import Published, Voted
from ._failpoints import failpoint
from ._ids import ReplicationId
from ._ledger import LedgerError, LedgerPruned, LedgerWriter, VpnNotOpen
from ._management import ManagementAPI
from ._protocol import (
    NEED_DATA,
    PROTOCOL_VERSION,
    Ack,
    BridgeConnection,
    Checkpoint,
    CheckpointRow,
    Error,
    Events,
    Frame,
    GetAllResources,
    Heartbeat,
    Hello,
    Phase,
    ResourceList,
    Sentinel,
    SyncAccepted,
    SyncFinished,
    SyncRequest,
    TxnApplied,
    TxnCommit,
    TxnOutcome,
    TxnPrepare,
    TxnQuery,
    TxnVote,
    VpnResource,
)
from ._replicator import Replicator
from ._roles import EPOCH_SQL, FENCE_SQL
from ._settings import HostPort, InvalidSettings, Role, TlsConfig, VpnSettings
from ._standby import (
    NotStandby,
    ReadyAhead,
    StandbyApplier,
    StandbyError,
    StandbyUnavailable,
)
from ._tls import describe_tls_error, make_client_context, make_server_context

__all__ = [
    "CONNECTED",
    "DISCONNECTED",
    "SYNCING",
    "BridgeClient",
    "BridgeServer",
    "LinkClosed",
    "LinkError",
    "PeerSilent",
    "PeerUnreachable",
    "TlsRefused",
]

log = logging.getLogger(__name__)


class TxnOutcomes(Protocol):
    """How the active answers a standby's question about its prepared
    transactions: ``txn``'s coordinator."""

    async def outcomes_for(self, txids: Sequence[str]) -> dict[str, bool | None]: ...


class TxnParticipant(Protocol):
    """The standby's part of a local transaction: ``txn``'s participant."""

    async def prepare(
        self,
        vpn: str,
        txid: str,
        events: bytes,
        meanwhile: Callable[[Voted], object] | None = None,
    ) -> Voted | None: ...

    async def outcome(self, vpn: str, txid: str, commit: bool) -> None: ...

    async def in_doubt(self, vpn: str) -> list[str]: ...


_T = TypeVar("_T")

#: ``bridge_state`` values, as ``vpnrepl status`` shows them.
CONNECTED: Final = "connected"  # live: the replay is over, events stream in real time
SYNCING: Final = "syncing"  # a sync was requested: checkpoint and replay under way
DISCONNECTED: Final = "disconnected"  # no stream for this VPN

_READ_SIZE = 256 * 1024
_MIB = 2**20


# ---------------------------------------------------------------- errors


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


def _describe(e: BaseException) -> str:
    """An error in one line, without statement data."""
    if isinstance(e, psycopg.Error):
        text = e.diag.message_primary or (str(e).strip().splitlines() or [""])[0]
        return f"database: {text or type(e).__name__}"
    if isinstance(e, BridgeError):
        return str(e)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _address(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return str(HostPort(str(peer[0]), int(peer[1])))
    return str(peer or "?")


# ---------------------------------------------------------------- one link


class _Link:
    """One TCP (TLS) connection carrying one :class:`BridgeConnection`.

    :meth:`send` checks a frame against the protocol and writes its bytes in
    the same step, so the wire order is the order the protocol saw. Socket
    errors become :class:`LinkError` here and nowhere else. (asyncio sets
    TCP_NODELAY on every TCP socket it creates.)
    """

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
            raise LinkClosed(e.strerror or _describe(e)) from e

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
            raise LinkClosed(e.strerror or _describe(e)) from e

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


# ---------------------------------------------------------------- vpn_state writes


class _VpnStateWriter:
    """Coalesces the ``vpn_state`` columns the bridge owns into at most one
    transaction per ``interval``; a database outage delays them (logged once),
    it never blocks the bridge."""

    def __init__(
        self,
        pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]],
        interval: float,
        on_acked: Callable[[Mapping[str, int]], Awaitable[None]] | None = None,
    ) -> None:
        self._pool = pool
        self._interval = interval
        self._on_acked = on_acked
        self._states: dict[str, str] = {}
        self._acks: dict[str, tuple[int, int]] = {}
        self._fenced: set[str] = set()
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="bridge-vpn-state")

    def bridge_state(self, vpn: str, state: str) -> None:
        self._states[vpn] = state
        self._dirty.set()

    def acked(self, vpn: str, index: int, epoch: int) -> None:
        self._acks[vpn] = (index, epoch)
        self._dirty.set()

    def fenced(self, vpn: str) -> None:
        self._fenced.add(vpn)
        self._dirty.set()

    async def _run(self) -> None:
        while True:
            await self._dirty.wait()
            await self.flush()
            await asyncio.sleep(self._interval)

    async def flush(self) -> None:
        self._dirty.clear()
        states, self._states = self._states, {}
        acks, self._acks = self._acks, {}
        fenced, self._fenced = self._fenced, set()
        if not (states or acks or fenced):
            return
        try:
            await self._write(states, acks, fenced)
        except BaseException as e:
            # Not written (a database error, or cancelled by close()): keep
            # what no newer value replaced meanwhile for the next flush.
            for vpn, state in states.items():
                self._states.setdefault(vpn, state)
            for vpn, ack in acks.items():
                self._acks.setdefault(vpn, ack)
            self._fenced |= fenced
            self._dirty.set()
            if not isinstance(e, psycopg.Error):
                raise
            if not self._failing:
                log.warning("bridge: cannot record replication state (%s); retrying", _describe(e))
            self._failing = True
            await asyncio.sleep(1.0)
            return
        if self._failing:
            log.info("bridge: replication state recorded again")
            self._failing = False
        if acks and self._on_acked is not None:
            await self._on_acked({vpn: index for vpn, (index, _) in acks.items()})

    async def _write(
        self, states: dict[str, str], acks: dict[str, tuple[int, int]], fenced: set[str]
    ) -> None:
        async with self._pool.connection() as conn, conn.transaction():
            for vpn, state in states.items():
                await conn.execute(
                    "UPDATE vpn_state SET bridge_state = %s, updated_at = now() WHERE vpn = %s",
                    (state, vpn),
                )
            for vpn, (index, epoch) in acks.items():
                await conn.execute(
                    "UPDATE vpn_state SET applied_index = %s, applied_epoch = %s,"
                    " applied_at = now(), updated_at = now() WHERE vpn = %s",
                    (index, epoch, vpn),
                )
            for vpn in fenced:
                await conn.execute(
                    "UPDATE vpn_state SET fenced = true, updated_at = now() WHERE vpn = %s",
                    (vpn,),
                )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                await self.flush()


def _pool(dsn: str, name: str) -> AsyncConnectionPool[psycopg.AsyncConnection[Any]]:
    return AsyncConnectionPool(
        dsn,
        min_size=1,
        max_size=4,
        open=False,
        kwargs={"autocommit": True, "connect_timeout": 10},
        check=AsyncConnectionPool.check_connection,
        timeout=5.0,
        name=name,
    )


_RESET_STATES = """
UPDATE vpn_state s SET bridge_state = 'disconnected', updated_at = now()
FROM vpn_config c
WHERE c.name = s.vpn AND c.role = %s AND s.bridge_state <> 'disconnected'
"""


async def _reset_states(
    pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]], role: Role
) -> None:
    """A previous process may have died while connected: start from the truth."""
    try:
        async with pool.connection() as conn:
            await conn.execute(_RESET_STATES, (role.value,))
    except psycopg.Error as e:
        log.warning("bridge: cannot reset bridge_state (%s)", _describe(e))


# ---------------------------------------------------------------- active side

_ACTIVE_VPNS = """
SELECT c.name, c.epoch, c.mode, c.sync_timeout_ms, c.on_sync_timeout,
       c.queue_patterns, c.topic_filters, c.expose_id,
       COALESCE((SELECT taken_over_at FROM vpn_epoch e WHERE e.vpn = c.name
                 AND e.epoch = c.epoch), 0)
FROM vpn_config c JOIN vpn_state s ON s.vpn = c.name
WHERE c.enabled AND c.role = 'active' AND NOT s.fenced
  AND NOT EXISTS (SELECT 1 FROM promotion p WHERE p.vpn = c.name AND p.state <> 'done')
ORDER BY c.name
"""
_LIVE_ROWS = """
SELECT queue, repl_id, publish_index, exchange, routing_key, properties, body
FROM live_message WHERE vpn = %s ORDER BY queue, publish_index
"""


def _entry_size(entry: LedgerEntry) -> int:
    event = entry.event
    if isinstance(event, Published):
        return 64 + len(event.body) + len(event.properties)
    return 64


@dataclass(eq=False)
class _Outbound:
    """One VPN's stream to one standby, on the active."""

    vpn: str
    epoch: int
    task: asyncio.Task[None] | None = None
    state: str = SYNCING
    live: bool = False  # the ledger subscriber queues entries for it
    next_index: int = 0  # the next index to send once live
    pending: deque[tuple[list[LedgerEntry], int]] = field(default_factory=deque)
    queued_bytes: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: first index of a group the standby was asked to commit ahead -> its
    #: answer (TxnApplied); the group's copy is held until then
    answers: dict[int, asyncio.Future[bool]] = field(default_factory=dict)

    def push(self, entries: list[LedgerEntry]) -> None:
        size = sum(_entry_size(e) for e in entries)
        self.pending.append((entries, size))
        self.queued_bytes += size
        self.wake.set()


@dataclass(eq=False)
class _StandbyPeer:
    """One connected standby, as the active sees it."""

    link: _Link
    streams: dict[str, _Outbound] = field(default_factory=dict)
    epochs: dict[str, int] = field(default_factory=dict)  # listed epoch per VPN
    failure: BaseException | None = None

    @property
    def name(self) -> str:
        site = self.link.conn.peer_site
        return f"{site!r} at {self.link.peer}" if site else self.link.peer

    def fail(self, exc: BaseException) -> None:
        """End the link from a stream task; the reader reports ``exc``."""
        if self.failure is None:
            self.failure = exc
        reason = exc if isinstance(exc, BridgeError) else PeerFailure(_describe(exc))
        self.link.fail(reason)


#: the active prunes its ledger at most this often (seconds)
PRUNE_INTERVAL = 1.0
#: how long the stream holds a group for the standby's answer to its commit ahead
ANSWER_WAIT = 1.0
#: voted transactions kept ready to commit ahead on the standby (the oldest go
#: first; one whose commit comes later takes the checked path, reading its row)
READY_KEPT = 1024


def _nothing() -> None:
    """An ``on_applied`` that no one waits for any more."""


class BridgeServer:
    """The active site's end of the bridge: serves every standby that dials in.

    Per standby: answers ``Hello`` and ``GetAllResources`` (the site's enabled,
    unfenced active VPNs with their settings and epoch from the database and
    their definitions from the management API), and per ``SyncRequest``
    replays the ledger (after a checkpoint when needed), then streams live
    entries. Acknowledgements release sync-mode confirms
    (:meth:`Replicator.standby_acked`), are recorded in ``vpn_state`` and
    let the ledger be pruned past them once older than ``retain_seconds``.
    """

    def __init__(
        self,
        site: str,
        dsn: str,
        writer: LedgerWriter,
        replicator: Replicator,
        *,
        management_url: str | None = None,
        tls: TlsConfig | None = None,
        retain_seconds: float = 300.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        handshake_timeout: float = 10.0,
        batch_size: int = 500,
        checkpoint_chunk_bytes: int = 4 * _MIB,
        max_queued_bytes: int = 64 * _MIB,
        ack_flush_interval: float = 0.05,
    ) -> None:
        self.site = site
        self._dsn = dsn
        self.writer = writer
        self.replicator = replicator
        self._api = ManagementAPI(management_url) if management_url else None
        self._ssl = make_server_context(tls) if tls is not None else None
        self._tls = tls
        self.retain_seconds = retain_seconds
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.handshake_timeout = handshake_timeout
        self.batch_size = batch_size
        self.checkpoint_chunk_bytes = checkpoint_chunk_bytes
        self.max_queued_bytes = max_queued_bytes
        self._ack_flush_interval = ack_flush_interval
        self._server: asyncio.Server | None = None
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None
        self._states: _VpnStateWriter | None = None
        self._peers: set[_StandbyPeer] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._shown: dict[str, str] = {}
        self._definitions_failures: dict[str, str] = {}
        #: VPN -> the index of the previous epoch's ledger it was taken over at
        self._taken_over: dict[str, int] = {}
        self._unsubscribe: Callable[[], None] | None = None
        #: answers standbys' questions about transactions (set by the node)
        self.coordinator: TxnOutcomes | None = None
        self._votes: dict[str, asyncio.Future[bool]] = {}
        #: txid -> what to run when the standby says it applied the transaction ahead
        #: txid -> (called if the standby applied it ahead, the answer it holds the stream for)
        self._ahead: dict[str, tuple[Callable[[], None], asyncio.Future[bool]]] = {}
        self._txn_tasks: set[asyncio.Task[None]] = set()
        self._prune_due: dict[str, int] = {}  # vpn -> newest acknowledged index
        self._pruner: asyncio.Task[None] | None = None
        self._pruned_at = -PRUNE_INTERVAL

    # -- lifecycle -----------------------------------------------------------

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port``; the ledger writer must be started."""
        self._pool = _pool(self._dsn, "bridge-active")
        await self._pool.open(wait=False)
        await _reset_states(self._pool, Role.ACTIVE)
        self._states = _VpnStateWriter(self._pool, self._ack_flush_interval, self._prune)
        self._states.start()
        self._unsubscribe = self.writer.subscribe(self._on_durable)
        try:
            self._server = await asyncio.start_server(self._handle, host, port)
        except OSError as e:
            await self.close()
            raise LinkError(f"cannot listen for standbys on {HostPort(host, port)}: {e}") from e
        log.info(
            "bridge: listening for standbys on %s (%s)",
            HostPort(host, port),
            "mutual TLS" if self._tls and self._tls.ca else "TLS" if self._tls else "plain TCP",
        )

    @property
    def port(self) -> int:
        """The port listened on (useful after ``start(host, 0)``)."""
        if self._server is None or not self._server.sockets:
            raise LinkError("the bridge server is not listening")
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening, drop every standby, record their state."""
        if self._server is not None:
            self._server.close()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self._states is not None:
            await self._states.close()
            self._states = None
        if self._pruner is not None:
            self._pruner.cancel()
            await asyncio.gather(self._pruner, return_exceptions=True)
            self._pruner = None
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

    async def relist(self) -> None:
        """Send every standby a fresh ResourceList (after VPNs were enabled,
        disabled or changed): new VPNs get synced, dropped ones stop."""
        for peer in list(self._peers):
            if peer.link.conn.phase is Phase.READY:
                try:
                    await self._send_resources(peer)
                except (BridgeError, psycopg.Error) as e:
                    log.warning("bridge: cannot relist VPNs to %s: %s", peer.name, _describe(e))

    # -- state -----------------------------------------------------------------

    def _state_changed(self, vpn: str) -> None:
        state = self.bridge_state(vpn)
        if self._shown.get(vpn, DISCONNECTED) != state:
            self._shown[vpn] = state
            log.info("bridge: VPN %s is %s", vpn, state)
            if self._states is not None:
                self._states.bridge_state(vpn, state)

    def _fence(self, vpn: str, reason: BridgeError) -> None:
        if vpn not in self.replicator.fenced:
            log.error(
                "bridge: VPN %s is fenced: a standby knows a newer epoch (%s); "
                "this site refuses its publishes from now on",
                vpn,
                reason.text,
            )
        self.replicator.fenced.add(vpn)
        if self._states is not None:
            self._states.fenced(vpn)

    async def _prune(self, acked: Mapping[str, int]) -> None:
        """Acknowledgements were recorded: prune the ledger behind them, at
        most once per :data:`PRUNE_INTERVAL` (acks are recorded every 50 ms
        under load; a prune that often was a DELETE and a wait for the live
        state per flush, for entries kept ``retain_seconds`` anyway) and off
        the recording loop. The newest index always gets its prune."""
        for vpn, index in acked.items():
            self._prune_due[vpn] = max(index, self._prune_due.get(vpn, 0))
        if self._pruner is None or self._pruner.done():
            self._pruner = asyncio.create_task(self._prune_soon(), name="bridge-ledger-prune")

    async def _prune_soon(self) -> None:
        while self._prune_due:
            wait = self._pruned_at + PRUNE_INTERVAL - asyncio.get_running_loop().time()
            if wait > 0:
                await asyncio.sleep(wait)
            due, self._prune_due = self._prune_due, {}
            self._pruned_at = asyncio.get_running_loop().time()
            for vpn, index in due.items():
                # Keep the acknowledged entry itself: a standby reconnecting later
                # proves with its epoch that it follows this ledger (no checkpoint).
                if index <= 1:
                    continue
                try:
                    await self.writer.reader.prune(vpn, index - 1, self.retain_seconds)
                except LedgerError as e:
                    log.warning("bridge: VPN %s: ledger not pruned: %s", vpn, e)

    def _on_durable(self, entries: Sequence[LedgerEntry]) -> None:
        """Ledger subscriber: queue live entries per stream; never blocks."""
        by_vpn: dict[str, list[LedgerEntry]] = {}
        for entry in entries:
            by_vpn.setdefault(entry.vpn, []).append(entry)
        for peer in list(self._peers):
            if peer.failure is not None:
                continue
            for vpn, items in by_vpn.items():
                out = peer.streams.get(vpn)
                if out is None or not out.live:
                    continue
                out.push(items)
                if out.queued_bytes > self.max_queued_bytes:
                    log.warning(
                        "bridge: standby %s is too slow (%d MiB of VPN %s queued); "
                        "dropping it, it will resync from its applied index",
                        peer.name,
                        out.queued_bytes // _MIB,
                        vpn,
                    )
                    peer.failure = LinkError(
                        f"too slow: over {self.max_queued_bytes // _MIB} MiB of VPN {vpn} queued"
                    )
                    peer.link.abort()
                    break

    # -- one standby -------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # noqa: S101 - always inside a task
        self._handlers.add(task)
        address = _address(writer)
        try:
            if self._ssl is not None and not await self._handshake(writer, address):
                return
            conn = BridgeConnection(Role.ACTIVE, self.site)
            peer = _StandbyPeer(_Link(conn, reader, writer, address, self.heartbeat_timeout))
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
                self._unanswered(peer)
                await peer.link.close()
        except asyncio.CancelledError:
            # Only close() cancels a handler. Returning (not re-raising) keeps
            # asyncio's stream callback from logging the cancellation as an
            # error when the node stops with a standby connected.
            return
        except Exception:
            log.exception("bridge: serving %s failed", address)
        finally:
            if not writer.is_closing():
                writer.close()
            self._handlers.discard(task)

    def _unanswered(self, peer: _StandbyPeer) -> None:
        """``peer`` is gone: its commits ahead will not be answered."""
        for out in peer.streams.values():
            for answer in out.answers.values():
                if not answer.done():
                    answer.set_result(False)
        self._ahead = {t: a for t, a in self._ahead.items() if not a[1].done()}

    async def _handshake(self, writer: asyncio.StreamWriter, address: str) -> bool:
        assert self._ssl is not None  # noqa: S101 - checked by the caller
        try:
            await writer.start_tls(self._ssl, ssl_handshake_timeout=self.handshake_timeout)
        except ssl.SSLError as e:
            reason = describe_tls_error(e)
            if isinstance(e, ssl.SSLCertVerificationError) and self._tls and self._tls.ca:
                reason += f" (the standby's certificate is not signed by {self._tls.ca})"
            log.warning("bridge: refused standby at %s: TLS handshake failed: %s", address, reason)
        except (ConnectionError, OSError, TimeoutError) as e:
            if isinstance(e, TimeoutError):
                reason = f"no handshake within {self.handshake_timeout:g} s"
            elif isinstance(e, ConnectionResetError | BrokenPipeError):
                reason = "the standby hung up"
            else:
                reason = e.strerror or _describe(e)
            log.warning(
                "bridge: TLS handshake with standby at %s failed: %s "
                "(did it refuse this site's certificate?)",
                address,
                reason,
            )
        else:
            return True
        writer.transport.abort()
        return False

    async def _serve(self, peer: _StandbyPeer) -> None:
        link = peer.link
        heartbeats = asyncio.create_task(link.heartbeats(self.heartbeat_interval))
        try:
            await self._converse(peer)
        except LinkError as e:
            cause = peer.failure or e
            log.warning("bridge: standby %s lost: %s", peer.name, _describe(cause))
        except RemoteProtocolError as e:
            log.error("bridge: standby %s broke the protocol: %s; closing", peer.name, e)
            link.fail(e)
        except (psycopg.Error, LedgerError, InvalidSettings) as e:
            log.error("bridge: serving standby %s failed: %s; closing", peer.name, _describe(e))
            link.fail(PeerFailure(f"the active failed: {_describe(e)}"))
        finally:
            heartbeats.cancel()
            await asyncio.gather(heartbeats, return_exceptions=True)

    async def _converse(self, peer: _StandbyPeer) -> None:
        link = peer.link
        while True:
            item = await link.next_frame()
            if item is None:
                if peer.failure is not None:
                    raise LinkClosed(_describe(peer.failure))
                log.info("bridge: standby %s closed the link", peer.name)
                return
            if isinstance(item, RemoteProtocolError):
                self._vpn_fault(peer, item)
            elif isinstance(item, Hello):
                link.send(Hello(self.site, PROTOCOL_VERSION, Role.ACTIVE))
                log.info("bridge: standby site %r connected from %s", item.site, link.peer)
            elif isinstance(item, GetAllResources):
                await self._send_resources(peer)
            elif isinstance(item, SyncRequest):
                self._start_stream(peer, item)
            elif isinstance(item, Ack | TxnVote | TxnQuery | TxnApplied):
                self._standby_said(peer, item)
            elif isinstance(item, Error):
                if item.closes_connection:
                    log.warning(
                        "bridge: standby %s closed the link: %s", peer.name, item.exception()
                    )
                    return
                self._abandoned(peer, item)

    # -- transactions: the coordinator's StandbyLink --------------------------

    def _standby_of(self, vpn: str) -> _StandbyPeer | None:
        for peer in self._peers:
            if vpn in peer.epochs and peer.failure is None:
                return peer
        return None

    def prepare(self, vpn: str, txid: str, events: bytes, within: float) -> Awaitable[bool]:
        """Ask the standby to prepare ``txid``: the request is sent before
        this returns (so the caller's own prepare starts after it, the
        standby's round being the longer); the awaitable is True once it
        voted yes within ``within`` seconds. A standby that is not connected
        cannot prepare: False at once (the VPN's on-sync-timeout policy then
        applies). The awaitable is a plain future, resolved by the vote or
        the timer: the caller wakes one event-loop turn after the vote, not
        two (as behind a task of its own)."""
        peer = self._standby_of(vpn)
        loop = asyncio.get_running_loop()
        vote: asyncio.Future[bool] = loop.create_future()
        if peer is None or not peer.link.try_send(TxnPrepare(vpn, peer.epochs[vpn], txid, events)):
            vote.set_result(False)
            return vote
        self._votes[txid] = vote
        timer = loop.call_later(within, self._no_vote, txid, vote)
        vote.add_done_callback(lambda _: timer.cancel())
        return vote

    def _no_vote(self, txid: str, vote: asyncio.Future[bool]) -> None:
        """The standby did not vote in time: the vote counts as no."""
        if self._votes.get(txid) is vote:
            del self._votes[txid]
        if not vote.done():
            vote.set_result(False)

    def commit_ahead(self, vpn: str, txid: str, first: int, on_applied: Callable[[], None]) -> bool:
        """Tell the standby the broker committed ``txid`` (its group at
        ``first`` onwards) so it may apply it ahead of the stream;
        ``on_applied()`` runs if it says it did. The group's copy in the
        stream waits for the answer (:meth:`_pump`). False when no standby
        streams the VPN live (nothing sent)."""
        peer = self._standby_of(vpn)
        out = peer.streams.get(vpn) if peer is not None else None
        if peer is None or out is None or not out.live or first < out.next_index:
            return False
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._ahead[txid] = (on_applied, answer)
        out.answers[first] = answer
        if not peer.link.try_send(TxnCommit(vpn, peer.epochs[vpn], txid, first)):
            self._ahead.pop(txid, None)
            del out.answers[first]
            return False
        return True

    def outcome(self, vpn: str, txid: str, commit: bool) -> None:
        """Tell the standby how ``txid`` ended (if one is connected: else it
        asks when it reconnects)."""
        ahead = self._ahead.pop(txid, None)
        if ahead is not None and not ahead[1].done():
            # settled without the answer (timed out): the stream still waits for it
            self._ahead[txid] = (_nothing, ahead[1])
        self._votes.pop(txid, None)  # a vote no one waits for any more
        peer = self._standby_of(vpn)
        if peer is not None:
            peer.link.try_send(TxnOutcome(vpn, peer.epochs[vpn], txid, commit))

    def _standby_said(
        self, peer: _StandbyPeer, frame: Ack | TxnVote | TxnQuery | TxnApplied
    ) -> None:
        """An acknowledgement, a transaction vote or a question about
        transactions from the standby."""
        if isinstance(frame, Ack):
            self.replicator.standby_acked(frame.vpn, frame.index)
            if self._states is not None:
                self._states.acked(frame.vpn, frame.index, frame.epoch)
        elif isinstance(frame, TxnVote):
            vote = self._votes.pop(frame.txid, None)
            if vote is not None and not vote.done():
                vote.set_result(frame.ok)
        elif isinstance(frame, TxnApplied):
            ahead = self._ahead.pop(frame.txid, None)
            if ahead is not None:
                on_applied, answer = ahead
                if not answer.done():
                    answer.set_result(frame.applied)
                if frame.applied:
                    on_applied()
        else:
            task = asyncio.create_task(self._answer(peer, frame))
            self._txn_tasks.add(task)
            task.add_done_callback(self._txn_tasks.discard)

    async def _answer(self, peer: _StandbyPeer, query: TxnQuery) -> None:
        if self.coordinator is None:
            return
        outcomes = await self.coordinator.outcomes_for(query.txids)
        epoch = peer.epochs.get(query.vpn)
        if epoch is None:
            return
        for txid, commit in outcomes.items():
            if commit is not None:  # in flight here: its outcome follows when decided
                peer.link.try_send(TxnOutcome(query.vpn, epoch, txid, commit))

    def _vpn_fault(self, peer: _StandbyPeer, fault: RemoteProtocolError) -> None:
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

    def _abandoned(self, peer: _StandbyPeer, error: Error) -> None:
        exc = error.exception()
        log.warning("bridge: standby %s abandoned VPN %s: %s", peer.name, error.vpn, exc)
        out = peer.streams.pop(error.vpn, None)
        if out is not None and out.task is not None:
            out.task.cancel()
        if isinstance(exc, StaleEpoch):
            self._fence(error.vpn, exc)
        self._state_changed(error.vpn)

    async def _send_resources(self, peer: _StandbyPeer) -> None:
        vpns = await self._load_vpns()
        definitions = await asyncio.gather(*(self._definitions(s.name) for s, _ in vpns))
        listing = ResourceList(
            tuple(
                VpnResource.from_settings(s, epoch, d, self._taken_over.get(s.name, 0))
                for (s, epoch), d in zip(vpns, definitions, strict=True)
            )
        )
        peer.link.send(listing)
        peer.epochs = {s.name: epoch for s, epoch in vpns}
        for vpn in [v for v in peer.streams if v not in peer.epochs]:
            out = peer.streams.pop(vpn)
            if out.task is not None:
                out.task.cancel()
            self._state_changed(vpn)

    async def _load_vpns(self) -> list[tuple[VpnSettings, int]]:
        assert self._pool is not None  # noqa: S101 - started
        try:
            async with self._pool.connection() as conn, conn.cursor(row_factory=tuple_row) as cur:
                await cur.execute(_ACTIVE_VPNS)
                rows = await cur.fetchall()
        except psycopg.OperationalError as e:
            raise LedgerError(f"the site database is unavailable: {_describe(e)}") from e
        out = []
        for name, epoch, mode, timeout, policy, queues, topics, expose_id, taken_over in rows:
            if name in self.replicator.fenced:
                continue
            self._taken_over[name] = int(taken_over)
            settings = VpnSettings.from_args(
                name, "active", mode, timeout, policy, tuple(queues), tuple(topics), expose_id
            )
            out.append((settings, int(epoch)))
        return out

    async def _definitions(self, vpn: str) -> bytes:
        """The VPN's definitions with the users and permissions that let its
        clients log in (``bridge._configsync``), or b"" when not readable."""
        if self._api is None:
            return b""
        try:
            found = await asyncio.to_thread(vpn_definitions, self._api, vpn)
        except ConfigSyncError as e:
            if self._definitions_failures.get(vpn) != str(e):  # once per cause, not per relist
                log.warning("bridge: VPN %s: definitions not sent (no config-sync): %s", vpn, e)
            self._definitions_failures[vpn] = str(e)
            return b""
        self._definitions_failures.pop(vpn, None)
        return found

    # -- one VPN stream --------------------------------------------------------

    def _start_stream(self, peer: _StandbyPeer, request: SyncRequest) -> None:
        vpn = request.vpn
        old = peer.streams.pop(vpn, None)
        if old is not None and old.task is not None:
            old.task.cancel()
        out = _Outbound(vpn, peer.epochs.get(vpn, request.epoch))
        out.task = asyncio.create_task(self._stream(peer, out, request, old), name=f"bridge-{vpn}")
        peer.streams[vpn] = out
        self._state_changed(vpn)

    async def _stream(
        self, peer: _StandbyPeer, out: _Outbound, request: SyncRequest, old: _Outbound | None
    ) -> None:
        if old is not None and old.task is not None:
            await asyncio.wait([old.task])  # cancelled: it sends nothing more
        try:
            await self._catch_up(peer.link, out, request)
            out.state = CONNECTED
            self._state_changed(out.vpn)
            await self._pump(peer.link, out)
        except Fenced as e:
            self._fence(out.vpn, e)
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
                _describe(e),
            )
            peer.fail(e)

    async def _follows(self, vpn: str, last_index: int, last_epoch: int) -> bool:
        """Whether the standby's state is a prefix of this ledger that a
        replay can continue (else it needs a checkpoint)."""
        if last_index == 0:
            return await self.writer.reader.oldest_retained(vpn) <= 1
        if last_index > self.writer.durable_index(vpn):
            return False
        try:
            found = await self.writer.reader.read_range(vpn, last_index, 1)
        except LedgerPruned:
            return False
        return bool(found) and found[0].index == last_index and found[0].epoch == last_epoch

    async def _catch_up(self, link: _Link, out: _Outbound, request: SyncRequest) -> None:
        vpn = out.vpn
        try:
            self.writer.durable_index(vpn)
        except VpnNotOpen:
            await self.writer.open_vpn(vpn)
        last = request.last_applied_index
        if await self._follows(vpn, last, request.last_applied_epoch):
            link.send(SyncAccepted(vpn, out.epoch, last + 1))
            if last:  # durable on the standby: as good as an Ack
                self.replicator.standby_acked(vpn, last)
                if self._states is not None:
                    self._states.acked(vpn, last, request.last_applied_epoch)
            next_index = last + 1
            log.info("bridge: VPN %s: replaying to %s from index %d", vpn, link.peer, next_index)
        else:
            next_index = await self._send_checkpoint(link, out)
        while True:
            durable = self.writer.durable_index(vpn)
            if next_index > durable:
                # No await between the check and going live: see the module docstring.
                out.live, out.next_index = True, next_index
                link.send(SyncFinished(vpn, out.epoch, next_index - 1))
                log.info("bridge: VPN %s: %s caught up at index %d", vpn, link.peer, next_index - 1)
                return
            limit = min(self.batch_size, durable - next_index + 1)
            entries = await self.writer.reader.read_range(vpn, next_index, limit)
            if not entries:
                raise LedgerError(f"durable index {durable} but no entry {next_index}", vpn)
            self._send_events(link, out, entries)
            next_index = entries[-1].index + 1
            await link.flush()

    def _send_events(self, link: _Link, out: _Outbound, entries: Sequence[LedgerEntry]) -> None:
        epoch = max(out.epoch, entries[-1].epoch)
        link.send(Events(out.vpn, epoch, tuple(entries)))

    async def _send_checkpoint(self, link: _Link, out: _Outbound) -> int:
        """Send SyncAccepted and the VPN's live messages as of one snapshot;
        returns the index the replay continues from."""
        assert self._pool is not None  # noqa: S101 - started
        vpn, count = out.vpn, 0
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            # The index live_message reflects (the ledger may be further on:
            # the replay after the checkpoint covers the difference).
            cur = await conn.execute("SELECT live_index FROM vpn_live_state WHERE vpn = %s", (vpn,))
            found = await cur.fetchone()
            if found is None:
                raise LedgerError("no vpn_live_state row", vpn)
            at = int(found[0])
            link.send(SyncAccepted(vpn, out.epoch, at + 1))
            ready: list[CheckpointRow] | None = None
            chunk: list[CheckpointRow] = []
            size = 0
            async with conn.cursor(name="bridge_checkpoint", row_factory=tuple_row) as rows:
                rows.itersize = 500
                await rows.execute(_LIVE_ROWS, (vpn,))
                async for queue, rid, index, exchange, key, props, body in rows:
                    row = CheckpointRow(
                        queue,
                        ReplicationId(bytes(rid)),
                        index,
                        exchange,
                        key,
                        bytes(props),
                        bytes(body),
                    )
                    chunk.append(row)
                    count += 1
                    size += 64 + len(row.body) + len(row.properties)
                    if size >= self.checkpoint_chunk_bytes or len(chunk) >= 10_000:
                        if ready is not None:
                            link.send(Checkpoint(vpn, out.epoch, at, tuple(ready), False))
                            await link.flush()
                        ready, chunk, size = chunk, [], 0
            if ready is not None and chunk:
                link.send(Checkpoint(vpn, out.epoch, at, tuple(ready), False))
                link.send(Checkpoint(vpn, out.epoch, at, tuple(chunk), True))
            else:
                link.send(Checkpoint(vpn, out.epoch, at, tuple(ready or chunk), True))
        await link.flush()
        log.info(
            "bridge: VPN %s: sent %s a checkpoint of %d live messages at index %d",
            vpn,
            link.peer,
            count,
            at,
        )
        return at + 1

    async def _pump(self, link: _Link, out: _Outbound) -> None:
        """Live phase: send what the ledger subscriber queued, in order.

        A group the standby was asked to commit ahead (:meth:`commit_ahead`)
        is sent once the standby answered, not as soon as it is durable:
        the standby could not apply the copy before the commit ahead anyway
        (both go through its one queue per VPN, in order), and sending it at
        once made both nodes encode, encrypt and decode it while the client
        waits for that commit. Entries before the group go at once."""
        while True:
            if not out.pending:
                out.wake.clear()
                await out.wake.wait()
                continue
            batch: list[LedgerEntry] = []
            while out.pending and len(batch) < self.batch_size:
                entries, size = out.pending.popleft()
                out.queued_bytes -= size
                batch.extend(e for e in entries if e.index >= out.next_index)
            if not batch:
                continue
            if batch[0].index != out.next_index:
                raise LedgerError(
                    f"live entries jump from {out.next_index} to {batch[0].index}", out.vpn
                )
            while batch:
                held = self._held_at(out, batch)
                ready, batch = batch[:held], batch[held:]
                for i in range(0, len(ready), self.batch_size):
                    self._send_events(link, out, ready[i : i + self.batch_size])
                if ready:
                    out.next_index = ready[-1].index + 1
                    await link.flush()
                if batch:
                    await self._await_answer(out, out.answers.pop(batch[0].index))

    @staticmethod
    def _held_at(out: _Outbound, batch: list[LedgerEntry]) -> int:
        """How many entries of ``batch`` go before the first group whose
        commit ahead is still unanswered (``len(batch)``: none is)."""
        first, last = batch[0].index, batch[-1].index
        for at in sorted(out.answers):
            if at > last:
                break
            if at < first or out.answers[at].done():
                del out.answers[at]  # answered, or sent already: nothing to hold
                continue
            return at - first
        return len(batch)

    async def _await_answer(self, out: _Outbound, answer: asyncio.Future[bool]) -> None:
        """Wait for the standby's answer to a commit ahead; after
        ``ANSWER_WAIT`` the group goes without it (a standby that went
        silent is dropped by the heartbeats, not here)."""
        try:
            async with asyncio.timeout(ANSWER_WAIT):
                await asyncio.shield(answer)
        except TimeoutError:
            log.warning(
                "bridge: VPN %s: no answer to a commit ahead in %.1f s; streaming the group",
                out.vpn,
                ANSWER_WAIT,
            )


# ---------------------------------------------------------------- standby side

_LOCK_VPN = "SELECT role, enabled, epoch FROM vpn_config WHERE name = %s FOR UPDATE"
_ADD_STANDBY = """
INSERT INTO vpn_config (name, enabled, role, epoch, mode, sync_timeout_ms, on_sync_timeout,
                        queue_patterns, topic_filters, expose_id)
VALUES (%s, true, 'standby', %s, %s, %s, %s, %s, %s, %s)
"""
_RAISE_EPOCH = "UPDATE vpn_config SET epoch = %s, updated_at = now() WHERE name = %s AND epoch < %s"
#: a standby VPN's settings, which follow the active's at every listing
_FOLLOWED = "mode sync_timeout_ms on_sync_timeout queue_patterns topic_filters expose_id".split()
_STANDBY_SETTINGS = """
SELECT mode, sync_timeout_ms, on_sync_timeout, queue_patterns, topic_filters, expose_id
FROM vpn_config WHERE name = %s
"""
_FOLLOW_SETTINGS = """
UPDATE vpn_config SET mode = %s, sync_timeout_ms = %s, on_sync_timeout = %s, queue_patterns = %s,
                      topic_filters = %s, expose_id = %s, updated_at = now()
WHERE name = %s
"""
_KEEP_DEFINITIONS = """
UPDATE vpn_config SET definitions = %s WHERE name = %s AND definitions IS DISTINCT FROM %s
"""


@dataclass(frozen=True, slots=True)
class _Relisted:
    """Worker item: the active (re)listed the VPN."""

    resource: VpnResource


@dataclass(frozen=True, slots=True)
class _Resync:
    """Worker item: resynchronise from the applied index (after a Gap)."""

    reason: str


_Item = _Relisted | _Resync | SyncAccepted | Checkpoint | Events | SyncFinished | TxnCommit


@dataclass(eq=False)
class _Inbound:
    """One VPN's stream from the active, on the standby."""

    vpn: str
    queue: asyncio.Queue[_Item]
    task: asyncio.Task[None] | None = None
    streaming: bool = False  # a SyncRequest is out and not refused or abandoned
    awaiting_accept: bool = False  # drop old-stream frames until SyncAccepted
    refused_below: int = 0  # an epoch the active was refused for (fenced)
    acked: int = 0
    ahead: int = 0  # last index of the group last applied ahead of the stream
    rows: list[CheckpointRow] = field(default_factory=list)


@dataclass(eq=False)
class _Session:
    link: _Link
    streams: dict[str, _Inbound] = field(default_factory=dict)
    established: bool = False
    failure: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        reason = exc if isinstance(exc, BridgeError) else PeerFailure(_describe(exc))
        self.link.fail(reason)


class BridgeClient:
    """The standby site's end of the bridge: keeps a link to the active up.

    :meth:`run` connects (TLS when configured), retries with exponential
    back-off and jitter, and per VPN the active lists: config-sync (its
    definitions imported into the local broker, the VPN enabled here as
    standby), ``SyncRequest`` from the applied index, then checkpoint install
    and batch apply, each acknowledged once durable.
    """

    def __init__(
        self,
        site: str,
        dsn: str,
        peer: HostPort,
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
    ) -> None:
        self.site = site
        self._dsn = dsn
        self.peer = peer
        self._api = ManagementAPI(management_url, keep_users=keep_users) if management_url else None
        self._ssl = make_client_context(tls) if tls is not None else None
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
        self._link: _Link | None = None  # the current session's, while one is up
        self._states: dict[str, str] = {}
        self._writes: _VpnStateWriter | None = None
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None
        self._applier: StandbyApplier | None = None
        #: the standby database connection commits ahead run on (on the loop)
        self._ahead_conn: psycopg.AsyncConnection[Any] | None = None
        self._skipped: dict[str, str] = {}  # VPN -> why it is not replicated (logged once)
        self._config_sync_failures: dict[str, str] = {}  # VPN -> why (logged once)
        #: Established sessions so far (tests and status).
        self.sessions = 0
        #: the standby's side of local transactions (set by the node)
        self.participant: TxnParticipant | None = None
        #: txid -> its voted events made ready to commit ahead, until the commit or the outcome
        self._ready: OrderedDict[str, ReadyAhead] = OrderedDict()
        self._txn_tasks: set[asyncio.Task[None]] = set()
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
        self._pool = _pool(self._dsn, "bridge-standby")
        self._applier = StandbyApplier(self._dsn)
        try:
            await self._pool.open(wait=False)
            await _reset_states(self._pool, Role.STANDBY)
            self._writes = _VpnStateWriter(self._pool, 0.05)
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
            if self._ahead_conn is not None:
                await self._ahead_conn.close()
                self._ahead_conn = None
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
            _describe(error) if error is not None else "?",
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
            log.warning("bridge to %s lost: %s; reconnecting", self.peer, _describe(cause))
        else:
            if session.failure is not None and not self._stop.is_set():
                log.warning(
                    "bridge to %s lost: %s; reconnecting", self.peer, _describe(session.failure)
                )
        finally:
            for task in (
                heartbeats,
                relists,
                *(s.task for s in session.streams.values() if s.task),
            ):
                task.cancel()
            await asyncio.gather(
                heartbeats,
                relists,
                *(s.task for s in session.streams.values() if s.task),
                return_exceptions=True,
            )
            for vpn in session.streams:
                self._set_state(vpn, DISCONNECTED)
            self._link = None
            await link.close()

    async def _connect(self) -> _Link:
        host, port = self.peer.host, self.peer.port
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(host, port, ssl=self._ssl)
        except TimeoutError as e:
            raise PeerUnreachable(f"no answer within {self.connect_timeout:g} s") from e
        except ssl.SSLError as e:
            raise TlsRefused(
                f"TLS handshake with the active failed: {describe_tls_error(e)}"
            ) from e
        except OSError as e:
            raise PeerUnreachable(f"cannot connect: {e.strerror or e}") from e
        epochs = await self._known_epochs()
        conn = BridgeConnection(Role.STANDBY, self.site, known_epochs=epochs)
        return _Link(conn, reader, writer, str(self.peer), self.heartbeat_timeout)

    async def _known_epochs(self) -> dict[str, int]:
        assert self._pool is not None  # noqa: S101 - run() opened it
        async with self._pool.connection() as conn, conn.cursor(row_factory=tuple_row) as cur:
            await cur.execute("SELECT name, epoch FROM vpn_config")
            return {str(name): int(epoch) for name, epoch in await cur.fetchall()}

    async def _greet(self, link: _Link) -> None:
        try:
            link.send(Hello(self.site, PROTOCOL_VERSION, Role.STANDBY))
            answer = await link.next_frame()
        except LinkClosed as e:
            raise self._hung_up(e.text) from e
        if answer is None:
            raise self._hung_up("it closed the link before answering Hello")
        if isinstance(answer, Error):
            raise answer.exception()
        if not isinstance(answer, Hello):  # pragma: no cover - the protocol allows nothing else
            raise PeerFailure(f"expected Hello, got {type(answer).__name__}")
        log.info("bridge: connected to active site %r at %s", answer.site, self.peer)
        self.peer_site = answer.site
        link.send(GetAllResources())

    def _hung_up(self, text: str) -> LinkError:
        if self._ssl is None:
            return LinkClosed(text)
        return TlsRefused(
            f"the active hung up right after the TLS handshake ({text}): it most likely "
            "refused this site's certificate (not signed by the CA it trusts)"
        )

    def relist_now(self) -> None:
        """Ask the active for its VPNs now (a VPN here changed role), not at
        the next periodic relist."""
        if self._link is not None:
            self._link.try_send(GetAllResources())

    async def _relist(self, link: _Link) -> None:
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
            elif isinstance(item, SyncAccepted | Checkpoint | Events | SyncFinished | TxnCommit):
                # a TxnCommit goes in line with the stream: it is applied
                # after what came before it and before what comes after
                inbound = session.streams.get(item.vpn)
                if inbound is not None:
                    await inbound.queue.put(item)
            elif isinstance(item, TxnPrepare | TxnOutcome):
                self._spawn_txn(self._txn(session, item))
            elif isinstance(item, Error):
                if item.closes_connection:
                    raise item.exception()
                self._refused(session, item)

    def _spawn_txn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._txn_tasks.add(task)
        task.add_done_callback(self._txn_tasks.discard)

    async def _txn(self, session: _Session, frame: TxnPrepare | TxnOutcome) -> None:
        """The participant's part of a local transaction (txn/_participant.py)."""
        if self.participant is None:
            return
        if isinstance(frame, TxnOutcome):
            self._ready.pop(frame.txid, None)
            await self.participant.outcome(frame.vpn, frame.txid, frame.commit)
            return
        voted = await self.participant.prepare(
            frame.vpn, frame.txid, frame.events, functools.partial(self._get_ready, frame)
        )
        if not voted:
            self._ready.pop(frame.txid, None)
        epoch = session.link.conn.known_epoch(frame.vpn)
        session.link.try_send(TxnVote(frame.vpn, epoch, frame.txid, voted is not None))

    def _get_ready(self, frame: TxnPrepare, voted: Voted) -> None:
        """The commit ahead's statement, built while the participant's row
        is written (for a yes vote; a no drops it), so the active's broker
        commit is not kept waiting for it."""
        if not voted or self._applier is None:
            return
        self._ready[frame.txid] = self._applier.ready_ahead(frame.vpn, frame.txid, voted)
        if len(self._ready) > READY_KEPT:
            self._ready.popitem(last=False)

    async def _ask_in_doubt(self, session: _Session, vpn: str) -> None:
        """After a (re)sync: ask the active how our prepared transactions ended."""
        if self.participant is None:
            return
        try:
            txids = await self.participant.in_doubt(vpn)
        except psycopg.Error as e:
            log.warning("bridge: VPN %s: in-doubt transactions not read: %s", vpn, e)
            return
        if txids:
            log.info(
                "bridge: VPN %s: asking the active about %d prepared transaction(s)",
                vpn,
                len(txids),
            )
            epoch = session.link.conn.known_epoch(vpn)
            session.link.try_send(TxnQuery(vpn, epoch, tuple(txids[:1000])))

    async def _vpn_fault(self, session: _Session, fault: RemoteProtocolError) -> None:
        inbound = session.streams.get(fault.vpn)
        if isinstance(fault, Gap) and inbound is not None:
            log.warning("bridge: %s; resyncing from the applied index", fault)
            # Queued behind what was received before the gap: the request
            # goes out once that is applied, from the index it reached.
            await inbound.queue.put(_Resync(str(fault)))
        elif isinstance(fault, StaleEpoch):
            log.error(
                "bridge: VPN %s: refused a frame from the active at %s: %s; "
                "waiting for an active with a current epoch",
                fault.vpn,
                self.peer,
                fault,
            )
            session.link.try_send(Error.from_exception(fault))
            if inbound is not None:
                inbound.streaming = False
                inbound.refused_below = fault.known or 0
            self._set_state(fault.vpn, DISCONNECTED)
        else:
            log.debug("bridge: %s", fault)

    def _refused(self, session: _Session, error: Error) -> None:
        exc = error.exception()
        inbound = session.streams.get(error.vpn)
        if isinstance(exc, StaleEpoch):
            log.error(
                "bridge: VPN %s: the active at %s is fenced (%s); not replicating from it",
                error.vpn,
                self.peer,
                exc.text,
            )
            if inbound is not None:
                inbound.refused_below = session.link.conn.known_epoch(error.vpn)
        else:
            log.warning("bridge: VPN %s: the active refused to sync: %s", error.vpn, exc)
        if inbound is not None:
            inbound.streaming = False
        self._set_state(error.vpn, DISCONNECTED)

    async def _listed(self, session: _Session, listing: ResourceList) -> None:
        listed = {r.name: r for r in listing.vpns}
        for vpn in [v for v in session.streams if v not in listed]:
            gone = session.streams.pop(vpn)
            if gone.task is not None:
                gone.task.cancel()
            log.info("bridge: VPN %s is no longer replicated by the active", vpn)
            self._set_state(vpn, DISCONNECTED)
        # Settled here, not only in the VPNs' workers: which VPNs are standby
        # here and which active ones are fenced. A starting node waits for
        # this (:attr:`listed`) before it admits clients.
        for resource in listing.vpns:
            await self._adopt(resource)
        self.listed.set()
        for resource in listing.vpns:
            inbound = session.streams.get(resource.name)
            if inbound is None:
                inbound = _Inbound(resource.name, asyncio.Queue(maxsize=64))
                inbound.task = asyncio.create_task(
                    self._work(session, inbound), name=f"bridge-apply-{resource.name}"
                )
                session.streams[resource.name] = inbound
            await inbound.queue.put(_Relisted(resource))

    # -- one VPN's apply worker ------------------------------------------------

    async def _work(self, session: _Session, inbound: _Inbound) -> None:
        try:
            held: _Item | None = None
            while True:
                item = held if held is not None else await inbound.queue.get()
                held = await self._handle_item(session, inbound, item)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            session.fail(e)

    async def _handle_item(self, session: _Session, inbound: _Inbound, item: _Item) -> _Item | None:
        """Apply one item; returns an item taken from the queue but not used."""
        if isinstance(item, _Relisted):
            await self._relisted(session, inbound, item.resource)
        elif isinstance(item, _Resync):
            await self._request_sync(session, inbound)
        elif inbound.awaiting_accept and not isinstance(item, SyncAccepted):
            pass  # the tail of a stream this side abandoned
        elif isinstance(item, SyncAccepted):
            inbound.awaiting_accept, inbound.acked, inbound.rows = False, 0, []
        elif isinstance(item, Checkpoint):
            inbound.rows.extend(item.rows)
            if item.last:
                await self._install(session, inbound, item)
        elif isinstance(item, Events):
            return await self._apply(session, inbound, item)
        elif isinstance(item, TxnCommit):
            await self._apply_ahead(session, inbound, item)
        elif inbound.streaming:  # SyncFinished of a stream not refused meanwhile
            self._set_state(inbound.vpn, CONNECTED)
            self._spawn_txn(self._ask_in_doubt(session, inbound.vpn))
        return None

    async def _relisted(self, session: _Session, inbound: _Inbound, resource: VpnResource) -> None:
        if not await self._config_sync(resource):
            return
        known = session.link.conn.known_epoch(resource.name)
        if inbound.streaming or (inbound.refused_below and resource.epoch < known):
            return
        await self._request_sync(session, inbound)

    async def _request_sync(self, session: _Session, inbound: _Inbound) -> None:
        assert self._pool is not None  # noqa: S101 - run() opened it
        vpn = inbound.vpn
        async with self._pool.connection() as conn, conn.cursor(row_factory=tuple_row) as cur:
            await cur.execute(
                "SELECT applied_index, applied_epoch FROM vpn_state WHERE vpn = %s", (vpn,)
            )
            found = await cur.fetchone()
        applied, applied_epoch = (int(found[0]), int(found[1])) if found else (0, 0)
        if applied == 0:
            applied_epoch = 0
        epoch = max(session.link.conn.known_epoch(vpn), applied_epoch, 1)
        try:
            session.link.send(SyncRequest(vpn, epoch, applied, applied_epoch))
        except LocalProtocolError as e:
            log.debug("bridge: VPN %s: no sync request now: %s", vpn, e)
            return
        inbound.streaming, inbound.awaiting_accept = True, True
        log.info("bridge: VPN %s: sync requested from index %d", vpn, applied + 1)
        self._set_state(vpn, SYNCING)

    async def _config_sync(self, resource: VpnResource) -> bool:
        """Enable the VPN here as standby if it is new, follow the active's
        settings and keep its definitions (``_adopt``), and import them, users
        and permissions included, into the local broker; False when it must
        not be replicated here (enabled as active, or disabled by the admin)."""
        vpn = resource.name
        why = await self._adopt(resource)
        if why is not None:
            if self._skipped.get(vpn) != why:
                log.error("bridge: VPN %s is not replicated here: %s", vpn, why)
            self._skipped[vpn] = why
            self._set_state(vpn, DISCONNECTED)
            return False
        self._skipped.pop(vpn, None)
        if self._api is None:
            return True
        if not resource.definitions_json:
            self._config_sync_failed(vpn, "the active sent no definitions")
            return True
        try:
            created = await asyncio.to_thread(
                import_vpn_definitions, self._api, vpn, resource.definitions_json
            )
        except ConfigSyncError as e:
            self._config_sync_failed(vpn, str(e))
            return True
        if created:
            log.info("bridge: VPN %s: vhost created on the local broker", vpn)
        if self._config_sync_failures.pop(vpn, None) is not None:
            log.info("bridge: VPN %s: config-sync works again", vpn)
        return True

    def _config_sync_failed(self, vpn: str, why: str) -> None:
        """Log once per cause: the same failure comes back at every relist."""
        if self._config_sync_failures.get(vpn) != why:
            log.warning("bridge: VPN %s: broker config not synced: %s", vpn, why)
        self._config_sync_failures[vpn] = why

    async def _follow_active(
        self, conn: psycopg.AsyncConnection[Any], resource: VpnResource
    ) -> None:
        """Make a standby VPN's stored settings the active's (a change is
        logged once, when it arrives) and keep the definitions it sent last,
        so a promotion can import them again with the active gone."""
        vpn = resource.name
        listed = (
            resource.mode.value,
            resource.sync_timeout_ms,
            resource.on_sync_timeout.value,
            list(resource.queue_patterns),
            [str(t) for t in resource.topic_filters],
            resource.expose_id,
        )
        cur = await conn.execute(_STANDBY_SETTINGS, (vpn,))
        stored = await cur.fetchone()
        changes = [
            f"{name} {old!r} -> {new!r}"
            for name, old, new in zip(_FOLLOWED, stored or listed, listed, strict=True)
            if old != new
        ]
        if changes:
            await conn.execute(_FOLLOW_SETTINGS, (*listed, vpn))
            log.info("bridge: VPN %s: settings follow the active: %s", vpn, ", ".join(changes))
        if resource.definitions_json:
            data = resource.definitions_json
            await conn.execute(_KEEP_DEFINITIONS, (data, vpn, data))

    async def _adopt(self, resource: VpnResource) -> str | None:
        assert self._pool is not None  # noqa: S101 - run() opened it
        vpn = resource.name
        async with self._pool.connection() as conn, conn.transaction():
            cur = await conn.execute(_LOCK_VPN, (vpn,))
            found = await cur.fetchone()
            if found is None:
                await conn.execute(
                    _ADD_STANDBY,
                    (
                        vpn,
                        resource.epoch,
                        resource.mode.value,
                        resource.sync_timeout_ms,
                        resource.on_sync_timeout.value,
                        list(resource.queue_patterns),
                        [str(t) for t in resource.topic_filters],
                        resource.expose_id,
                    ),
                )
                await conn.execute(
                    "INSERT INTO vpn_state (vpn) VALUES (%s) ON CONFLICT DO NOTHING", (vpn,)
                )
                log.info("bridge: VPN %s enabled here as standby (epoch %d)", vpn, resource.epoch)
                await self._follow_active(conn, resource)
            else:
                return await self._adopted_before(conn, resource, found)
        if self.on_adopted is not None:  # committed: the listener must refuse its clients now
            self.on_adopted(vpn)
        return None

    async def _adopted_before(
        self, conn: psycopg.AsyncConnection[Any], resource: VpnResource, found: Any
    ) -> str | None:
        """:meth:`_adopt` of a VPN this site has a row for."""
        role, enabled, epoch = found
        if role == Role.ACTIVE.value and enabled:
            return await self._active_here(conn, resource, int(epoch))
        if not enabled:
            return "replication of it is disabled on this site"
        await conn.execute(_RAISE_EPOCH, (resource.epoch, resource.name, resource.epoch))
        await self._follow_active(conn, resource)
        return None

    async def _active_here(
        self, conn: psycopg.AsyncConnection[Any], resource: VpnResource, epoch: int
    ) -> str:
        """The peer lists a VPN that is active on this site too: the higher
        epoch wins. A higher one on the peer (it was promoted) fences this
        site's VPN; a lower one is the peer's own to learn (from this site's
        listing); the same epoch on both is a conflict the admin must settle.
        Returns why the VPN is not replicated from the peer."""
        vpn, site = resource.name, self.peer_site
        if resource.epoch > epoch:
            cur = await conn.execute(FENCE_SQL, (vpn, resource.epoch))
            await conn.execute(EPOCH_SQL, (vpn, resource.epoch, site, resource.taken_over_at))
            if cur.rowcount and self.on_fenced is not None:
                asyncio.get_running_loop().call_soon(self.on_fenced, vpn, resource.epoch, site)
            return (
                f"site {site!r} holds it active at epoch {resource.epoch}, newer than this "
                f"site's {epoch}: this site's VPN is fenced (`vpnrepl demote {vpn}` makes it "
                "a standby)"
            )
        if resource.epoch < epoch:
            return (
                f"this site took it over at epoch {epoch}; site {site!r} still lists epoch "
                f"{resource.epoch} and is fenced as soon as it lists this site's VPNs"
            )
        return "it is enabled as active on this site too, at the same epoch (demote one of the two)"

    async def _install(self, session: _Session, inbound: _Inbound, last: Checkpoint) -> None:
        assert self._applier is not None  # noqa: S101 - run() created it
        rows, inbound.rows = inbound.rows, []
        try:
            await asyncio.to_thread(
                self._applier.install_checkpoint, inbound.vpn, last.epoch, last.index, rows
            )
        except (NotStandby, UnknownVpn) as e:
            self._abandon(session, inbound, e)
            return
        inbound.ahead = 0
        log.info(
            "bridge: VPN %s: installed a checkpoint of %d live messages at index %d",
            inbound.vpn,
            len(rows),
            last.index,
        )
        self._ack(session, inbound, last.index)

    async def _apply(self, session: _Session, inbound: _Inbound, first: Events) -> _Item | None:
        assert self._applier is not None  # noqa: S101 - run() created it
        entries = list(first.entries)
        held: _Item | None = None
        while len(entries) < self.max_apply_batch and not inbound.queue.empty():
            more = inbound.queue.get_nowait()
            if not isinstance(more, Events):
                held = more
                break
            entries.extend(more.entries)
        vpn = inbound.vpn
        try:
            applied = await self._skip_ahead(vpn, entries)
            if applied is None:
                applied = await asyncio.to_thread(self._applier.apply_batch, vpn, entries)
        except Gap as e:
            log.warning("bridge: %s; resyncing from the applied index", e)
            await self._request_sync(session, inbound)
            return held
        except (StaleEpoch, NotStandby, UnknownVpn) as e:
            self._abandon(session, inbound, e)
            return held
        failpoint("participant.after-apply")
        self._ack(session, inbound, applied)
        return held

    async def _apply_ahead(self, session: _Session, inbound: _Inbound, frame: TxnCommit) -> None:
        """Commit a transaction from its prepared row before its group comes
        with the stream (``bridge._standby``) and say so; if that is not
        possible now, say that: the group comes with the stream (the active
        holds it until this answer), and its ``Ack`` is what the active
        waits for then."""
        assert self._applier is not None  # noqa: S101 - run() created it
        vpn, txid = inbound.vpn, frame.txid
        ready = self._ready.pop(txid, None)
        last: int | None = None
        try:
            statement = None
            if ready is not None:
                statement = self._applier.ahead_statement(vpn, ready, frame.first, inbound.ahead)
            if ready is not None and statement is not None:
                # the usual case: one statement, on this loop (no thread hop)
                if await self._run_ahead(statement):
                    last = self._applier.applied_ahead(vpn, ready, frame.first)
            else:
                last = await asyncio.to_thread(
                    self._applier.apply_prepared,
                    vpn,
                    txid,
                    frame.epoch,
                    frame.first,
                    inbound.ahead,
                )
        except (BridgeError, psycopg.Error, ValueError) as e:
            if isinstance(e, StandbyUnavailable):
                self._applier.forget_ahead(vpn)  # it may have committed
            why = _describe(e)
            log.warning("bridge: VPN %s: transaction %s left to the stream: %s", vpn, txid, why)
        if last is not None:
            inbound.ahead = last
            failpoint("participant.after-apply-ahead")
        epoch = session.link.conn.known_epoch(vpn)
        session.link.try_send(TxnApplied(vpn, epoch, txid, last is not None))

    async def _run_ahead(self, statement: GuardedApply) -> bool:
        """Run a commit ahead's one statement on this loop; True if its
        guard let it apply."""
        found = await self._on_own_conn(
            statement.vpn, lambda conn: run_guarded_async(conn, statement)
        )
        return found is not None

    async def _skip_ahead(self, vpn: str, entries: list[LedgerEntry]) -> int | None:
        """The stream's copy of groups applied ahead, settled by one
        statement on this loop (no thread hop); returns the new applied
        index. None when ``entries`` are anything else, or the statement's
        gate did not hold, or it failed: :meth:`StandbyApplier.apply_batch`
        then checks them against what is stored and applies them as usual."""
        assert self._applier is not None  # noqa: S101 - run() created it
        statement = self._applier.passed_ahead_statement(vpn, entries)
        if statement is None:
            return None

        async def run(conn: psycopg.AsyncConnection[Any]) -> Any:
            cur = await conn.execute(*statement)
            return await cur.fetchone()

        try:
            if await self._on_own_conn(vpn, run) is None:
                return None
        except psycopg.Error as e:
            log.debug("bridge: VPN %s: applied-ahead groups left to the batch: %s", vpn, e)
            return None
        self._applier.passed_ahead(vpn, entries)
        return entries[-1].index

    async def _on_own_conn(
        self, vpn: str, run: Callable[[psycopg.AsyncConnection[Any]], Awaitable[_T]]
    ) -> _T:
        """``run`` on the standby's own connection for the statements it
        runs on this loop (commits ahead, and the stream's copies of them),
        connected at first use. When the outcome is unknown (a lost
        connection, or cancelled mid-statement) the connection is dropped
        and the VPN's applied-ahead events are read from the database again
        before its next batch, so nothing is applied twice."""
        conn = self._ahead_conn
        if conn is None or conn.closed or conn.broken:
            self._ahead_conn = None
            conn = await psycopg.AsyncConnection.connect(
                self._dsn, autocommit=True, connect_timeout=10
            )
            self._ahead_conn = conn
        try:
            return await run(conn)
        except BaseException as e:
            if isinstance(e, psycopg.Error) and not isinstance(e, psycopg.OperationalError):
                raise  # refused by the database: nothing committed, the connection is fine
            self._ahead_conn = None
            assert self._applier is not None  # noqa: S101 - run() created it
            self._applier.forget_ahead(vpn)
            with contextlib.suppress(Exception):
                await conn.close()
            raise

    def _abandon(self, session: _Session, inbound: _Inbound, why: BridgeError) -> None:
        """Stop applying this VPN's stream and tell the active why."""
        log.error("bridge: VPN %s: not applying the stream: %s", inbound.vpn, why.text)
        session.link.try_send(Error.from_exception(why, vpn=inbound.vpn))
        inbound.streaming, inbound.awaiting_accept = False, True
        if isinstance(why, StaleEpoch):
            inbound.refused_below = why.known or 0
        self._set_state(inbound.vpn, DISCONNECTED)

    def _ack(self, session: _Session, inbound: _Inbound, index: int) -> None:
        conn = session.link.conn
        following = conn.next_index(inbound.vpn)
        if following is None:
            return
        index = min(index, following - 1)
        if index <= inbound.acked:
            return
        if session.link.try_send(Ack(inbound.vpn, conn.known_epoch(inbound.vpn), index)):
            inbound.acked = index
