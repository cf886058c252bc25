"""The leases one node process holds among its site's nodes.

A node takes a lease (``lease``, :mod:`bridge.store._lease`; the scope
``site`` for the site's whole work) before it leads, and renews every lease
it holds a third of the lease time apart. It judges each lease itself, on
its monotonic clock from before the renewal it sent
(:class:`~bridge.store.HeldLease`): a lease whose time ran out while the
database did not answer, or whose renewal found another holder's term, is
lost, and ``on_lost`` is told once, so the node stops confirming before
another node may take over. Each database call is bounded by a third of the
lease time, so a hung renewal cannot outlive the lease unnoticed; a node
that lost a lease takes it again as a new holder
(``<holder>.<process>-<generation>``), so the term rises and fences what it
wrote before the loss; a second process started under the same name is
another holder too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

from bridge.store import (
    HeldLease,
    Statement,
    release_lease,
    renew_lease,
    session_name,
    take_lease,
    take_lease_from,
)

__all__ = ["LeaseKeeper"]

log = logging.getLogger("vpnrepl.node")

_T = TypeVar("_T")


class LeaseKeeper:
    """Takes, renews and releases ``holder``'s leases of ``seconds``."""

    def __init__(
        self,
        dsn: str,
        holder: str,
        seconds: float,
        on_lost: Callable[[str, int], None],
    ) -> None:
        self.dsn = dsn
        self.holder = holder
        self.seconds = seconds
        self.on_lost = on_lost
        self._held: dict[str, HeldLease] = {}
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._generation = 0  # rises at each loss: the next take is a new term
        # this process's own: two processes started with one node name (a
        # mistake, or a restart within the lease) are two holders, and the
        # second cannot take the first one's lease as if it were its own
        self._process = secrets.token_hex(4)
        self._calls = asyncio.Lock()  # one call at a time on the connection

    @property
    def holder_id(self) -> str:
        """The holder the database knows this node by, now:
        ``<node>.<process>-<generation>`` (the node's name is before the
        last dot)."""
        return f"{self.holder}.{self._process}-{self._generation}"

    async def _call(self, statement: Statement[_T]) -> _T:
        """``statement`` on the connection, bounded by a third of the lease."""
        async with self._calls:
            try:
                # asyncio.timeout, not wait_for: in Python 3.11 wait_for can
                # swallow a cancellation that comes as the call completes
                async with asyncio.timeout(self.seconds / 3):
                    conn = self._conn
                    if conn is None or conn.closed:
                        conn = await psycopg.AsyncConnection.connect(
                            self.dsn,
                            autocommit=True,
                            # while this process lives it has this session:
                            # a taker can tell it from a process that died
                            application_name=session_name(self.holder_id),
                        )
                        self._conn = conn
                    return await statement.run_async(conn)
            except BaseException:  # a call cut short leaves the connection unusable
                if self._conn is not None:
                    await self._conn.close()
                    self._conn = None
                raise

    async def read(self, statement: Statement[_T]) -> _T:
        """Run a read of the leases (who holds one) on this keeper's
        connection, bounded as its own calls are."""
        return await self._call(statement)

    def term(self, scope: str) -> int | None:
        """The term this node leads ``scope`` under, or None when it does not
        (never took it, lost it, or its time ran out unrenewed)."""
        lease = self._held.get(scope)
        if lease is None:
            return None
        if not lease.valid():
            self._lose(scope, "its time ran out before a renewal was answered")
            return None
        return lease.term

    async def take(self, scope: str) -> int | None:
        """Take ``scope``'s lease; its term, or None while another node's runs."""
        asked, holder = time.monotonic(), self.holder_id
        term = await self._call(take_lease(scope, holder, self.seconds))
        if term is not None:
            self._held[scope] = HeldLease.asked_at(scope, holder, term, asked, self.seconds)
        return term

    async def take_from(self, scope: str, previous: str) -> int | None:
        """Take ``scope``'s lease from ``previous``, whose process is gone,
        before it ran out; its term, or None when ``previous`` lost it meanwhile."""
        asked, holder = time.monotonic(), self.holder_id
        term = await self._call(take_lease_from(scope, holder, previous, self.seconds))
        if term is not None:
            self._held[scope] = HeldLease.asked_at(scope, holder, term, asked, self.seconds)
        return term

    async def release(self, scope: str) -> None:
        """Let ``scope``'s lease go at once (another node may take it now)."""
        lease = self._held.pop(scope, None)
        if lease is not None:  # after any renewal in flight (one call at a time)
            await self._call(release_lease(scope, lease.holder, lease.term))

    async def renew(self) -> None:
        """Renew every lease held; a lease another node took is lost."""
        for scope, lease in list(self._held.items()):
            asked = time.monotonic()
            try:
                term = await self._call(renew_lease(scope, lease.holder, lease.term, self.seconds))
            except (TimeoutError, psycopg.Error) as e:
                log.warning("lease %s: the lease was not renewed: %r", scope, e)
                self.term(scope)  # lost if its time ran out meanwhile
                continue
            if self._held.get(scope) is not lease:
                continue  # released or lost meanwhile: this renewal counts for nothing
            if term is None:
                self._lose(scope, "another node took it")
            else:
                self._held[scope] = HeldLease.asked_at(
                    scope, lease.holder, term, asked, self.seconds
                )

    async def run(self) -> None:
        """Renew a third of the lease time apart, until cancelled; a lease
        whose time ran out meanwhile (a process paused, a loop held up) is
        judged lost before its renewal is even sent."""
        while True:
            await asyncio.sleep(self.seconds / 3)
            for scope in list(self._held):
                self.term(scope)
            await self.renew()

    async def close(self) -> None:
        for scope in list(self._held):
            with contextlib.suppress(TimeoutError, psycopg.Error):  # one not released expires
                await self.release(scope)
        if self._conn is not None:
            await self._conn.close()

    def lose(self, scope: str, why: str) -> None:
        """Count ``scope``'s lease lost now (a write it fences was refused:
        another holder took it), without waiting for the next renewal."""
        self._lose(scope, why)

    def _lose(self, scope: str, why: str) -> None:
        lease = self._held.pop(scope, None)
        if lease is not None:
            self._generation += 1
            log.error("lease %s: this node lost it (term %d): %s", scope, lease.term, why)
            self.on_lost(scope, lease.term)
