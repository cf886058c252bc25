"""What the bridge records in the site database about its streams.

Per VPN, ``vpn_state.bridge_state`` (:data:`CONNECTED`, :data:`SYNCING`,
:data:`DISCONNECTED`, as ``vpnrepl status`` shows them), and on the active
the standby's last acknowledgement (``applied_index``, ``applied_epoch``,
``applied_at``) and ``fenced`` (with the epoch that fenced it, the site
that took it and where, when the standby said so). Invariant: recording never blocks the
bridge and never loses the newest value — :class:`BridgeStateWriter`
coalesces the writes into at most one transaction per interval, and a
value that could not be written (the database is down) is kept for the
next try unless a newer one replaced it meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import psycopg
from psycopg_pool import AsyncConnectionPool

from bridge._settings import Role
from bridge.link import describe_error

from ._vpn_role import fence_vpn
from ._vpn_state import mark_fenced, reset_bridge_states, set_applied, set_bridge_state

__all__ = [
    "CONNECTED",
    "DISCONNECTED",
    "SYNCING",
    "BridgeStateWriter",
    "Pool",
    "open_pool",
    "reset_states",
]

log = logging.getLogger(__name__)

#: ``bridge_state`` values, as ``vpnrepl status`` shows them.
CONNECTED: Final = "connected"  # live: the replay is over, events stream in real time
SYNCING: Final = "syncing"  # a sync was requested: checkpoint and replay under way
DISCONNECTED: Final = "disconnected"  # no stream for this VPN

Pool = AsyncConnectionPool[psycopg.AsyncConnection[Any]]


def open_pool(dsn: str, name: str) -> Pool:
    """The bridge's small pool on the site database (opened by the caller)."""
    return AsyncConnectionPool(
        dsn,
        min_size=1,
        max_size=4,
        open=False,
        kwargs={"autocommit": True, "connect_timeout": 10},
        check=AsyncConnectionPool.check_connection,
        timeout=5.0,
        name=name,
    )


async def reset_states(pool: Pool, role: Role) -> None:
    """A previous process may have died while connected: start from the truth."""
    try:
        async with pool.connection() as conn:
            await reset_bridge_states(role).run_async(conn)
    except psycopg.Error as e:
        log.warning("bridge: cannot reset bridge_state (%s)", describe_error(e))


class BridgeStateWriter:
    """Coalesces the ``vpn_state`` columns the bridge owns into at most one
    transaction per ``interval``; a database outage delays them (logged once),
    it never blocks the bridge."""

    def __init__(
        self,
        pool: Pool,
        interval: float,
        on_acked: Callable[[Mapping[str, int]], Awaitable[None]] | None = None,
    ) -> None:
        self._pool = pool
        self._interval = interval
        self._on_acked = on_acked
        self._states: dict[str, str] = {}
        self._acks: dict[str, tuple[int, int]] = {}
        #: vpn -> (epoch, site, taken_over_at) of the epoch that fenced it,
        #: None when not known
        self._fenced: dict[str, tuple[int, str, int] | None] = {}
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="bridge-vpn-state")

    def bridge_state(self, vpn: str, state: str) -> None:
        self._states[vpn] = state
        self._dirty.set()

    def acked(self, vpn: str, index: int, epoch: int) -> None:
        self._acks[vpn] = (index, epoch)
        self._dirty.set()

    def fenced(self, vpn: str, newer: tuple[int, str, int] | None = None) -> None:
        """``vpn`` is fenced; ``newer``: the epoch that fenced it, the site
        that took it and the index it took it over at (recorded as a
        listing's are: the epoch history, and a split brain when this site
        confirmed past that index)."""
        if newer is not None or vpn not in self._fenced:
            self._fenced[vpn] = newer
        self._dirty.set()

    async def _run(self) -> None:
        while True:
            await self._dirty.wait()
            await self.flush()
            await asyncio.sleep(self._interval)

    async def flush(self) -> None:
        self._dirty.clear()
        states, self._states = self._states, {}
        acks, self._acks = self._acks, {}
        fenced, self._fenced = self._fenced, {}
        if not (states or acks or fenced):
            return
        try:
            await self._write(states, acks, fenced)
        except BaseException as e:
            # Not written (a database error, or cancelled by close()): keep
            # what no newer value replaced meanwhile for the next flush.
            for vpn, state in states.items():
                self._states.setdefault(vpn, state)
            for vpn, ack in acks.items():
                self._acks.setdefault(vpn, ack)
            for vpn, newer in fenced.items():
                if self._fenced.get(vpn) is None:
                    self._fenced[vpn] = newer
            self._dirty.set()
            if not isinstance(e, psycopg.Error):
                raise
            if not self._failing:
                log.warning(
                    "bridge: cannot record replication state (%s); retrying", describe_error(e)
                )
            self._failing = True
            await asyncio.sleep(1.0)
            return
        if self._failing:
            log.info("bridge: replication state recorded again")
            self._failing = False
        if acks and self._on_acked is not None:
            await self._on_acked({vpn: index for vpn, (index, _) in acks.items()})

    async def _write(
        self,
        states: dict[str, str],
        acks: dict[str, tuple[int, int]],
        fenced: dict[str, tuple[int, str, int] | None],
    ) -> None:
        async with self._pool.connection() as conn, conn.transaction():
            for vpn, state in states.items():
                await set_bridge_state(vpn, state).run_async(conn)
            for vpn, (index, epoch) in acks.items():
                await set_applied(vpn, index, epoch).run_async(conn)
            for vpn, newer in fenced.items():
                if newer is None or not await fence_vpn(vpn, *newer).run_async(conn):
                    await mark_fenced(vpn).run_async(conn)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                await self.flush()
