"""The active site's ledger: events in listener order, group-committed.

Invariant: an entry is reported durable (``on_durable(True)``, subscribers,
:meth:`LedgerWriter.wait_durable`) only after the database transaction that
holds it committed, and the ledger of a VPN is dense and in the order the
listener appended — no index skipped, reused, reordered or written twice,
across database outages and restarts of the writer. Why:

* :meth:`LedgerWriter.append` is synchronous and runs on the event loop
  thread, so indexes are handed out in call order (dense per VPN, continuing
  after ``vpn_state.ledger_index`` as loaded by :meth:`LedgerWriter.start`,
  which is exactly the last durable entry: it is written in the same
  transaction as the entries).
* One flusher task commits the pending queue's *prefix*, one transaction per
  batch, and removes a batch from the queue only after its commit returned.
  A failed transaction leaves the batch at the head of the queue and is
  retried (tenacity: exponential back-off with full jitter, capped at
  ``max_backoff``; the number of attempts is unbounded, since dropping an
  entry would lose a confirmed message). While the database is away entries
  stay pending and :meth:`LedgerWriter.full` holds the listener back.
* A commit whose outcome was lost (the connection died after COMMIT was sent)
  is recognised on the next attempt: the transaction locks the VPN's
  ``vpn_state`` row and skips the entries at or below its ``ledger_index``,
  after checking that the stored events are byte for byte the ones pending.
  Anything else unexpected there means a second writer: the writer stops and
  nacks what it holds rather than guess.

The same transaction applies the batch to ``live_message`` with the shared
apply step (:func:`~bridge._apply.apply_entries_async`), so the active's state
is computed by the same code as the standby's.

Ledger rows go in with binary ``COPY``: measured on this machine (1,000-entry
batches of 1 KiB messages, median of 15 transactions) ``executemany`` 40-68
ms/batch (15-25k rows/s), binary ``COPY`` 21-44 ms (23-48k rows/s).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    wait_random_exponential,
)

from plugin._events import Event, Published

from ._apply import apply_entries_async
from ._entry import LedgerEntry, decode_event, encode_event
from ._errors import BridgeError

__all__ = [
    "LedgerClosed",
    "LedgerConflict",
    "LedgerError",
    "LedgerPruned",
    "LedgerUnavailable",
    "LedgerWriter",
    "UnstorableEvent",
    "VpnNotOpen",
    "WriterStats",
]

log = logging.getLogger(__name__)

OnDurable = Callable[[bool], None]
Subscriber = Callable[[Sequence[LedgerEntry]], None]

#: Errors after which the same transaction may succeed: connection loss,
#: server shutdown or crash, resource exhaustion, serialisation conflicts
#: (psycopg maps SQLSTATE classes 08, 40, 53, 57 to ``OperationalError``), and
#: our own per-attempt timeout. Anything else is a bug or a second writer.
_TRANSIENT = (psycopg.OperationalError, OSError, TimeoutError)

_LOAD_ACTIVE = """
SELECT c.name, c.epoch, s.ledger_index
FROM vpn_config c JOIN vpn_state s ON s.vpn = c.name
WHERE c.enabled AND c.role = 'active'
"""
_LOAD_ONE = """
SELECT c.name, c.epoch, s.ledger_index
FROM vpn_config c JOIN vpn_state s ON s.vpn = c.name
WHERE c.name = %s
"""
_LOCK = """
SELECT vpn, ledger_index FROM vpn_state WHERE vpn = ANY(%s) ORDER BY vpn FOR UPDATE
"""
_STORED = """
SELECT idx, epoch, event FROM ledger WHERE vpn = %s AND idx BETWEEN %s AND %s ORDER BY idx
"""
_COPY = "COPY ledger (vpn, idx, epoch, kind, event) FROM STDIN (FORMAT BINARY)"
_COPY_TYPES = ["text", "int8", "int8", "text", "bytea"]
_ADVANCE = """
UPDATE vpn_state s SET ledger_index = v.idx, updated_at = now()
FROM unnest(%s::text[], %s::int8[]) AS v(vpn, idx)
WHERE s.vpn = v.vpn
"""
_READ = """
SELECT idx, epoch, event FROM ledger WHERE vpn = %s AND idx >= %s ORDER BY idx LIMIT %s
"""
_OLDEST = """
SELECT COALESCE((SELECT min(idx) FROM ledger WHERE vpn = %(vpn)s),
                (SELECT ledger_index + 1 FROM vpn_state WHERE vpn = %(vpn)s))
"""
# Deletes a prefix of the ledger only (so what is retained stays dense): up to
# the acknowledged index, and below the first entry younger than the retention.
_PRUNE = """
DELETE FROM ledger
WHERE vpn = %(vpn)s
  AND idx <= LEAST(
        %(acked)s::int8,
        COALESCE((SELECT idx - 1 FROM ledger
                  WHERE vpn = %(vpn)s
                    AND appended_at >= now() - make_interval(secs => %(retain)s::float8)
                  ORDER BY idx LIMIT 1),
                 %(acked)s::int8))
"""


class LedgerError(BridgeError):
    """Root of the ledger's errors."""


class LedgerUnavailable(LedgerError):
    """The site database could not be reached for a ledger read or at start."""


class LedgerClosed(LedgerError):
    """The writer is not running (not started, closing, or stopped by a failure)."""


class LedgerConflict(LedgerError):
    """The stored ledger does not continue what this writer holds: a second
    writer, or a database restored behind the writer's back. Fatal."""


class VpnNotOpen(LedgerError, LookupError):
    """No ledger is open for this VPN on this writer (see :meth:`LedgerWriter.open_vpn`)."""


class UnstorableEvent(LedgerError, ValueError):
    """An event that could never be committed (refused before it takes an index)."""


class LedgerPruned(LedgerError):
    """The requested start of a replay is no longer retained: ship a checkpoint."""

    def __init__(self, vpn: str, from_index: int, oldest: int) -> None:
        super().__init__(f"ledger index {from_index} was pruned (oldest retained is {oldest})", vpn)
        self.from_index, self.oldest = from_index, oldest


@dataclass(slots=True)
class WriterStats:
    """Counters for status and tests: one ``batches`` per committed transaction."""

    batches: int = 0
    entries: int = 0
    failed_attempts: int = 0


@dataclass(slots=True)
class _Pending:
    entry: LedgerEntry
    data: bytes
    at: float
    on_durable: OnDurable | None


@dataclass(slots=True)
class _VpnLedger:
    epoch: int
    next_index: int
    durable: int


def _describe(e: BaseException) -> str:
    """An error in one line, without statement data (COPY contexts quote rows)."""
    if isinstance(e, psycopg.Error):
        text = e.diag.message_primary or (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {text}"
    return f"{type(e).__name__}: {e}"


def _check_storable(event: Event) -> None:
    texts = (
        (event.exchange, event.routing_key, *event.queues)
        if isinstance(event, Published)
        else (event.queue,)
    )
    if any("\x00" in t for t in texts):
        raise UnstorableEvent("a name contains NUL, which PostgreSQL refuses", event.vpn)


class LedgerWriter:
    """Group-commits listener events to the ledger and tells who waits.

    ``append`` and everything else run on the loop that ran :meth:`start`.
    """

    def __init__(
        self,
        dsn: str,
        *,
        batch_size: int = 500,
        max_delay: float = 0.002,
        max_pending: int = 10_000,
        min_backoff: float = 0.01,
        max_backoff: float = 2.0,
        attempt_timeout: float = 30.0,
        read_pool_size: int = 4,
    ) -> None:
        if batch_size < 1 or max_pending < batch_size:
            raise ValueError("need 1 <= batch_size <= max_pending")
        self._dsn = dsn
        self._batch_size = batch_size
        self._max_delay = max_delay
        self._max_pending = max_pending
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._attempt_timeout = attempt_timeout
        self._read_pool_size = read_pool_size
        self._vpns: dict[str, _VpnLedger] = {}
        self._pending: deque[_Pending] = deque()
        self._subscribers: list[Subscriber] = []
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._batch_ready = asyncio.Event()
        self._room = asyncio.Event()
        self._durable_changed = asyncio.Event()
        self._closing = False
        self._closed = False
        self._failure: BaseException | None = None
        self.stats = WriterStats()
        #: The last error of a commit attempt while the store is failing, else None.
        self.store_error: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Connect, load every enabled active VPN, start the flusher."""
        if self._task is not None:
            raise LedgerError("the ledger writer is already started")
        self._loop = asyncio.get_running_loop()
        try:
            self._conn = await self._connect()
            async with self._conn.cursor(row_factory=tuple_row) as cur:
                await cur.execute(_LOAD_ACTIVE)
                for name, epoch, ledger_index in await cur.fetchall():
                    self._vpns[name] = _VpnLedger(epoch, ledger_index + 1, ledger_index)
        except psycopg.Error as e:
            await self._drop_connection()
            if isinstance(e, psycopg.errors.UndefinedTable):
                raise LedgerError("the site database has no schema: run `vpnrepl init`") from e
            raise LedgerUnavailable(f"ledger store: {_describe(e)}") from e
        self._pool = AsyncConnectionPool(
            self._dsn,
            min_size=1,
            max_size=self._read_pool_size,
            open=False,
            kwargs={"autocommit": True, "connect_timeout": 10},
            check=AsyncConnectionPool.check_connection,
            timeout=10.0,
            name="ledger-read",
        )
        await self._pool.open(wait=False)
        self._task = asyncio.create_task(self._run(), name="ledger-writer")

    async def close(self, grace: float | None = 10.0) -> None:
        """Commit what is pending (for up to ``grace`` seconds), then stop.

        Entries still pending after that are reported ``on_durable(False)``:
        their commit never completed (or its outcome is unknown).
        """
        if self._task is None or self._closed:
            return
        self._closed = self._closing = True
        self._wake.set()
        self._batch_ready.set()
        try:
            async with asyncio.timeout(grace):
                await asyncio.shield(self._task)
        except TimeoutError:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail_pending(LedgerClosed("the ledger writer closed"))
        await self._drop_connection()
        if self._pool is not None:
            await self._pool.close()

    async def __aenter__(self) -> LedgerWriter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open_vpn(self, vpn: str) -> None:
        """Start (or refresh the epoch of) the ledger of ``vpn``, e.g. one
        enabled after :meth:`start`. Indexes continue after the last durable one."""
        async with self._read() as conn, conn.cursor(row_factory=tuple_row) as cur:
            await cur.execute(_LOAD_ONE, (vpn,))
            row = await cur.fetchone()
        if row is None:
            raise VpnNotOpen("not configured on this site", vpn)
        known = self._vpns.get(vpn)
        if known is None:
            self._vpns[vpn] = _VpnLedger(row[1], row[2] + 1, row[2])
        else:
            known.epoch = row[1]

    # -- the listener's side -----------------------------------------------

    def append(self, event: Event, on_durable: OnDurable | None = None) -> LedgerEntry:
        """Give ``event`` the next index of its VPN and queue it for commit.

        ``on_durable(True)`` is called once the entry's transaction committed;
        ``on_durable(False)`` if the writer stops before that. Callbacks run on
        the loop in index order and must not block.
        """
        if self._failure is not None:
            raise LedgerClosed(f"the ledger writer stopped: {_describe(self._failure)}")
        if self._closing or self._loop is None:
            raise LedgerClosed("the ledger writer is not running")
        vpn = self._vpns.get(event.vpn)
        if vpn is None:
            raise VpnNotOpen("no ledger is open for this VPN", event.vpn)
        _check_storable(event)
        data = encode_event(event)
        entry = LedgerEntry(event.vpn, vpn.epoch, vpn.next_index, event)
        vpn.next_index += 1
        self._pending.append(_Pending(entry, data, self._loop.time(), on_durable))
        self._wake.set()
        if len(self._pending) >= self._batch_size:
            self._batch_ready.set()
        return entry

    def full(self) -> bool:
        """More than ``max_pending`` entries wait for a commit: stop reading clients."""
        return len(self._pending) > self._max_pending

    async def wait_for_room(self) -> None:
        while self.full():
            self._room.clear()
            await self._room.wait()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def durable_index(self, vpn: str) -> int:
        """The last index of ``vpn`` known committed."""
        try:
            return self._vpns[vpn].durable
        except KeyError:
            raise VpnNotOpen("no ledger is open for this VPN", vpn) from None

    async def wait_durable(self, vpn: str, index: int) -> None:
        """Return once ``index`` of ``vpn`` is committed; raise :class:`LedgerClosed`
        if the writer stops first."""
        while self.durable_index(vpn) < index:
            if self._failure is not None or (self._task is not None and self._task.done()):
                raise LedgerClosed(f"index {index} was not committed", vpn)
            await self._durable_changed.wait()

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(entries)`` after each commit with the newly durable
        entries, in index order per VPN. Returns the unsubscribe function."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    # -- the flusher ---------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._flush_loop()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("the ledger writer stopped; %d entries are nacked", len(self._pending))
            self._failure = e
            self._fail_pending(e)

    async def _flush_loop(self) -> None:
        assert self._loop is not None  # noqa: S101 - set by start()
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            delay = self._pending[0].at + self._max_delay - self._loop.time()
            if delay > 0 and len(self._pending) < self._batch_size and not self._closing:
                self._batch_ready.clear()
                try:
                    async with asyncio.timeout(delay):
                        await self._batch_ready.wait()
                except TimeoutError:
                    pass
            batch = list(itertools.islice(self._pending, self._batch_size))
            await self._commit(batch)
            for _ in batch:
                self._pending.popleft()
            self._resolve(batch)

    async def _commit(self, batch: list[_Pending]) -> None:
        """Commit ``batch``, retrying transient failures for as long as it takes."""
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(_TRANSIENT),
            wait=wait_random_exponential(multiplier=self._min_backoff, max=self._max_backoff),
            before_sleep=self._before_retry,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                await self._commit_once(batch)
        if self.store_error is not None:
            log.warning("ledger store is back; %d entries pending", len(self._pending))
            self.store_error = None

    def _before_retry(self, state: RetryCallState) -> None:
        self.stats.failed_attempts += 1
        error = state.outcome.exception() if state.outcome is not None else None
        self.store_error = error
        n = state.attempt_number
        if n == 1 or n % 20 == 0:
            log.log(
                logging.WARNING if n == 1 else logging.ERROR,
                "ledger commit attempt %d failed (%s); %d entries pending, retrying",
                n,
                _describe(error) if error is not None else "?",
                len(self._pending),
            )

    async def _commit_once(self, batch: list[_Pending]) -> None:
        try:
            async with asyncio.timeout(self._attempt_timeout):
                if self._conn is None or self._conn.closed or self._conn.broken:
                    await self._drop_connection()
                    self._conn = await self._connect()
                await self._write(self._conn, batch)
        except BaseException:
            # The outcome may be unknown (a lost COMMIT reply, a cancelled
            # statement): start the next attempt on a fresh session, whose
            # lock-and-check in _write sorts out what did commit.
            await self._drop_connection()
            raise

    async def _write(self, conn: psycopg.AsyncConnection[Any], batch: list[_Pending]) -> None:
        by_vpn: dict[str, list[_Pending]] = {}
        for p in batch:
            by_vpn.setdefault(p.entry.vpn, []).append(p)
        async with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
            await cur.execute(_LOCK, (sorted(by_vpn),))
            stored = {str(vpn): int(idx) for vpn, idx in await cur.fetchall()}
            todo: dict[str, list[_Pending]] = {}
            for vpn, items in by_vpn.items():
                if vpn not in stored:
                    raise LedgerConflict("the VPN has no vpn_state row any more", vpn)
                todo[vpn] = await self._not_yet_stored(cur, vpn, items, stored[vpn])
            rows = [p for items in todo.values() for p in items]
            if rows:
                async with cur.copy(_COPY) as copy:
                    copy.set_types(_COPY_TYPES)
                    for p in rows:
                        e = p.entry
                        await copy.write_row((e.vpn, e.index, e.epoch, e.kind, p.data))
                for vpn, items in todo.items():
                    if items:
                        await apply_entries_async(conn, vpn, [p.entry for p in items])
                advanced = {vpn: items[-1].entry.index for vpn, items in todo.items() if items}
                await cur.execute(_ADVANCE, (list(advanced), list(advanced.values())))

    async def _not_yet_stored(
        self, cur: psycopg.AsyncCursor[Any], vpn: str, items: list[_Pending], stored: int
    ) -> list[_Pending]:
        """The entries of ``items`` above the stored ``ledger_index``.

        Entries at or below it were committed by an attempt whose reply was
        lost; they must be exactly ours, else another writer is at work.
        """
        first, last = items[0].entry.index, items[-1].entry.index
        if stored == first - 1:
            return items
        if not first <= stored <= last:
            raise LedgerConflict(
                f"stored ledger_index is {stored}, this writer is at {first - 1}", vpn
            )
        await cur.execute(_STORED, (vpn, first, stored))
        found = await cur.fetchall()
        mine = [(p.entry.index, p.entry.epoch, p.data) for p in items[: stored - first + 1]]
        if [(int(i), int(ep), bytes(d)) for i, ep, d in found] != mine:
            raise LedgerConflict(f"ledger entries {first}..{stored} are not ours", vpn)
        log.warning("VPN %r: entries %d..%d had committed already (reply lost)", vpn, first, stored)
        return items[stored - first + 1 :]

    def _resolve(self, batch: list[_Pending]) -> None:
        self.stats.batches += 1
        self.stats.entries += len(batch)
        for p in batch:
            self._vpns[p.entry.vpn].durable = p.entry.index
        for p in batch:
            if p.on_durable is not None:
                try:
                    p.on_durable(True)
                except Exception:
                    log.exception("on_durable callback failed")
        entries = [p.entry for p in batch]
        for subscriber in list(self._subscribers):
            try:
                subscriber(entries)
            except Exception:
                log.exception("ledger subscriber failed")
        self._signal()

    def _fail_pending(self, reason: BaseException) -> None:
        failed, self._pending = self._pending, deque()
        if failed:
            log.warning("%d ledger entries not committed: %s", len(failed), _describe(reason))
        for p in failed:
            if p.on_durable is not None:
                try:
                    p.on_durable(False)
                except Exception:
                    log.exception("on_durable callback failed")
        self._signal()

    def _signal(self) -> None:
        if not self.full():
            self._room.set()
        self._durable_changed.set()
        self._durable_changed = asyncio.Event()

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(self._dsn, autocommit=True, connect_timeout=10)

    async def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            await conn.close()

    # -- replay and retention ----------------------------------------------

    @asynccontextmanager
    async def _read(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if self._pool is None:
            raise LedgerClosed("the ledger writer is not started")
        try:
            async with self._pool.connection() as conn:
                yield conn
        except psycopg.OperationalError as e:
            raise LedgerUnavailable(f"ledger store: {_describe(e)}") from e

    async def read_range(self, vpn: str, from_index: int, limit: int) -> list[LedgerEntry]:
        """Up to ``limit`` committed entries of ``vpn`` from ``from_index`` on.

        Empty when ``from_index`` is past the end; :class:`LedgerPruned` when it
        is no longer retained (the standby needs a checkpoint instead).
        """
        if from_index < 1 or limit < 1:
            raise ValueError(f"read_range from {from_index}, limit {limit}")
        async with self._read() as conn, conn.cursor(row_factory=tuple_row) as cur:
            await cur.execute(_READ, (vpn, from_index, limit))
            rows = await cur.fetchall()
            if not rows or rows[0][0] != from_index:
                await cur.execute(_OLDEST, {"vpn": vpn})
                found = await cur.fetchone()
                oldest = int(found[0]) if found is not None and found[0] is not None else 1
                if from_index < oldest:
                    raise LedgerPruned(vpn, from_index, oldest)
        return [LedgerEntry(vpn, int(ep), int(i), decode_event(d, vpn)) for i, ep, d in rows]

    async def oldest_retained(self, vpn: str) -> int:
        """The lowest index of ``vpn`` a replay can start from (the next index
        to be written when everything was pruned)."""
        async with self._read() as conn, conn.cursor(row_factory=tuple_row) as cur:
            await cur.execute(_OLDEST, {"vpn": vpn})
            found = await cur.fetchone()
        if found is None or found[0] is None:
            raise VpnNotOpen("not configured on this site", vpn)
        return int(found[0])

    async def prune(self, vpn: str, acked_index: int, retain_seconds: float) -> int:
        """Delete entries the standby acknowledged (``<= acked_index``) that are
        also older than ``retain_seconds``; returns how many went."""
        async with self._read() as conn, conn.cursor(row_factory=tuple_row) as cur:
            await cur.execute(
                _PRUNE, {"vpn": vpn, "acked": acked_index, "retain": float(retain_seconds)}
            )
            return cur.rowcount
