"""The active's live state: ``live_message`` kept in step with its ledger.

The entries the ledger writer committed are applied after their commit, in
transactions of their own, by the apply step the standby uses
(:func:`~bridge.ledger._apply.apply_entries_async`), so a confirm waits for
the ledger rows only and both sites' states compare row for row.
Invariant: every entry changes ``live_message`` exactly once and in ledger
order, however the writer stops. Each transaction moves
``vpn_live_state.live_index`` with its effects, re-reading it when it is not
the index the batch continues (skipping what a lost reply applied, applying
first what a database crash lost); a batch leaves the queue only once
committed; :meth:`ActiveApplier.catch_up` applies what is above
``live_index`` before a VPN's next index is handed out, and the ledger is
never pruned past it. Nobody waits for the live state, so batches gather for
``delay`` and commit with ``synchronous_commit = off``: a lost apply takes
its ``live_index`` with it and is applied again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from bridge._entry import LedgerEntry, entries_by_vpn

from ._apply import apply_entries_async
from ._errors import LedgerConflict
from ._reader import fetch_entries

__all__ = ["ActiveApplier", "Retrying", "add_live_rows"]

log = logging.getLogger(__name__)

#: runs ``attempt(entries)`` until it succeeds, retrying transient failures
#: (the writer's, so outages are counted and reported in one place)
Retrying = Callable[
    [Callable[[list[LedgerEntry]], Awaitable[None]], list[LedgerEntry], str], Awaitable[None]
]

# A VPN enabled since the schema migration has no vpn_live_state row yet; its
# ledger is empty then (vpn_state is created with the VPN), so 0 is right.
_ADD_ROWS = """
INSERT INTO vpn_live_state (vpn) SELECT unnest(%s::text[]) ON CONFLICT DO NOTHING
"""
_ADVANCE = "UPDATE vpn_live_state SET live_index = %s WHERE vpn = %s AND live_index = %s"
_LOCK = "SELECT live_index FROM vpn_live_state WHERE vpn = %s FOR UPDATE"
_SET = "UPDATE vpn_live_state SET live_index = %s WHERE vpn = %s"


async def add_live_rows(conn: psycopg.AsyncConnection[Any], vpns: Iterable[str]) -> None:
    """Give each of ``vpns`` its ``vpn_live_state`` row (at 0), if it has none."""
    await conn.execute(_ADD_ROWS, (list(vpns),))


class ActiveApplier:
    """Applies durable ledger entries to ``live_message`` in index order.

    The writer owns it: it queues each committed batch
    (:meth:`enqueue`), runs :meth:`run` as a task, hears of each applied
    batch through ``on_applied`` (on the loop, in index order), and tells it
    when to finish (:meth:`close`, :meth:`flusher_stopped`).
    """

    def __init__(
        self,
        dsn: str,
        *,
        retrying: Retrying,
        on_applied: Callable[[list[LedgerEntry]], None],
        batch_size: int = 500,
        delay: float = 0.01,
        attempt_timeout: float = 30.0,
    ) -> None:
        if batch_size < 1:
            raise ValueError("need 1 <= apply batch_size")
        self._dsn = dsn
        self._retrying = retrying
        self._on_applied = on_applied
        self._batch_size = batch_size
        self._delay = delay
        self._attempt_timeout = attempt_timeout
        #: durable entries not yet in ``live_message``, in commit order (the
        #: writer reads its length for backpressure)
        self.unapplied: deque[LedgerEntry] = deque()
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._wake = asyncio.Event()
        self._closing = False
        self._flusher_stopped = False

    def enqueue(self, entries: Iterable[LedgerEntry]) -> None:
        """Queue newly durable entries (in commit order) for the apply."""
        self.unapplied.extend(entries)
        self._wake.set()

    def close(self) -> None:
        """Apply what is queued without gathering; :meth:`run` returns once
        the queue is empty and the flusher stopped."""
        self._closing = True
        self._wake.set()

    def flusher_stopped(self) -> None:
        """The writer's flusher ended: nothing more will be queued."""
        self._flusher_stopped = True
        self._wake.set()

    async def disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            await conn.close()

    async def run(self) -> None:
        """Apply queued entries, as many at a time as have accumulated (up
        to ``batch_size``), until closed; a failure other than a transient
        one (which is retried) ends it with that error."""
        while True:
            if not self.unapplied:
                if self._closing and self._flusher_stopped:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if len(self.unapplied) < self._batch_size and not self._closing:
                # Nobody waits for the live state: let batches gather (fewer,
                # larger transactions; a publish and its ack in one batch
                # cancel out).
                await asyncio.sleep(self._delay)
            entries = list(itertools.islice(self.unapplied, self._batch_size))
            await self._retrying(self._apply_once, entries, "live state apply")
            for _ in entries:
                self.unapplied.popleft()
            self._on_applied(entries)

    async def _apply_once(self, entries: list[LedgerEntry]) -> None:
        try:
            async with asyncio.timeout(self._attempt_timeout):
                conn = self._conn
                if conn is None or conn.closed or conn.broken:
                    if conn is not None and not conn.closed:
                        await conn.close()
                    self._conn = conn = await psycopg.AsyncConnection.connect(
                        self._dsn, autocommit=True, connect_timeout=10
                    )
                    # An apply lost with its commit record is applied again
                    # from the ledger (live_index went with it), and every
                    # later synchronous commit (a ledger batch, a prune)
                    # flushes the WAL up to itself: no need to wait for the
                    # flush here.
                    await conn.execute("SET synchronous_commit = off")
                await self._apply(conn, entries_by_vpn(entries))
        except BaseException:
            await self.disconnect()
            raise

    async def _apply(
        self, conn: psycopg.AsyncConnection[Any], by_vpn: dict[str, list[LedgerEntry]]
    ) -> None:
        """One transaction: each VPN's entries above its ``live_index`` applied
        by the shared apply step, and the new ``live_index``."""
        async with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
            for vpn, items in by_vpn.items():
                first, last = items[0].index, items[-1].index
                await cur.execute(_ADVANCE, (last, vpn, first - 1))
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
        await cur.execute(_LOCK, (vpn,))
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
            await cur.execute(_SET, (last, vpn))
            return missing + items
        if live >= last:
            return []
        log.warning("VPN %r: entries %d..%d were applied already (reply lost)", vpn, first, live)
        await cur.execute(_SET, (last, vpn))
        return items[live - first + 1 :]

    async def _read_entries(
        self, cur: psycopg.AsyncCursor[Any], vpn: str, first: int, last: int
    ) -> list[LedgerEntry]:
        """Ledger entries ``first..last`` of ``vpn``, all of them or LedgerConflict."""
        entries = await fetch_entries(cur, vpn, first, last - first + 1)
        if len(entries) != last - first + 1 or entries[0].index != first:
            raise LedgerConflict(
                f"ledger entries {first}..{last} are missing: the live state cannot follow", vpn
            )
        return entries

    async def catch_up(
        self, conn: psycopg.AsyncConnection[Any], vpn: str, live: int, ledger_index: int
    ) -> int:
        """Apply the durable ledger entries above ``live`` (the writer stopped
        between their commit and their apply), on the caller's autocommit
        connection; returns the new live index."""
        if live >= ledger_index:
            return live
        start = live
        while live < ledger_index:
            limit = min(self._batch_size, ledger_index - live)
            async with conn.cursor(row_factory=tuple_row) as cur:
                entries = await fetch_entries(cur, vpn, live + 1, limit)
            if not entries or entries[0].index != live + 1:
                raise LedgerConflict(
                    f"ledger entry {live + 1} is missing: the live state cannot be caught up", vpn
                )
            await self._apply(conn, {vpn: entries})
            live = entries[-1].index
        log.warning(
            "VPN %r: live state caught up from the ledger (entries %d..%d)", vpn, start + 1, live
        )
        return live
