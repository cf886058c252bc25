"""The VPN leases one node process holds among its site's nodes.

A node takes a VPN's lease (``vpn_lease``, :mod:`bridge.store._vpn_lease`)
before it leads the VPN, and renews every lease it holds a third of the
lease time apart. It judges each lease itself, on its monotonic clock from
before the renewal it sent (:class:`~bridge.store.HeldLease`): a lease whose
time ran out while the database did not answer, or whose renewal found
another holder's term, is lost, and ``on_lost`` is told once, so the node
stops confirming for that VPN before another node may take it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg

from bridge.store import HeldLease, release_lease, renew_lease, take_lease

__all__ = ["LeaseKeeper"]

log = logging.getLogger("vpnrepl.node")


class LeaseKeeper:
    """Takes, renews and releases ``holder``'s VPN leases of ``seconds``."""

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

    def term(self, vpn: str) -> int | None:
        """The term this node leads ``vpn`` under, or None when it does not
        (never took it, lost it, or its time ran out unrenewed)."""
        lease = self._held.get(vpn)
        if lease is None:
            return None
        if not lease.valid():
            self._lose(vpn, "its time ran out before a renewal was answered")
            return None
        return lease.term

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
        return self._conn

    async def take(self, vpn: str) -> int | None:
        """Take ``vpn``'s lease; its term, or None while another node's runs."""
        asked = time.monotonic()
        term = await take_lease(vpn, self.holder, self.seconds).run_async(await self._connection())
        if term is not None:
            self._held[vpn] = HeldLease.asked_at(vpn, self.holder, term, asked, self.seconds)
        return term

    async def release(self, vpn: str) -> None:
        """Let ``vpn``'s lease go at once (another node may take it now)."""
        lease = self._held.pop(vpn, None)
        if lease is not None:
            await release_lease(vpn, self.holder, lease.term).run_async(await self._connection())

    async def renew(self) -> None:
        """Renew every lease held; a lease another node took is lost."""
        for vpn, lease in list(self._held.items()):
            asked = time.monotonic()
            try:
                conn = await self._connection()
                term = await renew_lease(vpn, self.holder, lease.term, self.seconds).run_async(conn)
            except psycopg.Error as e:
                if self._conn is not None:
                    await self._conn.close()
                log.warning("VPN %s: the lease was not renewed: %s", vpn, e)
                self.term(vpn)  # lost if its time ran out meanwhile
                continue
            if term is None:
                self._lose(vpn, "another node took it")
            elif vpn in self._held:
                self._held[vpn] = HeldLease.asked_at(vpn, self.holder, term, asked, self.seconds)

    async def run(self) -> None:
        """Renew a third of the lease time apart, until cancelled."""
        while True:
            await asyncio.sleep(self.seconds / 3)
            await self.renew()

    async def close(self) -> None:
        for vpn in list(self._held):
            with contextlib.suppress(psycopg.Error):  # a lease not released expires
                await self.release(vpn)
        if self._conn is not None:
            await self._conn.close()

    def _lose(self, vpn: str, why: str) -> None:
        lease = self._held.pop(vpn, None)
        if lease is not None:
            log.error("VPN %s: this node lost its lease (term %d): %s", vpn, lease.term, why)
            self.on_lost(vpn, lease.term)
