"""Writes sync-ineligible windows to the site database, in order, retrying.

The sink (:class:`~bridge.active._replicator.Replicator`) hands over what its
sync gates report and the ledger ranges of transactions confirmed without
the standby; this writes them with :mod:`bridge.store._sync_window` on a
connection of its own. Invariant: a write's ``then()`` runs only after its
statement committed, and writes run one at a time in order, so a window is
never closed before it is opened. A failed write is retried (capped
back-off) for as long as it takes, never skipped; a window a stop left open
is closed by :meth:`WindowRecorder.start` at the VPN's ledger index, before
any confirm (docs/behaviour.md, "Sync-ineligible windows").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from bridge.ledger import describe_error, retry_log_level, retry_store
from bridge.store import (
    SyncWindow,
    add_window,
    close_left_open,
    close_window,
    open_window,
)

__all__ = ["WindowRecorder"]

log = logging.getLogger(__name__)

_AsyncConn = psycopg.AsyncConnection[Any]

#: errors after which a write is tried again (any database error: a write
#: that can never succeed holds its window's confirms, as the ledger would)
_RETRIED = (psycopg.Error, OSError, TimeoutError)


@dataclass(frozen=True, slots=True)
class _Write:
    what: str  # for the log: no message data, only the VPN and indexes
    statement: Callable[[_AsyncConn], Awaitable[None]]
    then: Callable[[], None] | None


class WindowRecorder:
    """Records windows for the sync gates, one write at a time."""

    def __init__(
        self,
        dsn: str,
        *,
        min_backoff: float = 0.01,
        max_backoff: float = 2.0,
        attempt_timeout: float = 30.0,
    ) -> None:
        self._dsn = dsn
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._attempt_timeout = attempt_timeout
        self._writes: deque[_Write] = deque()
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()  # set while nothing is left to write
        self._drained.set()
        self._conn: _AsyncConn | None = None
        self._task: asyncio.Task[None] | None = None
        #: the error of the last failed attempt while writes fail, else None
        self.store_error: BaseException | None = None

    async def start(self) -> list[SyncWindow]:
        """Close the windows a crash left open (the restart rule, before the
        node confirms anything) and start writing; the windows closed."""
        self._conn = await self._connect()
        closed = await close_left_open().run_async(self._conn)
        for w in closed:
            log.warning(
                "VPN %s: sync-ineligible window from index %d (epoch %d) was left open by a "
                "crash; closed at the ledger index %d",
                w.vpn,
                w.first,
                w.epoch,
                w.last,
            )
        self._task = asyncio.create_task(self._run(), name="sync-windows")
        return closed

    def open_window(self, vpn: str, first: int, then: Callable[[], None]) -> None:
        """Record ``vpn``'s window from ``first``; ``then()`` once durable."""

        async def statement(conn: _AsyncConn) -> None:
            await open_window(vpn, first).run_async(conn)

        self._add(_Write(f"VPN {vpn}: opening of window {first}", statement, then))

    def close_window(self, vpn: str, first: int, last: int) -> None:
        """End ``vpn``'s window from ``first`` at ``last`` (nothing waits)."""

        async def statement(conn: _AsyncConn) -> None:
            await close_window(vpn, first, last).run_async(conn)

        self._add(_Write(f"VPN {vpn}: end of window {first}..{last}", statement, None))

    def add_window(self, vpn: str, first: int, last: int, then: Callable[[], None]) -> None:
        """Record ``first``..``last`` as a closed window; ``then()`` once durable."""

        async def statement(conn: _AsyncConn) -> None:
            await add_window(vpn, first, last).run_async(conn)

        self._add(_Write(f"VPN {vpn}: window {first}..{last}", statement, then))

    @property
    def pending(self) -> int:
        return len(self._writes)

    def _add(self, write: _Write) -> None:
        self._writes.append(write)
        self._drained.clear()
        self._wake.set()

    async def close(self, grace: float = 5.0) -> None:
        """Finish the writes given (for up to ``grace`` seconds), then stop."""
        if self._task is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._drained.wait()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._writes:
            log.warning(
                "%d sync-window writes not done at stop (windows left open are closed at "
                "the next start)",
                len(self._writes),
            )
        await self._drop_connection()

    async def _run(self) -> None:
        while True:
            if not self._writes:
                self._drained.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            write = self._writes[0]
            try:
                await self._retrying(write)
            except Exception:  # a bug, not the store: never skipped, tried again
                log.exception("%s failed; retrying", write.what)
                await asyncio.sleep(self._max_backoff)
                continue
            self._writes.popleft()
            if write.then is not None:
                try:
                    write.then()
                except Exception:
                    log.exception("%s: its callback failed", write.what)

    async def _retrying(self, write: _Write) -> None:
        def failed(error: BaseException | None, n: int) -> None:
            self.store_error = error
            if (level := retry_log_level(n)) is not None:
                log.log(
                    level,
                    "%s: attempt %d failed (%s); retrying",
                    write.what,
                    n,
                    describe_error(error) if error is not None else "?",
                )

        await retry_store(
            lambda: self._attempt(write),
            retried=_RETRIED,
            min_backoff=self._min_backoff,
            max_backoff=self._max_backoff,
            failed=failed,
        )
        if self.store_error is not None:
            log.warning("%s: recorded; the store is back", write.what)
            self.store_error = None

    async def _attempt(self, write: _Write) -> None:
        try:
            async with asyncio.timeout(self._attempt_timeout):
                if self._conn is None or self._conn.closed or self._conn.broken:
                    await self._drop_connection()
                    self._conn = await self._connect()
                await write.statement(self._conn)
        except BaseException:
            await self._drop_connection()  # the next attempt on a fresh session
            raise

    async def _connect(self) -> _AsyncConn:
        return await psycopg.AsyncConnection.connect(self._dsn, autocommit=True, connect_timeout=10)

    async def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            with contextlib.suppress(psycopg.Error, OSError):
                await conn.close()
