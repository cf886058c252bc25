"""The active's ledger, pruned behind the standbys' acknowledgements.

Invariant: the ledger is pruned only behind an acknowledgement, keeping the
acknowledged entry itself, so a standby that reconnects after a quiet period
still proves with its epoch that it follows the ledger and needs no
checkpoint. Acknowledgements are recorded every 50 ms under load; a prune
that often was a DELETE and a wait for the live state per flush, for
entries kept ``retain_seconds`` anyway. So a prune runs at most once per
:data:`PRUNE_INTERVAL`, off the loop that records them, and the newest
acknowledged index always gets one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from bridge.ledger import LedgerError, LedgerReader

__all__ = ["PRUNE_INTERVAL", "LedgerPruner"]

log = logging.getLogger(__name__)

#: the active prunes its ledger at most this often (seconds)
PRUNE_INTERVAL = 1.0


class LedgerPruner:
    """Prunes the ledger through ``reader`` behind recorded acknowledgements,
    once entries are older than ``retain_seconds``."""

    def __init__(self, reader: LedgerReader, retain_seconds: float) -> None:
        self._reader = reader
        self.retain_seconds = retain_seconds
        self._due: dict[str, int] = {}  # vpn -> newest acknowledged index
        self._task: asyncio.Task[None] | None = None
        self._pruned_at = -PRUNE_INTERVAL

    async def acked(self, acked: Mapping[str, int]) -> None:
        """Acknowledgements were recorded (vpn -> index): prune behind them soon."""
        for vpn, index in acked.items():
            self._due[vpn] = max(index, self._due.get(vpn, 0))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._prune_soon(), name="bridge-ledger-prune")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _prune_soon(self) -> None:
        while self._due:
            wait = self._pruned_at + PRUNE_INTERVAL - asyncio.get_running_loop().time()
            if wait > 0:
                await asyncio.sleep(wait)
            due, self._due = self._due, {}
            self._pruned_at = asyncio.get_running_loop().time()
            for vpn, index in due.items():
                if index <= 1:
                    continue
                try:  # keep the acknowledged entry itself
                    await self._reader.prune(vpn, index - 1, self.retain_seconds)
                except LedgerError as e:
                    log.warning("bridge: VPN %s: ledger not pruned: %s", vpn, e)
