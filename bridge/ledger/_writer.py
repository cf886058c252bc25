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

The writer owns the two other parts of the ledger and starts and stops them
with itself:

* its :class:`~bridge.ledger._live.ActiveApplier`, to which each committed
  batch goes next (``live_message`` follows the ledger). A VPN's live state
  is caught up before the writer hands out its next index, and the writer
  keeps both indexes per VPN, so :meth:`LedgerWriter.wait_live` and the
  backpressure of :meth:`LedgerWriter.full` see the apply;
* its :class:`~bridge.ledger._reader.LedgerReader`
  (:attr:`LedgerWriter.reader`: replay and pruning), whose pool also serves
  :meth:`LedgerWriter.open_vpn`, and whose prune waits for the writer's
  live index.

A VPN forgotten (:meth:`LedgerWriter.forget_vpn`, a demotion) while
entries of it are in flight takes no more entries, but keeps its indexes
until the last entry it was given is applied to the live state: those
entries still commit, their callbacks fire, and an :meth:`open_vpn` of it
meanwhile waits for them, so its indexes continue after theirs.

Commits do not wait for company when someone waits for them: with an
entry pending that has an ``on_durable`` callback (a publish whose confirm
is held), the flusher commits whatever is pending as soon as it is free
(``max_delay``, 0 by default), and entries appended while a commit runs form
the next batch. Entries nobody waits for (acknowledgements) gather for up
to ``idle_delay`` (5 ms) first: on this 2-core machine every transaction
costs CPU in both nodes and both databases (a ledger commit, a bridge frame,
a standby transaction), and that CPU is what the clients' throughput runs
out of.

Ledger rows go in as binary array parameters of one ``INSERT ... SELECT FROM
unnest(...)``: as fast as binary ``COPY`` and one round trip instead of
about six (``bench/RESULTS.md``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from bridge._entry import LedgerEntry, encode_event, entries_by_vpn
from bridge._events import DeadLettered, Event, Published, TopologyChanged
from bridge.store import (
    active_ledgers,
    advance_ledger_indexes,
    ledger_start,
    lock_ledger_indexes,
)

from ._arrays import bytea_array, int8_array, text_array
from ._errors import (
    LedgerClosed,
    LedgerConflict,
    LedgerError,
    LedgerUnavailable,
    UnstorableEvent,
    VpnNotOpen,
    describe_error as _describe,
)
from ._live import ActiveApplier, add_live_rows
from ._reader import LedgerReader
from ._retry import retry_log_level, retry_store

__all__ = [
    "LedgerWriter",
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
_STORED = """
SELECT idx, epoch, event FROM ledger WHERE vpn = %s AND idx BETWEEN %s AND %s ORDER BY idx
"""
_INSERT = """
INSERT INTO ledger (vpn, idx, epoch, kind, event)
SELECT * FROM unnest(%b::text[], %b::int8[], %b::int8[], %b::text[], %b::bytea[])
"""


@dataclass(slots=True)
class WriterStats:
    """Counters for status and tests: one ``batches`` per committed ledger
    transaction, one ``applies`` per live-state transaction."""

    batches: int = 0
    entries: int = 0
    #: (vpn, kind) -> entries committed (``vpnrepl_events_total``): every
    #: event that entered the ledger, once, whoever appended it (the
    #: listener, a local transaction's or an XA branch's decision, the node)
    events: Counter[tuple[str, str]] = field(default_factory=Counter)
    failed_attempts: int = 0
    #: client confirms nacked after waiting past the answer timeout
    #: (``vpnrepl_ledger_confirms_nacked_late_total``)
    answered_late: int = 0
    applies: int = 0
    #: entries in one committed ledger transaction -> how many such commits
    #: (``vpnrepl_ledger_commit_entries``: how well group commit batches)
    batch_sizes: Counter[int] = field(default_factory=Counter)


@dataclass(slots=True)
class _Pending:
    entry: LedgerEntry
    at: float
    on_durable: OnDurable | None
    #: inside an all-or-nothing group (append_group), and not its last entry
    open_group: bool = False
    #: ``on_durable`` answers a client's confirm, which may be a nack once
    #: it waited :attr:`LedgerWriter.answer_timeout` (append, append_many)
    answers_client: bool = False


@dataclass(slots=True)
class _VpnLedger:
    epoch: int
    next_index: int
    durable: int
    live: int


def _check_storable(event: Event) -> None:
    if isinstance(event, Published):
        bad = "\x00" in event.exchange or "\x00" in event.routing_key
        bad = bad or any("\x00" in q for q in event.queues)
    elif isinstance(event, TopologyChanged):
        bad = False  # its names are inside JSON, which escapes a NUL
    else:
        bad = "\x00" in event.queue
        if isinstance(event, DeadLettered):  # the queues it is moved to, too
            bad = bad or any("\x00" in q for q in event.to)
    if bad:
        raise UnstorableEvent("a name contains NUL, which PostgreSQL refuses", event.vpn)


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
    hands each committed batch to its live-state applier.

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
        answer_timeout: float = 10.0,
    ) -> None:
        if batch_size < 1 or max_pending < batch_size or apply_batch_size < 1:
            raise ValueError("need 1 <= batch_size <= max_pending and 1 <= apply_batch_size")
        self._dsn = dsn
        self._batch_size = batch_size
        self._max_delay = max_delay
        self._idle_delay = max(idle_delay, max_delay)
        self._max_pending = max_pending
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._attempt_timeout = attempt_timeout
        #: a client's confirm waits this long for a commit the store does not
        #: complete (down, or its link black-holed); then it is a nack, and
        #: the entry still commits once the store is back
        self.answer_timeout = answer_timeout
        self._vpns: dict[str, _VpnLedger] = {}
        #: VPNs forgotten while entries of theirs were in flight, until the
        #: last of those is applied to the live state (forget_vpn)
        self._draining: dict[str, _VpnLedger] = {}
        self._pending: deque[_Pending] = deque()
        self._waiters = 0  # pending entries with an on_durable callback
        #: (vpn, last index of a group) -> the transaction it decides (append_group)
        self._decisions: dict[tuple[str, int], str] = {}
        self._applier = ActiveApplier(
            dsn,
            retrying=self._retrying,
            on_applied=self._applied,
            batch_size=apply_batch_size,
            delay=apply_delay,
            attempt_timeout=attempt_timeout,
        )
        #: the applier's queue: durable, not yet in live_message (backpressure)
        self._unapplied = self._applier.unapplied
        #: replay and pruning of what this writer committed
        self.reader = LedgerReader(dsn, pool_size=read_pool_size, progress=self)
        self._subscribers: list[Subscriber] = []
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._applier_task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
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
        """Connect, load every enabled active VPN, bring its live state up to
        its ledger, open the reader, start the flusher and the applier."""
        if self._task is not None:
            raise LedgerError("the ledger writer is already started")
        self._loop = asyncio.get_running_loop()
        try:
            self._conn = await self._connect()
            starts = await active_ledgers().run_async(self._conn)
            await add_live_rows(self._conn, [v.vpn for v in starts])
            for v in starts:
                live = await self._applier.catch_up(self._conn, v.vpn, v.live_index, v.ledger_index)
                self._vpns[v.vpn] = _VpnLedger(v.epoch, v.ledger_index + 1, v.ledger_index, live)
        except psycopg.Error as e:
            await self._drop_connection()
            if isinstance(e, psycopg.errors.UndefinedTable):
                raise LedgerError("the site database has no schema: run `vpnrepl init`") from e
            raise LedgerUnavailable(f"ledger store: {_describe(e)}") from e
        except BaseException:
            await self._drop_connection()
            raise
        await self.reader.open()
        self._task = asyncio.create_task(self._run(), name="ledger-writer")
        self._applier_task = asyncio.create_task(self._run_applier(), name="ledger-live-apply")
        self._watchdog = asyncio.create_task(self._answer_late_ones(), name="ledger-answers")

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
        self._applier.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
        tasks = [t for t in (self._task, self._applier_task) if t is not None]
        _, late = await asyncio.wait(tasks, timeout=grace)
        for task in late:
            task.cancel()
        watchdog = [self._watchdog] if self._watchdog is not None else []
        await asyncio.gather(*tasks, *watchdog, return_exceptions=True)
        self._fail_pending(LedgerClosed("the ledger writer closed"))
        await self._drop_connection()
        await self._applier.disconnect()
        await self.reader.close()

    async def __aenter__(self) -> LedgerWriter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open_vpn(self, vpn: str) -> None:
        """Start (or refresh the epoch of) the ledger of ``vpn``, e.g. one
        enabled after :meth:`start`. Indexes continue after the last durable
        one, once the entries of an earlier :meth:`forget_vpn` still in
        flight are applied."""
        while vpn in self._draining and vpn not in self._vpns:
            if self._failure is not None or self._closing:
                raise LedgerClosed("entries of its earlier ledger did not complete", vpn)
            await self._durable_changed.wait()
        async with self.reader.connection() as conn:
            found = await ledger_start(vpn).run_async(conn)
            if found is None:
                raise VpnNotOpen("not configured on this site", vpn)
            known = self._vpns.get(vpn)
            if known is not None:
                known.epoch = found.epoch
                return
            await add_live_rows(conn, [vpn])
            live = await self._applier.catch_up(conn, vpn, found.live_index, found.ledger_index)
        if vpn not in self._vpns:  # not opened by a concurrent call meanwhile
            self._vpns[vpn] = _VpnLedger(
                found.epoch, found.ledger_index + 1, found.ledger_index, live
            )

    def forget_vpn(self, vpn: str) -> None:
        """``vpn`` is no longer active here (demoted): it takes no more
        entries, and a later :meth:`open_vpn` loads it afresh from the
        database instead of continuing its old indexes. Entries of it still
        in flight are committed and applied as if it were open (module
        docstring)."""
        ledger = self._vpns.pop(vpn, None)
        if ledger is not None and ledger.live < ledger.next_index - 1:
            self._draining[vpn] = ledger

    def _ledger(self, vpn: str) -> _VpnLedger:
        """The indexes of ``vpn``, open or forgotten with entries in flight."""
        ledger = self._vpns.get(vpn)
        if ledger is None:
            ledger = self._draining.get(vpn)
            if ledger is None:
                raise VpnNotOpen("no ledger is open for this VPN", vpn)
        return ledger

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
        self._pending.append(_Pending(entry, self._loop.time(), on_durable, False, True))
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
        pending[-1].answers_client = True
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
        transaction's commit decision, txn/local/_coordinator.py). With
        ``decision`` (a transaction id), that transaction's ``txn_log`` row
        moves from ``prepared`` to ``committed`` (with ``ledger_last``) in
        the same transaction as the group. Returns the last index."""
        last = self.append_many(events, on_durable)
        pending = self._pending
        for i in range(len(pending) - len(events), len(pending) - 1):
            pending[i].open_group = True
        # a transaction's group: its coordinator decides what the client hears
        pending[-1].answers_client = False
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

    def next_index(self, vpn: str) -> int:
        """The index the next event of ``vpn`` appended takes (0: no ledger
        is open for it)."""
        ledger = self._vpns.get(vpn)
        return 0 if ledger is None else ledger.next_index

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
        """Return once ``index`` of ``vpn`` is committed (also when ``vpn`` was
        forgotten meanwhile); raise :class:`LedgerClosed` if the writer stops
        first."""
        while self._ledger(vpn).durable < index:
            if self._failure is not None or (self._task is not None and self._task.done()):
                raise LedgerClosed(f"index {index} was not committed", vpn)
            await self._durable_changed.wait()

    async def wait_live(self, vpn: str, index: int) -> None:
        """Return once ``index`` of ``vpn`` is applied to ``live_message``
        (also when ``vpn`` was forgotten meanwhile); raise
        :class:`LedgerClosed` if the writer stops first."""
        while self._ledger(vpn).live < index:
            if self._failure is not None or (
                self._applier_task is not None and self._applier_task.done()
            ):
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
            self._applier.flusher_stopped()  # a closing applier waits for the flusher's end

    def _stop(self, e: BaseException) -> None:
        self._failure = e
        self._fail_pending(e)
        for task in (self._task, self._applier_task):
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

        def failed(error: BaseException | None, n: int) -> None:
            self.stats.failed_attempts += 1
            self.store_error = error
            if (level := retry_log_level(n)) is not None:
                log.log(
                    level,
                    "%s attempt %d failed (%s); %d entries pending, retrying",
                    what,
                    n,
                    _describe(error) if error is not None else "?",
                    len(self._pending),
                )

        await retry_store(
            lambda: attempt_once(entries),
            retried=_TRANSIENT,
            min_backoff=self._min_backoff,
            max_backoff=self._max_backoff,
            failed=failed,
        )
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
        by_vpn = entries_by_vpn(entries)
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
            stored = await lock_ledger_indexes(by_vpn).run_async(conn)
            todo: dict[str, list[LedgerEntry]] = {}
            for vpn, items in by_vpn.items():
                if vpn not in stored:
                    raise LedgerConflict("the VPN has no vpn_state row any more", vpn)
                todo[vpn] = await self._not_yet_stored(cur, vpn, items, stored[vpn])
            rows = [e for items in todo.values() for e in items]
            if rows:
                await cur.execute(_INSERT, _columns(rows))
                advanced = {vpn: items[-1].index for vpn, items in todo.items() if items}
                await advance_ledger_indexes(advanced).run_async(conn)
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
        self.stats.batch_sizes[len(batch)] += 1
        self.stats.events.update([(e.vpn, e.kind) for e in entries])
        for e in entries:
            self._ledger(e.vpn).durable = e.index
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
        self._applier.enqueue(entries)
        self._signal()

    async def _answer_late_ones(self) -> None:
        """Once a second: nack the confirms that waited past
        :attr:`answer_timeout` (the oldest entries come first)."""
        while True:
            await asyncio.sleep(1.0)
            self.answer_late(asyncio.get_running_loop().time())

    def answer_late(self, now: float) -> int:
        """Nack each client confirm pending since before ``now`` -
        :attr:`answer_timeout`; its entry stays pending. Returns how many."""
        late = 0
        for p in self._pending:
            if now - p.at <= self.answer_timeout:
                break
            if p.on_durable is None or not p.answers_client:
                continue
            answer, p.on_durable = p.on_durable, None
            self._waiters = max(0, self._waiters - 1)
            late += 1
            try:
                answer(False)
            except Exception:
                log.exception("on_durable callback failed")
        if late:
            self.stats.answered_late += late
            log.warning(
                "%d confirms waited over %.0f s for the ledger store (%s): nacked; their "
                "entries commit once it answers",
                late,
                self.answer_timeout,
                _describe(self.store_error) if self.store_error is not None else "no answer",
            )
        return late

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

    # -- the live-state applier's handshake ----------------------------------

    async def _run_applier(self) -> None:
        try:
            await self._applier.run()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception(
                "applying the ledger to the live state failed; the ledger writer stops "
                "(%d entries are nacked)",
                len(self._pending),
            )
            self._stop(e)

    def _applied(self, entries: list[LedgerEntry]) -> None:
        """The applier committed ``entries`` to the live state."""
        for e in entries:
            self._ledger(e.vpn).live = e.index
        if self._draining:
            for vpn, ledger in list(self._draining.items()):
                if ledger.live >= ledger.next_index - 1:  # its last entry is in
                    del self._draining[vpn]
        self.stats.applies += 1
        self._signal()
