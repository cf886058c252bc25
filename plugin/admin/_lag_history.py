"""The last minutes of each VPN's replication lag, for the status page's chart.

The node samples its status every :data:`SAMPLE_SECONDS` and keeps
:data:`WINDOW_SECONDS` of samples in memory (a restart starts a new history;
Prometheus keeps the long one). ``/status/history`` serves them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from plugin._errors import PluginError

__all__ = ["SAMPLE_SECONDS", "WINDOW_SECONDS", "LagHistory"]

# the node's own log: the sampling runs inside it
log = logging.getLogger("vpnrepl.node")

SAMPLE_SECONDS = 2.0
WINDOW_SECONDS = 600.0


class LagHistory:
    """Per VPN, ``(unix time, lag events, lag seconds, applied index)`` samples."""

    def __init__(self, window: float = WINDOW_SECONDS, every: float = SAMPLE_SECONDS) -> None:
        self._keep = max(int(window / every), 1)
        self._samples: dict[str, deque[tuple[float, int, float, int]]] = {}

    async def sample(self, read_status: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        """Every :data:`SAMPLE_SECONDS`, one sample of ``read_status()``'s
        lag (a status that cannot be read is skipped)."""
        while True:
            try:
                self.add(await read_status())
            except (PluginError, OSError, psycopg.Error) as e:
                log.debug("lag sample skipped: %s", e)
            await asyncio.sleep(SAMPLE_SECONDS)

    def add(self, doc: dict[str, Any], at: float | None = None) -> None:
        """One sample from a status document; VPNs no longer in it are dropped."""
        now = time.time() if at is None else at
        names = set()
        for v in doc["vpns"]:
            names.add(v["name"])
            samples = self._samples.setdefault(v["name"], deque(maxlen=self._keep))
            samples.append((now, v["lag_events"], v["lag_seconds"], v["applied_index"]))
        for gone in set(self._samples) - names:
            del self._samples[gone]

    def as_json(self) -> dict[str, Any]:
        """``{"every": s, "vpns": {vpn: [[t, events, seconds, applied], ...]}}``"""
        return {
            "every": SAMPLE_SECONDS,
            "vpns": {vpn: [list(s) for s in samples] for vpn, samples in self._samples.items()},
        }
