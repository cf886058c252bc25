"""The committed ledger, read for replay and pruned behind the standby.

Invariant: what is retained of a VPN's ledger is a dense run of committed
entries ending at the last durable one, and a replay gets entries of that
run in index order or is told its start is gone
(:class:`~bridge.ledger._errors.LedgerPruned`), never a silent gap.
:meth:`LedgerReader.read_range` reads committed rows only, on connections of
its own, and raises ``LedgerPruned`` when the first row is not the one
asked for; :meth:`LedgerReader.prune` deletes a prefix in one statement: up
to the standby's acknowledged index, no further than
``vpn_live_state.live_index`` (a checkpoint is the live state plus the
ledger after it), and only entries older than the retention.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool

from bridge._entry import LedgerEntry, decode_event

from ._errors import LedgerClosed, LedgerPruned, LedgerUnavailable, VpnNotOpen, describe_error

__all__ = ["LedgerProgress", "LedgerReader", "fetch_entries"]

_READ = """
SELECT idx, epoch, event FROM ledger WHERE vpn = %s AND idx >= %s ORDER BY idx LIMIT %s
"""
# The next index to be written when everything was pruned: in one statement
# with the ledger's minimum, so both come from one snapshot.
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


async def fetch_entries(
    cur: psycopg.AsyncCursor[Any], vpn: str, from_index: int, limit: int
) -> list[LedgerEntry]:
    """Up to ``limit`` stored entries of ``vpn`` from ``from_index`` on, in
    index order (what is there: the caller checks they are the ones it wants)."""
    await cur.execute(_READ, (vpn, from_index, limit))
    rows = await cur.fetchall()
    return [LedgerEntry(vpn, int(ep), int(i), decode_event(d, vpn), bytes(d)) for i, ep, d in rows]


class LedgerProgress(Protocol):
    """Where the ledger writer stands (:class:`~bridge.ledger._writer.LedgerWriter`)."""

    def durable_index(self, vpn: str) -> int:
        """The last committed index; VpnNotOpen when no ledger is open for ``vpn``."""
        ...

    async def wait_live(self, vpn: str, index: int) -> None:
        """Return once ``index`` is applied to the live state."""
        ...


class LedgerReader:
    """Replays committed ledger entries and prunes what the standby holds.

    ``progress`` (the writer, when one runs in this process) lets a prune
    wait a moment for the live state, which trails the ledger by a few
    milliseconds. Runs on the loop that ran :meth:`open`.
    """

    def __init__(
        self, dsn: str, *, pool_size: int = 4, progress: LedgerProgress | None = None
    ) -> None:
        self._dsn = dsn
        self._pool_size = pool_size
        self._progress = progress
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None

    async def open(self) -> None:
        """Start the connection pool (connections are made as they are needed)."""
        self._pool = AsyncConnectionPool(
            self._dsn,
            min_size=1,
            max_size=self._pool_size,
            open=False,
            kwargs={"autocommit": True, "connect_timeout": 10},
            check=AsyncConnectionPool.check_connection,
            timeout=10.0,
            name="ledger-read",
        )
        await self._pool.open(wait=False)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """An autocommit connection from the pool; errors reaching the
        database become :class:`LedgerUnavailable`."""
        if self._pool is None:
            raise LedgerClosed("the ledger reader is not open")
        try:
            async with self._pool.connection() as conn:
                yield conn
        except psycopg.OperationalError as e:
            raise LedgerUnavailable(f"ledger store: {describe_error(e)}") from e

    async def read_range(self, vpn: str, from_index: int, limit: int) -> list[LedgerEntry]:
        """Up to ``limit`` committed entries of ``vpn`` from ``from_index`` on.

        Empty when ``from_index`` is past the end; :class:`LedgerPruned` when it
        is no longer retained (the standby needs a checkpoint instead).
        """
        if from_index < 1 or limit < 1:
            raise ValueError(f"read_range from {from_index}, limit {limit}")
        async with self.connection() as conn, conn.cursor(row_factory=tuple_row) as cur:
            entries = await fetch_entries(cur, vpn, from_index, limit)
            if not entries or entries[0].index != from_index:
                await cur.execute(_OLDEST, {"vpn": vpn})
                found = await cur.fetchone()
                oldest = int(found[0]) if found is not None and found[0] is not None else 1
                if from_index < oldest:
                    raise LedgerPruned(vpn, from_index, oldest)
        return entries

    async def oldest_retained(self, vpn: str) -> int:
        """The lowest index of ``vpn`` a replay can start from (the next index
        to be written when everything was pruned)."""
        async with self.connection() as conn, conn.cursor(row_factory=tuple_row) as cur:
            await cur.execute(_OLDEST, {"vpn": vpn})
            found = await cur.fetchone()
        if found is None or found[0] is None:
            raise VpnNotOpen("not configured on this site", vpn)
        return int(found[0])

    async def prune(self, vpn: str, acked_index: int, retain_seconds: float) -> int:
        """Delete entries the standby acknowledged (``<= acked_index``) that are
        also older than ``retain_seconds`` and applied to the live state;
        returns how many went."""
        progress = self._progress
        if progress is not None:
            try:
                durable: int | None = progress.durable_index(vpn)
            except VpnNotOpen:
                durable = None
            if durable is not None:
                # The live state is usually a few milliseconds behind the
                # ledger: give it a moment, so the prune is not held back by that.
                with contextlib.suppress(TimeoutError, LedgerClosed):
                    async with asyncio.timeout(1.0):
                        await progress.wait_live(vpn, min(acked_index, durable))
        async with self.connection() as conn, conn.cursor(row_factory=tuple_row) as cur:
            await cur.execute(
                _PRUNE, {"vpn": vpn, "acked": acked_index, "retain": float(retain_seconds)}
            )
            return cur.rowcount
