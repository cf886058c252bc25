"""The active's ledger writer: events in listener order, group-committed.

Invariant: an entry is reported durable (``on_durable(True)``, subscribers,
:meth:`LedgerWriter.wait_durable`) only after the transaction holding it
committed, and a VPN's ledger is dense and in append order: no index
skipped, reused, reordered or written twice, across outages and restarts.
:meth:`LedgerWriter.append` runs on the loop, so indexes go out in call
order, after ``vpn_state.ledger_index`` (written in the same statement as
the entries: exactly the last durable one); one flusher commits the
pending queue's prefix (:mod:`bridge.ledger._commit`) and drops a batch
only once it committed. Each committed batch goes next to the live-state
applier (:mod:`bridge.ledger._live`); a VPN's live state is caught up
before its next index goes out. When a batch commits, and why, is in
docs/behaviour.md, "Running a site" (when a confirm is released).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import psycopg

from bridge._entry import LedgerEntry, encode_event
from bridge._events import Event
from bridge.store import Fence, active_ledgers, ledger_start

from ._commit import BatchCommitter, check_storable
from ._errors import (
    LedgerClosed,
    LedgerError,
    LedgerFenced,
    LedgerUnavailable,
    VpnNotOpen,
    describe_error as _describe,
)
from ._live import ActiveApplier, add_live_rows
from ._pending import OnDurable, Pending, PendingEntries
from ._reader import LedgerReader

__all__ = [
    "LedgerWriter",
    "WriterStats",
]

log = logging.getLogger(__name__)

Subscriber = Callable[[Sequence[LedgerEntry]], None]


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
class _VpnLedger:
    epoch: int
    next_index: int
    durable: int
    live: int


class LedgerWriter:
    """Group-commits listener events to the ledger and tells who waits;
    hands each committed batch to its live-state applier. Owns, and starts
    and stops with itself, that applier and its :attr:`reader` (replay and
    pruning), whose pool also serves :meth:`open_vpn` and whose prune waits
    for the live index.

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
        self._batch_size = batch_size
        self._max_delay = max_delay
        self._idle_delay = max(idle_delay, max_delay)
        self._max_pending = max_pending
        #: a client's confirm waits this long for a commit the store does not
        #: complete (down, or its link black-holed); then it is a nack, and
        #: the entry still commits once the store is back
        self.answer_timeout = answer_timeout
        self._vpns: dict[str, _VpnLedger] = {}
        #: VPNs forgotten while entries of theirs were in flight, until the
        #: last of those is applied to the live state (forget_vpn)
        self._draining: dict[str, _VpnLedger] = {}
        self._pending = PendingEntries()
        self.stats = WriterStats()
        self._commits = BatchCommitter(
            dsn,
            pending=lambda: len(self._pending),
            failed=self._failed_attempt,
            min_backoff=min_backoff,
            max_backoff=max_backoff,
            attempt_timeout=attempt_timeout,
        )
        self._applier = ActiveApplier(
            dsn,
            retrying=self._commits.retrying,
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
        #: told once the fence refused a batch: the node lost its lease
        self.on_fenced: Callable[[], None] = lambda: None

    @property
    def fence(self) -> Fence | None:
        """The lease every batch is committed under: a batch commits only
        while the lease is held at its term (else :class:`LedgerFenced`
        stops the writer). None: no lease (a tool, a test)."""
        return self._commits.fence

    @fence.setter
    def fence(self, fence: Fence | None) -> None:
        self._commits.fence = fence

    @property
    def store_error(self) -> BaseException | None:
        """The last error of a commit attempt while the store is failing, else None."""
        return self._commits.store_error

    def _failed_attempt(self) -> None:
        self.stats.failed_attempts += 1

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Connect, load every enabled active VPN, bring its live state up to
        its ledger, open the reader, start the flusher and the applier."""
        if self._task is not None:
            raise LedgerError("the ledger writer is already started")
        self._loop = asyncio.get_running_loop()
        try:
            conn = await self._commits.connection()
            starts = await active_ledgers().run_async(conn)
            await add_live_rows(conn, [v.vpn for v in starts])
            for v in starts:
                live = await self._applier.catch_up(conn, v.vpn, v.live_index, v.ledger_index)
                self._vpns[v.vpn] = _VpnLedger(v.epoch, v.ledger_index + 1, v.ledger_index, live)
        except psycopg.Error as e:
            await self._commits.disconnect()
            if isinstance(e, psycopg.errors.UndefinedTable):
                raise LedgerError("the site database has no schema: run `vpnrepl init`") from e
            raise LedgerUnavailable(f"ledger store: {_describe(e)}") from e
        except BaseException:
            await self._commits.disconnect()
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
        await self._commits.disconnect()
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
        in flight keep its indexes until the last is applied to the live
        state: they commit, their callbacks fire, and an :meth:`open_vpn`
        meanwhile waits for them, so its indexes continue after theirs."""
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
        check_storable(event)
        entry = LedgerEntry(event.vpn, vpn.epoch, vpn.next_index, event, encode_event(event))
        vpn.next_index += 1
        pending = self._pending.add(entry, self._loop.time(), on_durable)
        if pending == 1:
            self._wake.set()
        if pending >= self._batch_size:
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
        return self._append_run(events, on_durable, group=False)

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
        last = self._append_run(events, on_durable, group=True)
        if decision is not None:
            self._pending.decisions[(last.vpn, last.index)] = decision
        self._batch_ready.set()  # a client's tx.commit-ok waits: no group-commit window
        return last.index

    def _append_run(
        self, events: Sequence[Event], on_durable: OnDurable | None, *, group: bool
    ) -> LedgerEntry:
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
            check_storable(event)
        epoch, first = vpn.epoch, vpn.next_index
        entries = [
            LedgerEntry(name, epoch, first + i, event, encode_event(event))
            for i, event in enumerate(events)
        ]
        was_empty = not self._pending
        self._pending.add_run(entries, self._loop.time(), on_durable, group=group)
        vpn.next_index = first + len(entries)
        if was_empty:
            self._wake.set()
        if len(self._pending) >= self._batch_size:
            self._batch_ready.set()
        return entries[-1]

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
        except LedgerFenced as e:  # expected after a pause: no traceback
            log.error("the ledger writer stopped: %s; %d entries are nacked", e, len(self._pending))
            self._stop(e)
            self.on_fenced()
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
            # Commits wait for company only when nobody waits for them: with a
            # confirm waiting, whatever is pending commits as soon as the
            # flusher is free (max_delay); acknowledgements gather for up to
            # idle_delay, since every transaction costs both sites CPU.
            window = self._max_delay if self._pending.waiters else self._idle_delay
            delay = self._pending.oldest_at + window - self._loop.time()
            if delay > 0 and len(self._pending) < self._batch_size and not self._closing:
                self._batch_ready.clear()
                try:
                    async with asyncio.timeout(delay):
                        await self._batch_ready.wait()
                except TimeoutError:
                    pass
            batch = self._pending.batch(self._batch_size)
            entries = [p.entry for p in batch]
            waiters = len(batch) - [p.on_durable for p in batch].count(None)
            await self._commits.commit(entries, self._pending.decisions)
            self._pending.committed(batch, waiters)
            self._resolve(batch, entries)

    def _resolve(self, batch: list[Pending], entries: list[LedgerEntry]) -> None:
        self.stats.batches += 1
        self.stats.entries += len(batch)
        self.stats.batch_sizes[len(batch)] += 1
        self.stats.events.update([(e.vpn, e.kind) for e in entries])
        for e in entries:
            self._ledger(e.vpn).durable = e.index
        self._pending.confirm(batch)
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
        late = self._pending.answer_late(now, self.answer_timeout)
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
        if self._pending:
            log.warning(
                "%d ledger entries not committed: %s", len(self._pending), _describe(reason)
            )
        self._pending.fail_all()
        self._signal()

    def _signal(self) -> None:
        if not self.full():
            self._room.set()
        self._durable_changed.set()
        self._durable_changed = asyncio.Event()

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
