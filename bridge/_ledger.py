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
  statement as the entries).
* One flusher task commits the pending queue's *prefix*, one transaction per
  batch, and removes a batch from the queue only after its commit returned.
  A failed transaction leaves the batch at the head of the queue and is
  retried (tenacity: exponential back-off with full jitter, capped at
  ``max_backoff``; the number of attempts is unbounded, since dropping an
  entry would lose a confirmed message). While the database is away entries
  stay pending and :meth:`LedgerWriter.full` holds the listener back.
* The batch is one statement: it advances ``ledger_index`` only where it is
  still the index the writer continues from and inserts the rows of those
  VPNs. Anything else (a commit whose outcome was lost: the connection died
  after COMMIT was sent) goes to a second transaction that locks the VPN's
  ``vpn_state`` row and skips the entries at or below its ``ledger_index``,
  after checking that the stored events are byte for byte the ones pending.
  Anything else unexpected there means a second writer: the writer stops and
  nacks what it holds rather than guess.

The live state (``live_message``) is applied *after* the ledger commit, in
transactions of their own, by the shared apply step
(:func:`~bridge._apply.apply_entries_async`), so the active's state is
computed by the same code as the standby's, and the confirm waits for the
ledger rows only. Invariant: every ledger entry changes the active's
``live_message`` exactly once and in ledger order, however the writer
stops. Why: one applier task applies durable batches in index order; each
apply transaction moves ``vpn_live_state.live_index`` from the index it
continues (else it re-reads it and skips what a lost-reply attempt applied)
together with the effects; and :meth:`LedgerWriter.start` (and
:meth:`LedgerWriter.open_vpn`) first apply the ledger entries above
``live_index``, so a crash between a ledger commit and its apply loses
nothing. Ledger pruning never goes past ``live_index``.

Commits do not wait for company when someone waits for them: with an
entry pending that has an ``on_durable`` callback (a publish whose confirm
is held), the flusher commits whatever is pending as soon as it is free
(``max_delay``, 0 by default), and entries appended while a commit runs form
the next batch. Entries nobody waits for (acknowledgements) gather for up
to ``idle_delay`` (5 ms) first: on this 2-core machine every transaction
costs CPU in both nodes and both databases (a ledger commit, a bridge frame,
a standby transaction), and that CPU is what the clients' throughput runs
out of. The live-state apply gathers for ``apply_delay`` (10 ms; nobody
waits for it) and commits with ``synchronous_commit = off``: an apply lost
in a crash takes its ``live_index`` with it and is applied again from the
ledger, and the next synchronous commit on the site (a ledger batch, a
prune) flushes the WAL past it anyway.

Ledger rows go in as binary array parameters of one ``INSERT ... SELECT FROM
unnest(...)``: measured on this machine (500-entry batches of 1 KiB
messages, median) as fast as binary ``COPY`` (10.8 against 11.2 ms a batch)
and one round trip instead of about six. (Earlier, ``executemany`` took
40-68 ms per 1,000 entries, binary ``COPY`` 21-44 ms.)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
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

from ._apply import apply_entries_async
from ._arrays import bytea_array, int8_array, text_array
from ._entry import LedgerEntry, decode_event, encode_event
from ._errors import BridgeError
from ._events import DeadLettered, Event, Published

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
SELECT c.name, c.epoch, s.ledger_index, COALESCE(l.live_index, 0)
FROM vpn_config c JOIN vpn_state s ON s.vpn = c.name
LEFT JOIN vpn_live_state l ON l.vpn = c.name
WHERE c.enabled AND c.role = 'active'
"""
_LOAD_ONE = """
SELECT c.name, c.epoch, s.ledger_index, COALESCE(l.live_index, 0)
FROM vpn_config c JOIN vpn_state s ON s.vpn = c.name
LEFT JOIN vpn_live_state l ON l.vpn = c.name
WHERE c.name = %s
"""
# A VPN enabled since the schema migration has no vpn_live_state row yet; its
# ledger is empty then (vpn_state is created with the VPN), so 0 is right.
_ADD_LIVE_STATE = """
INSERT INTO vpn_live_state (vpn) SELECT unnest(%s::text[]) ON CONFLICT DO NOTHING
"""
# The batch in one statement: the rows of each VPN whose ledger_index is the
# one this writer continues from, and the advanced ledger_index.
_ADVANCED = """
WITH advanced AS (
    UPDATE vpn_state s SET ledger_index = v.last, updated_at = now()
    FROM unnest(%b::text[], %b::int8[], %b::int8[]) AS v(vpn, after, last)
    WHERE s.vpn = v.vpn AND s.ledger_index = v.after
    RETURNING s.vpn
)"""
_INSERT_ADVANCED = """
INSERT INTO ledger (vpn, idx, epoch, kind, event)
SELECT r.vpn, r.idx, r.epoch, r.kind, r.event
FROM unnest(%b::text[], %b::int8[], %b::int8[], %b::text[], %b::bytea[])
     AS r(vpn, idx, epoch, kind, event)
WHERE r.vpn IN (SELECT vpn FROM advanced)
"""
_APPEND = _ADVANCED + _INSERT_ADVANCED
# The same, for a batch that holds local transactions' commit groups
# (append_group with a decision): their coordinator rows in ``txn_log`` move
# prepared -> committed in the same statement, only where the VPN's entries
# went in, so a row is committed exactly when its group is in the ledger.
_APPEND_DECIDING = (
    _ADVANCED  # noqa: S608 - constant SQL pieces; every value is a parameter
    + """, decided AS (
    UPDATE txn_log t SET state = 'committed', ledger_last = d.last, updated_at = now()
    FROM unnest(%b::text[], %b::int8[]) AS d(txid, last)
    WHERE t.txid = d.txid AND t.state = 'prepared' AND t.vpn IN (SELECT vpn FROM advanced)
)"""
    + _INSERT_ADVANCED
)
# The decisions alone, inside _write_checked's transaction.
_DECIDE = """
UPDATE txn_log t SET state = 'committed', ledger_last = d.last, updated_at = now()
FROM unnest(%b::text[], %b::int8[]) AS d(txid, last)
WHERE t.txid = d.txid AND t.state = 'prepared'
"""
_LOCK = """
SELECT vpn, ledger_index FROM vpn_state WHERE vpn = ANY(%s) ORDER BY vpn FOR UPDATE
"""
_STORED = """
SELECT idx, epoch, event FROM ledger WHERE vpn = %s AND idx BETWEEN %s AND %s ORDER BY idx
"""
_INSERT = """
INSERT INTO ledger (vpn, idx, epoch, kind, event)
SELECT * FROM unnest(%b::text[], %b::int8[], %b::int8[], %b::text[], %b::bytea[])
"""
_ADVANCE = """
UPDATE vpn_state s SET ledger_index = v.idx, updated_at = now()
FROM unnest(%s::text[], %s::int8[]) AS v(vpn, idx)
WHERE s.vpn = v.vpn
"""
_ADVANCE_LIVE = "UPDATE vpn_live_state SET live_index = %s WHERE vpn = %s AND live_index = %s"
_LOCK_LIVE = "SELECT live_index FROM vpn_live_state WHERE vpn = %s FOR UPDATE"
_SET_LIVE = "UPDATE vpn_live_state SET live_index = %s WHERE vpn = %s"
_READ = """
SELECT idx, epoch, event FROM ledger WHERE vpn = %s AND idx >= %s ORDER BY idx LIMIT %s
"""
_OLDEST = """
SELECT COALESCE((SELECT min(idx) FROM ledger WHERE vpn = %(vpn)s),
                (SELECT ledger_index + 1 FROM vpn_state WHERE vpn = %(vpn)s))
"""
# Deletes a prefix of the ledger only (so what is retained stays dense): up to
# the acknowledged index, no further than the live state was applied, and
# below the first entry younger than the retention.
_PRUNE = """
DELETE FROM ledger
WHERE vpn = %(vpn)s
  AND idx <= LEAST(
        %(acked)s::int8,
        COALESCE((SELECT live_index FROM vpn_live_state WHERE vpn = %(vpn)s), 0),
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
    """Counters for status and tests: one ``batches`` per committed ledger
    transaction, one ``applies`` per live-state transaction."""

    batches: int = 0
    entries: int = 0
    failed_attempts: int = 0
    applies: int = 0


@dataclass(slots=True)
class _Pending:
    entry: LedgerEntry
    at: float
    on_durable: OnDurable | None
    #: inside an all-or-nothing group (append_group), and not its last entry
    open_group: bool = False


@dataclass(slots=True)
class _VpnLedger:
    epoch: int
    next_index: int
    durable: int
    live: int


def _describe(e: BaseException) -> str:
    """An error in one line, without statement data (COPY contexts quote rows)."""
    if isinstance(e, psycopg.Error):
        text = e.diag.message_primary or (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {text}"
    return f"{type(e).__name__}: {e}"


def _check_storable(event: Event) -> None:
    if isinstance(event, Published):
        bad = "\x00" in event.exchange or "\x00" in event.routing_key
        bad = bad or any("\x00" in q for q in event.queues)
    else:
        bad = "\x00" in event.queue
        if isinstance(event, DeadLettered):  # the queues it is moved to, too
            bad = bad or any("\x00" in q for q in event.to)
    if bad:
        raise UnstorableEvent("a name contains NUL, which PostgreSQL refuses", event.vpn)


def _by_vpn(entries: Sequence[LedgerEntry]) -> dict[str, list[LedgerEntry]]:
    out: dict[str, list[LedgerEntry]] = {}
    for e in entries:
        items = out.get(e.vpn)
        if items is None:
            out[e.vpn] = [e]
        else:
            items.append(e)
    return out


def _columns(entries: Sequence[LedgerEntry]) -> tuple[bytes, ...]:
    """The ledger rows of ``entries`` as the columns ``_APPEND``/``_INSERT`` take."""
    return (
        text_array([e.vpn for e in entries]),
        int8_array([e.index for e in entries]),
        int8_array([e.epoch for e in entries]),
        text_array([e.kind for e in entries]),
        bytea_array([e.encoded for e in entries]),
    )


class LedgerWriter:
    """Group-commits listener events to the ledger and tells who waits;
    then applies them to the live state.

    ``append`` and everything else run on the loop that ran :meth:`start`.
    """

    def __init__(
        self,
        dsn: str,
        *,
        batch_size: int = 500,
        max_delay: float = 0.0,
        idle_delay: float = 0.005,
        max_pending: int = 10_000,
        apply_batch_size: int = 500,
        apply_delay: float = 0.01,
        min_backoff: float = 0.01,
        max_backoff: float = 2.0,
        attempt_timeout: float = 30.0,
        read_pool_size: int = 4,
    ) -> None:
        if batch_size < 1 or max_pending < batch_size or apply_batch_size < 1:
            raise ValueError("need 1 <= batch_size <= max_pending and 1 <= apply_batch_size")
        self._dsn = dsn
        self._batch_size = batch_size
        self._max_delay = max_delay
        self._idle_delay = max(idle_delay, max_delay)
        self._max_pending = max_pending
        self._apply_batch_size = apply_batch_size
        self._apply_delay = apply_delay
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._attempt_timeout = attempt_timeout
        self._read_pool_size = read_pool_size
        self._vpns: dict[str, _VpnLedger] = {}
        self._pending: deque[_Pending] = deque()
        self._waiters = 0  # pending entries with an on_durable callback
        #: (vpn, last index of a group) -> the transaction it decides (append_group)
        self._decisions: dict[tuple[str, int], str] = {}
        self._unapplied: deque[LedgerEntry] = deque()  # durable, not yet in live_message
        self._subscribers: list[Subscriber] = []
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._apply_conn: psycopg.AsyncConnection[Any] | None = None
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._applier: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._batch_ready = asyncio.Event()
        self._apply_wake = asyncio.Event()
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
        """Connect, load every enabled active VPN, bring its live state up to
        its ledger, start the flusher and the applier."""
        if self._task is not None:
            raise LedgerError("the ledger writer is already started")
        self._loop = asyncio.get_running_loop()
        try:
            self._conn = await self._connect()
            async with self._conn.cursor(row_factory=tuple_row) as cur:
                await cur.execute(_LOAD_ACTIVE)
                rows = await cur.fetchall()
                await cur.execute(_ADD_LIVE_STATE, ([str(r[0]) for r in rows],))
            for name, epoch, ledger_index, live_index in rows:
                live = await self._catch_up_live(self._conn, name, live_index, ledger_index)
                self._vpns[name] = _VpnLedger(epoch, ledger_index + 1, ledger_index, live)
        except psycopg.Error as e:
            await self._drop_connection()
            if isinstance(e, psycopg.errors.UndefinedTable):
                raise LedgerError("the site database has no schema: run `vpnrepl init`") from e
            raise LedgerUnavailable(f"ledger store: {_describe(e)}") from e
        except BaseException:
            await self._drop_connection()
            raise
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
        self._applier = asyncio.create_task(self._run_applier(), name="ledger-live-apply")

    async def close(self, grace: float | None = 10.0) -> None:
        """Commit what is pending and apply it to the live state (for up to
        ``grace`` seconds), then stop.

        Entries still pending after that are reported ``on_durable(False)``:
        their commit never completed (or its outcome is unknown). Durable
        entries not applied yet are applied by the next :meth:`start`.
        """
        if self._task is None or self._closed:
            return
        self._closed = self._closing = True
        self._wake.set()
        self._batch_ready.set()
        self._apply_wake.set()
        tasks = [t for t in (self._task, self._applier) if t is not None]
        _, late = await asyncio.wait(tasks, timeout=grace)
        for task in late:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fail_pending(LedgerClosed("the ledger writer closed"))
        await self._drop_connection()
        conn, self._apply_conn = self._apply_conn, None
        if conn is not None and not conn.closed:
            await conn.close()
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
        async with self._read() as conn:
            async with conn.cursor(row_factory=tuple_row) as cur:
                await cur.execute(_LOAD_ONE, (vpn,))
                row = await cur.fetchone()
            if row is None:
                raise VpnNotOpen("not configured on this site", vpn)
            known = self._vpns.get(vpn)
            if known is not None:
                known.epoch = row[1]
                return
            await conn.execute(_ADD_LIVE_STATE, ([vpn],))
            live = await self._catch_up_live(conn, vpn, row[3], row[2])
        if vpn not in self._vpns:  # not opened by a concurrent call meanwhile
            self._vpns[vpn] = _VpnLedger(row[1], row[2] + 1, row[2], live)

    def forget_vpn(self, vpn: str) -> None:
        """``vpn`` is no longer active here (demoted): a later :meth:`open_vpn`
        loads it afresh from the database instead of continuing its old
        indexes."""
        self._vpns.pop(vpn, None)

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
        entry = LedgerEntry(event.vpn, vpn.epoch, vpn.next_index, event, encode_event(event))
        vpn.next_index += 1
        self._pending.append(_Pending(entry, self._loop.time(), on_durable))
        if on_durable is not None:
            self._waiters += 1
        if len(self._pending) == 1:
            self._wake.set()
        if len(self._pending) >= self._batch_size:
            self._batch_ready.set()
        return entry

    def append_many(
        self, events: Sequence[Event], on_durable: OnDurable | None = None
    ) -> LedgerEntry:
        """:meth:`append` for consecutive events of one VPN with one callback:
        ``on_durable(True)`` once all of them committed, ``on_durable(False)``
        if the writer stops before (possibly after some of them committed: a
        nack never hides a loss, a confirm would). All or none: an event that
        could not be appended is refused before any takes an index. Returns
        the last entry.
        """
        if not events:
            raise ValueError("append_many needs at least one event")
        if self._failure is not None:
            raise LedgerClosed(f"the ledger writer stopped: {_describe(self._failure)}")
        if self._closing or self._loop is None:
            raise LedgerClosed("the ledger writer is not running")
        name = events[0].vpn
        vpn = self._vpns.get(name)
        if vpn is None:
            raise VpnNotOpen("no ledger is open for this VPN", name)
        for event in events:
            if event.vpn != name:
                raise ValueError("append_many takes the events of one VPN")
            _check_storable(event)
        now, epoch, index = self._loop.time(), vpn.epoch, vpn.next_index
        pending = self._pending
        was_empty = not pending
        for event in events:
            entry = LedgerEntry(name, epoch, index, event, encode_event(event))
            pending.append(_Pending(entry, now, None))
            index += 1
        pending[-1].on_durable = on_durable
        if on_durable is not None:
            self._waiters += 1
        vpn.next_index = index
        if was_empty:
            self._wake.set()
        if len(pending) >= self._batch_size:
            self._batch_ready.set()
        return entry

    def append_group(
        self,
        events: Sequence[Event],
        on_durable: OnDurable | None = None,
        *,
        decision: str | None = None,
    ) -> int:
        """:meth:`append_many`, and the events are committed in one database
        transaction: all of them are in the ledger or none is (a local
        transaction's commit decision, txn/_coordinator.py). With
        ``decision`` (a transaction id), that transaction's ``txn_log`` row
        moves from ``prepared`` to ``committed`` (with ``ledger_last``) in
        the same transaction as the group. Returns the last index."""
        last = self.append_many(events, on_durable)
        pending = self._pending
        for i in range(len(pending) - len(events), len(pending) - 1):
            pending[i].open_group = True
        if decision is not None:
            self._decisions[(last.vpn, last.index)] = decision
        self._batch_ready.set()  # a client's tx.commit-ok waits: no group-commit window
        return last.index

    def full(self) -> bool:
        """More than ``max_pending`` entries wait for a commit, or for their
        live-state apply: stop reading clients."""
        return len(self._pending) > self._max_pending or len(self._unapplied) > self._max_pending

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

    def live_index(self, vpn: str) -> int:
        """The last index of ``vpn`` applied to ``live_message``."""
        try:
            return self._vpns[vpn].live
        except KeyError:
            raise VpnNotOpen("no ledger is open for this VPN", vpn) from None

    async def wait_durable(self, vpn: str, index: int) -> None:
        """Return once ``index`` of ``vpn`` is committed; raise :class:`LedgerClosed`
        if the writer stops first."""
        while self.durable_index(vpn) < index:
            if self._failure is not None or (self._task is not None and self._task.done()):
                raise LedgerClosed(f"index {index} was not committed", vpn)
            await self._durable_changed.wait()

    async def wait_live(self, vpn: str, index: int) -> None:
        """Return once ``index`` of ``vpn`` is applied to ``live_message``;
        raise :class:`LedgerClosed` if the writer stops first."""
        while self.live_index(vpn) < index:
            if self._failure is not None or (self._applier is not None and self._applier.done()):
                raise LedgerClosed(f"index {index} was not applied to the live state", vpn)
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
            self._stop(e)
        finally:
            self._apply_wake.set()  # a closing applier waits for the flusher's end

    def _stop(self, e: BaseException) -> None:
        self._failure = e
        self._fail_pending(e)
        self._apply_wake.set()
        for task in (self._task, self._applier):
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    async def _flush_loop(self) -> None:
        assert self._loop is not None  # noqa: S101 - set by start()
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            window = self._max_delay if self._waiters else self._idle_delay
            delay = self._pending[0].at + window - self._loop.time()
            if delay > 0 and len(self._pending) < self._batch_size and not self._closing:
                self._batch_ready.clear()
                try:
                    async with asyncio.timeout(delay):
                        await self._batch_ready.wait()
                except TimeoutError:
                    pass
            batch = list(itertools.islice(self._pending, self._batch_size))
            while batch[-1].open_group:  # a group commits whole (append_group)
                batch.append(self._pending[len(batch)])
            entries = [p.entry for p in batch]
            waiters = len(batch) - [p.on_durable for p in batch].count(None)
            await self._retrying(self._commit_once, entries, "ledger commit")
            self._waiters = max(0, self._waiters - waiters)
            for _ in batch:
                self._pending.popleft()
            self._resolve(batch, entries)

    async def _retrying(
        self,
        attempt_once: Callable[[list[LedgerEntry]], Awaitable[None]],
        entries: list[LedgerEntry],
        what: str,
    ) -> None:
        """Run ``attempt_once(entries)`` until it succeeds, retrying transient
        failures for as long as it takes."""
        if self.store_error is None:
            try:  # the usual case, without building a retry loop per batch
                await attempt_once(entries)
                return
            except _TRANSIENT as e:
                self.store_error = e
                self.stats.failed_attempts += 1
                log.warning(
                    "%s attempt failed (%s); %d entries pending, retrying",
                    what,
                    _describe(e),
                    len(self._pending),
                )

        def before_retry(state: RetryCallState) -> None:
            self.stats.failed_attempts += 1
            error = state.outcome.exception() if state.outcome is not None else None
            self.store_error = error
            n = state.attempt_number
            if n == 1 or n % 20 == 0:
                log.log(
                    logging.WARNING if n == 1 else logging.ERROR,
                    "%s attempt %d failed (%s); %d entries pending, retrying",
                    what,
                    n,
                    _describe(error) if error is not None else "?",
                    len(self._pending),
                )

        retrying = AsyncRetrying(
            retry=retry_if_exception_type(_TRANSIENT),
            wait=wait_random_exponential(multiplier=self._min_backoff, max=self._max_backoff),
            before_sleep=before_retry,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                await attempt_once(entries)
        if self.store_error is not None:
            log.warning("ledger store is back; %d entries pending", len(self._pending))
            self.store_error = None

    async def _commit_once(self, entries: list[LedgerEntry]) -> None:
        try:
            async with asyncio.timeout(self._attempt_timeout):
                if self._conn is None or self._conn.closed or self._conn.broken:
                    await self._drop_connection()
                    self._conn = await self._connect()
                await self._write(self._conn, entries)
        except BaseException:
            # The outcome may be unknown (a lost COMMIT reply, a cancelled
            # statement): start the next attempt on a fresh session, whose
            # lock-and-check in _write_checked sorts out what did commit.
            await self._drop_connection()
            raise

    async def _write(self, conn: psycopg.AsyncConnection[Any], entries: list[LedgerEntry]) -> None:
        by_vpn = _by_vpn(entries)
        after = [items[0].index - 1 for items in by_vpn.values()]
        last = [items[-1].index for items in by_vpn.values()]
        decided = self._decided_in(entries)
        async with conn.cursor() as cur:
            # autocommit: one statement, one transaction, one round trip
            if decided is None:
                await cur.execute(_APPEND, (list(by_vpn), after, last, *_columns(entries)))
            else:
                await cur.execute(
                    _APPEND_DECIDING, (list(by_vpn), after, last, *decided, *_columns(entries))
                )
            if cur.rowcount == len(entries):
                return
        await self._write_checked(conn, by_vpn, decided)

    def _decided_in(self, entries: list[LedgerEntry]) -> tuple[bytes, bytes] | None:
        """The ``(txids, last indexes)`` columns of the decisions whose
        groups end in ``entries``; None when there are none."""
        if not self._decisions:
            return None
        txids, lasts = [], []
        for e in entries:
            txid = self._decisions.get((e.vpn, e.index))
            if txid is not None:
                txids.append(txid)
                lasts.append(e.index)
        return (text_array(txids), int8_array(lasts)) if txids else None

    async def _write_checked(
        self,
        conn: psycopg.AsyncConnection[Any],
        by_vpn: dict[str, list[LedgerEntry]],
        decided: tuple[bytes, bytes] | None = None,
    ) -> None:
        """The batch where the stored ``ledger_index`` is not where this writer
        continues from: what is stored must be ours, the rest goes in (and
        the decisions it holds are recorded, unless a lost-reply attempt
        recorded them already)."""
        async with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
            await cur.execute(_LOCK, (sorted(by_vpn),))
            stored = {str(vpn): int(idx) for vpn, idx in await cur.fetchall()}
            todo: dict[str, list[LedgerEntry]] = {}
            for vpn, items in by_vpn.items():
                if vpn not in stored:
                    raise LedgerConflict("the VPN has no vpn_state row any more", vpn)
                todo[vpn] = await self._not_yet_stored(cur, vpn, items, stored[vpn])
            rows = [e for items in todo.values() for e in items]
            if rows:
                await cur.execute(_INSERT, _columns(rows))
                advanced = {vpn: items[-1].index for vpn, items in todo.items() if items}
                await cur.execute(_ADVANCE, (list(advanced), list(advanced.values())))
            if decided is not None:
                await cur.execute(_DECIDE, decided)

    async def _not_yet_stored(
        self, cur: psycopg.AsyncCursor[Any], vpn: str, items: list[LedgerEntry], stored: int
    ) -> list[LedgerEntry]:
        """The entries of ``items`` above the stored ``ledger_index``.

        Entries at or below it were committed by an attempt whose reply was
        lost; they must be exactly ours, else another writer is at work.
        """
        first, last = items[0].index, items[-1].index
        if stored == first - 1:
            return items
        if not first <= stored <= last:
            raise LedgerConflict(
                f"stored ledger_index is {stored}, this writer is at {first - 1}", vpn
            )
        await cur.execute(_STORED, (vpn, first, stored))
        found = await cur.fetchall()
        mine = [(e.index, e.epoch, e.encoded) for e in items[: stored - first + 1]]
        if [(int(i), int(ep), bytes(d)) for i, ep, d in found] != mine:
            raise LedgerConflict(f"ledger entries {first}..{stored} are not ours", vpn)
        log.warning("VPN %r: entries %d..%d had committed already (reply lost)", vpn, first, stored)
        return items[stored - first + 1 :]

    def _resolve(self, batch: list[_Pending], entries: list[LedgerEntry]) -> None:
        self.stats.batches += 1
        self.stats.entries += len(batch)
        for e in entries:
            self._vpns[e.vpn].durable = e.index
        if self._decisions:
            for e in entries:
                self._decisions.pop((e.vpn, e.index), None)
        for p in batch:
            if p.on_durable is not None:
                try:
                    p.on_durable(True)
                except Exception:
                    log.exception("on_durable callback failed")
        for subscriber in list(self._subscribers):
            try:
                subscriber(entries)
            except Exception:
                log.exception("ledger subscriber failed")
        self._unapplied.extend(entries)
        self._apply_wake.set()
        self._signal()

    def _fail_pending(self, reason: BaseException) -> None:
        failed, self._pending = self._pending, deque()
        self._waiters = 0
        self._decisions.clear()  # their rows stay prepared: recovery decides them
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

    # -- the live state ------------------------------------------------------

    async def _run_applier(self) -> None:
        try:
            await self._apply_loop()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception(
                "applying the ledger to the live state failed; the ledger writer stops "
                "(%d entries are nacked)",
                len(self._pending),
            )
            self._stop(e)

    async def _apply_loop(self) -> None:
        """Apply durable entries to ``live_message`` in index order, as many
        at a time as have accumulated (up to ``apply_batch_size``)."""
        while True:
            if not self._unapplied:
                if self._closing and (self._task is None or self._task.done()):
                    return
                self._apply_wake.clear()
                await self._apply_wake.wait()
                continue
            if len(self._unapplied) < self._apply_batch_size and not self._closing:
                # Nobody waits for the live state: let batches gather (fewer,
                # larger transactions; a publish and its ack in one batch
                # cancel out).
                await asyncio.sleep(self._apply_delay)
            entries = list(itertools.islice(self._unapplied, self._apply_batch_size))
            await self._retrying(self._apply_once, entries, "live state apply")
            for _ in entries:
                self._unapplied.popleft()
            for e in entries:
                self._vpns[e.vpn].live = e.index
            self.stats.applies += 1
            self._signal()

    async def _apply_once(self, entries: list[LedgerEntry]) -> None:
        try:
            async with asyncio.timeout(self._attempt_timeout):
                conn = self._apply_conn
                if conn is None or conn.closed or conn.broken:
                    if conn is not None and not conn.closed:
                        await conn.close()
                    self._apply_conn = conn = await self._connect()
                    # An apply lost with its commit record is applied again
                    # from the ledger (live_index went with it), and every
                    # later synchronous commit (a ledger batch, a prune)
                    # flushes the WAL up to itself: no need to wait for the
                    # flush here.
                    await conn.execute("SET synchronous_commit = off")
                await self._apply_live(conn, _by_vpn(entries))
        except BaseException:
            conn, self._apply_conn = self._apply_conn, None
            if conn is not None and not conn.closed:
                await conn.close()
            raise

    async def _apply_live(
        self, conn: psycopg.AsyncConnection[Any], by_vpn: dict[str, list[LedgerEntry]]
    ) -> None:
        """One transaction: each VPN's entries above its ``live_index`` applied
        by the shared apply step, and the new ``live_index``."""
        async with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
            for vpn, items in by_vpn.items():
                first, last = items[0].index, items[-1].index
                await cur.execute(_ADVANCE_LIVE, (last, vpn, first - 1))
                if cur.rowcount != 1:
                    items = await self._not_yet_applied(cur, vpn, items)
                if items:
                    await apply_entries_async(conn, vpn, items)

    async def _not_yet_applied(
        self, cur: psycopg.AsyncCursor[Any], vpn: str, items: list[LedgerEntry]
    ) -> list[LedgerEntry]:
        """The entries of ``items`` above the stored ``live_index`` (an attempt
        whose reply was lost applied the others), with ``live_index`` advanced."""
        first, last = items[0].index, items[-1].index
        await cur.execute(_LOCK_LIVE, (vpn,))
        row = await cur.fetchone()
        if row is None:
            raise LedgerConflict("the VPN has no vpn_live_state row any more", vpn)
        live = int(row[0])
        if live < first - 1:
            # Applies commit with synchronous_commit off: a database crash can
            # take the newest ones with it (and their live_index). Those
            # entries are durable in the ledger: apply them again from there.
            missing = await self._read_entries(cur, vpn, live + 1, first - 1)
            log.warning(
                "VPN %r: the live state lost entries %d..%d with a database crash; "
                "applying them again from the ledger",
                vpn,
                live + 1,
                first - 1,
            )
            await cur.execute(_SET_LIVE, (last, vpn))
            return missing + items
        if live >= last:
            return []
        log.warning("VPN %r: entries %d..%d were applied already (reply lost)", vpn, first, live)
        await cur.execute(_SET_LIVE, (last, vpn))
        return items[live - first + 1 :]

    async def _read_entries(
        self, cur: psycopg.AsyncCursor[Any], vpn: str, first: int, last: int
    ) -> list[LedgerEntry]:
        """Ledger entries ``first..last`` of ``vpn``, all of them or LedgerConflict."""
        await cur.execute(_READ, (vpn, first, last - first + 1))
        rows = await cur.fetchall()
        if len(rows) != last - first + 1 or int(rows[0][0]) != first:
            raise LedgerConflict(
                f"ledger entries {first}..{last} are missing: the live state cannot follow", vpn
            )
        return [
            LedgerEntry(vpn, int(ep), int(i), decode_event(d, vpn), bytes(d)) for i, ep, d in rows
        ]

    async def _catch_up_live(
        self, conn: psycopg.AsyncConnection[Any], vpn: str, live: int, ledger_index: int
    ) -> int:
        """Apply the durable ledger entries above ``live`` (the writer stopped
        between their commit and their apply); returns the new live index."""
        if live >= ledger_index:
            return live
        start = live
        while live < ledger_index:
            limit = min(self._apply_batch_size, ledger_index - live)
            async with conn.cursor(row_factory=tuple_row) as cur:
                await cur.execute(_READ, (vpn, live + 1, limit))
                rows = await cur.fetchall()
            if not rows or int(rows[0][0]) != live + 1:
                raise LedgerConflict(
                    f"ledger entry {live + 1} is missing: the live state cannot be caught up", vpn
                )
            entries = [
                LedgerEntry(vpn, int(ep), int(i), decode_event(d, vpn), bytes(d))
                for i, ep, d in rows
            ]
            await self._apply_live(conn, {vpn: entries})
            live = entries[-1].index
        log.warning(
            "VPN %r: live state caught up from the ledger (entries %d..%d)", vpn, start + 1, live
        )
        return live

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
        return [
            LedgerEntry(vpn, int(ep), int(i), decode_event(d, vpn), bytes(d)) for i, ep, d in rows
        ]

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
        also older than ``retain_seconds`` and applied to the live state;
        returns how many went."""
        if vpn in self._vpns:
            # The live state is usually a few milliseconds behind the ledger:
            # give it a moment, so the prune is not held back by that.
            with contextlib.suppress(TimeoutError, LedgerClosed):
                async with asyncio.timeout(1.0):
                    await self.wait_live(vpn, min(acked_index, self._vpns[vpn].durable))
        async with self._read() as conn, conn.cursor(row_factory=tuple_row) as cur:
            await cur.execute(
                _PRUNE, {"vpn": vpn, "acked": acked_index, "retain": float(retain_seconds)}
            )
            return cur.rowcount
