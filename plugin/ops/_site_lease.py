"""The site's lease, held by the CLI while it runs a command without a node.

The site lock (:mod:`plugin.ops._requests`) keeps a node and the CLI from
acting at once while both are alive and connected. It cannot stop a node
that lost its lock's session but still runs (paused, cut off from the
database for a while): such a node's writes are fenced only by the site's
lease (``lease``, :mod:`bridge.store._lease`). So the CLI, before it acts
alone, waits out a lease it cannot see released (a ``promote`` after a
disaster waits at most the lease time) and then takes the lease itself:
the term rises, and the old leader's ledger commits are refused from then
on. The CLI renews it while it works and releases it when done.

A lease that is renewed while the CLI waits belongs to a live node (one
starting, waiting for the lock this CLI holds): the command is then handed
to that node instead, within a poll (half a second) of the renewal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import psycopg

from bridge.store import SITE, end_sessions, lease_of, release_lease, renew_lease, take_lease
from plugin._errors import StateError

__all__ = ["CLI_LEASE_SECONDS", "site_lease"]

log = logging.getLogger(__name__)

#: the CLI's lease time (renewed a third of it apart while the command runs)
CLI_LEASE_SECONDS = 30.0
#: how often a lease being waited out is read again
_POLL_SECONDS = 0.5


@contextlib.asynccontextmanager
async def site_lease(dsn: str) -> AsyncIterator[bool]:
    """Hold the site's lease for this process: yields True while held,
    False when a live node holds it (the command goes to that node). A
    lease taken from this process while the command runs cancels the
    command (StateError): a node leads the site now."""
    holder = f"cli.{os.getpid()}"
    async with await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, connect_timeout=10
    ) as conn:
        # a take waits at most this long on a row lock
        await conn.execute("SET lock_timeout = '5s'")
        try:
            term = await _wait_and_take(conn, holder)
        except psycopg.errors.UndefinedTable:  # a schema before 0018: no node fences by it
            yield True
            return
        if term is None:
            yield False
            return
        owner = asyncio.current_task()
        lost: list[str] = []
        renewing = asyncio.create_task(_renew(dsn, holder, term, owner, lost), name="cli-lease")
        try:
            yield True
        except asyncio.CancelledError:
            if lost:
                raise StateError(
                    f"the site's lease was lost while the command ran ({lost[0]}): a node "
                    "leads the site now; check `vpnrepl status` and run the command again"
                ) from None
            raise
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
            with contextlib.suppress(psycopg.Error):
                await release_lease(SITE, holder, term).run_async(conn)


async def _wait_and_take(conn: psycopg.AsyncConnection[Any], holder: str) -> int | None:
    """Wait out the lease of a node that let it run, then take it; None
    when its holder renews it (alive: a node starting, waiting for the
    lock this CLI holds)."""
    found = await lease_of(SITE).run_async(conn)
    if found is not None and found[2] > 0:
        who, _, left = found
        log.warning(
            "the site's lease is %s's for %.1f s more and its lock is free: waiting it out "
            "(a node that lost its database session may still be running)",
            who,
            left,
        )
        deadline = time.monotonic() + left + 1.0
        while found is not None and found[2] > 0:
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(_POLL_SECONDS)
            before = found
            found = await lease_of(SITE).run_async(conn)
            if found is not None and found[2] > 0 and _renewed(before, found):
                return None
    if found is not None:  # ran out: its holder's sessions may hold the lease row
        await end_sessions(found[0]).run_async(conn)
    return await take_lease(SITE, holder, CLI_LEASE_SECONDS).run_async(conn)


def _renewed(before: tuple[str, int, float], now: tuple[str, int, float]) -> bool:
    """The lease changed hands, or its time grew: its holder is alive."""
    return now[:2] != before[:2] or now[2] > before[2] + _POLL_SECONDS / 2


async def _renew(
    dsn: str, holder: str, term: int, owner: asyncio.Task[Any] | None, lost: list[str]
) -> None:
    """Renew a third of the lease apart; a failed renewal is retried until
    the lease would run out, and a lease lost cancels ``owner``."""
    renewed = time.monotonic()
    while True:
        await asyncio.sleep(CLI_LEASE_SECONDS / 3)
        try:
            async with await psycopg.AsyncConnection.connect(
                dsn, autocommit=True, connect_timeout=5
            ) as conn:
                found = await renew_lease(SITE, holder, term, CLI_LEASE_SECONDS).run_async(conn)
        except psycopg.Error as e:
            if time.monotonic() - renewed < CLI_LEASE_SECONDS * 2 / 3:
                log.warning("the site's lease was not renewed (%s): retrying", e)
                continue
            found, why = None, f"not renewed in time: {e}"
        else:
            why = "another holder took it"
        if found is not None:
            renewed = time.monotonic()
            continue
        lost.append(why)
        log.error("the site's lease was lost while the command ran: %s", why)
        if owner is not None:
            owner.cancel()
        return
