"""A bound on the active's ledger: a long standby outage does not fill its disk.

The ledger is pruned only behind the standby's acknowledged index, so while
a standby is away it grows. :class:`LedgerBound` checks now and then whether
it holds more than ``[replication] ledger_max_bytes`` of events and, if so,
prunes each VPN's oldest entries, acknowledged or not but never past the
active's own live state, down to half its share; a standby that comes back
behind them gets a checkpoint and loses nothing (README, "Logs, sizing,
housekeeping"). The check reads the table's size on disk first and the
events' exact bytes only when that is over the bound: a table's size stays
high after a prune until vacuum reuses the space, so alone it would prune
again and again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import Any

import psycopg
from psycopg.rows import tuple_row

__all__ = ["LedgerBound"]

log = logging.getLogger(__name__)

#: how often the bound is checked (seconds)
CHECK_SECONDS = 30.0

_TABLE_BYTES = "SELECT pg_total_relation_size('ledger')"
_DATA = """
SELECT l.vpn, sum(octet_length(l.event))::int8, s.applied_index
FROM ledger l JOIN vpn_state s ON s.vpn = l.vpn
GROUP BY l.vpn, s.applied_index
"""
# the newest index whose entries and all older ones are over ``keep`` bytes
# when counted from the newest: everything up to it goes
_CUT = """
SELECT idx FROM (
    SELECT idx, sum(octet_length(event)) OVER (ORDER BY idx DESC) AS newer
    FROM ledger WHERE vpn = %(vpn)s) t
WHERE newer > %(keep)s ORDER BY idx DESC LIMIT 1
"""
_PRUNE = """
WITH gone AS (
    DELETE FROM ledger WHERE vpn = %(vpn)s AND idx <= LEAST(%(cut)s::int8,
        COALESCE((SELECT live_index FROM vpn_live_state WHERE vpn = %(vpn)s), 0))
    RETURNING idx)
SELECT count(*), count(*) FILTER (WHERE idx > %(acked)s) FROM gone
"""


class LedgerBound:
    """Keeps the ledger under ``max_bytes`` (0: no bound)."""

    def __init__(self, dsn: str, max_bytes: int, interval: float = CHECK_SECONDS) -> None:
        self.dsn = dsn
        self.max_bytes = max_bytes
        self.interval = interval
        #: vpn -> entries pruned before the standby acknowledged them
        self.unacknowledged: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.max_bytes > 0:
            self._task = asyncio.create_task(self._loop(), name="ledger-bound")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check()
            except psycopg.Error as e:
                log.warning("ledger bound not checked: %s", e)

    async def check(self) -> dict[str, int]:
        """Prune where the bound is exceeded; returns VPN -> entries pruned."""
        async with await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, connect_timeout=10
        ) as conn:
            cur = conn.cursor(row_factory=tuple_row)
            await cur.execute(_TABLE_BYTES)
            row = await cur.fetchone()
            if row is None or int(row[0]) <= self.max_bytes:
                return {}
            await cur.execute(_DATA)
            data = await cur.fetchall()
            total = sum(int(r[1] or 0) for r in data)
            if total <= self.max_bytes:
                return {}
            pruned = {}
            for vpn, size, applied in data:
                keep = self.max_bytes * int(size) // total // 2
                pruned[str(vpn)] = await self._prune(cur, str(vpn), int(size), keep, int(applied))
            return pruned

    async def _prune(self, cur: Any, vpn: str, size: int, keep: int, acked: int) -> int:
        await cur.execute(_CUT, {"vpn": vpn, "keep": keep})
        found = await cur.fetchone()
        if found is None:
            return 0
        cut = int(found[0])
        await cur.execute(_PRUNE, {"vpn": vpn, "cut": cut, "acked": acked})
        counted = await cur.fetchone()
        gone, past = (int(counted[0]), int(counted[1])) if counted else (0, 0)
        if not gone:
            return 0
        self.unacknowledged[vpn] += past
        log.warning(
            "VPN %s: the ledger held %d bytes of events, over [replication] ledger_max_bytes"
            " (%d for all VPNs): %d entries up to index %d pruned, %d of them not acknowledged"
            " by the standby, which resyncs from a checkpoint when it comes back",
            vpn,
            size,
            self.max_bytes,
            gone,
            cut,
            past,
        )
        return gone
