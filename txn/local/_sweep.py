"""The coordinator's housekeeping, off the client's path, every few seconds:
its rows end once the standby's acknowledged index has passed their
groups, ended rows are pruned after a while, and the markers of decided
transactions still in the classic queue of earlier releases are removed
(one not removed yet waits for the next sweep; the stream keeps its own
until its retention).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

import psycopg

from ._log import TxnLog
from ._markers import MarkerError, MarkerStore

__all__ = ["TXN_RETAIN_SECONDS", "MarkerSweep"]

log = logging.getLogger(__name__)

#: markers of ended transactions are removed in sweeps this often
SWEEP_SECONDS = 5.0
#: how long a transaction's row stays in ``txn_log`` after it is over on
#: both sites (kept for an operator to look at; pruned by the sweep)
TXN_RETAIN_SECONDS = 3600.0
#: every how many sweeps the over rows are pruned
PRUNE_EVERY = 12


class MarkerSweep:
    """Ends, prunes and removes in the background (:meth:`start`)."""

    def __init__(self, txn_log: TxnLog, markers: MarkerStore) -> None:
        self.log = txn_log
        self.markers = markers
        self._decided: dict[str, set[str]] = {}  # vpn -> txids whose markers can go
        self._sweeper: asyncio.Task[None] | None = None

    def done(self, vpn: str, name: str) -> None:
        """The marker ``name`` is not needed any more: the next sweep takes it."""
        self._decided.setdefault(vpn, set()).add(name)

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="txn-marker-sweep")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def _sweep_loop(self) -> None:
        for sweep in itertools.count(1):
            await asyncio.sleep(SWEEP_SECONDS)
            with contextlib.suppress(psycopg.Error):
                await self.log.end_acknowledged()
                if sweep % PRUNE_EVERY == 0:
                    await self.log.prune(TXN_RETAIN_SECONDS)
            for vpn in list(self._decided):
                txids = self._decided.pop(vpn)
                try:
                    await self.markers.remove(vpn, txids)
                except MarkerError as e:
                    log.warning("commit markers not removed yet: %s", e)
                    self._decided.setdefault(vpn, set()).update(txids)
