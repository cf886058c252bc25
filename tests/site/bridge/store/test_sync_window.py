"""Sync-ineligible windows in a real PostgreSQL (bridge/store/_sync_window.py):
the statements that open, close, add and list them, and the one a demotion
closes a window with. Its ``dsn`` fixture (two sync VPNs enabled) and
helpers are those of the recorder's and the replicator's tests too
(``tests/site/bridge/active/``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from bridge import VpnSettings
from bridge.store import (
    add_vpn_state,
    add_window,
    close_left_open,
    close_window,
    open_window,
    record_first_epoch,
    save_vpn_settings,
    windows_by_vpn,
)
from plugin.devtools import LocalSite
from sql import migrate


@pytest.fixture
def dsn(site_a: LocalSite) -> str:
    dsn = site_a.pg.dsn()
    migrate(dsn)
    for name in ("orders", "billing"):
        enable(dsn, name)
    return dsn


def enable(dsn: str, name: str) -> None:
    settings = VpnSettings.from_args(name, "active", "sync")
    with psycopg.connect(dsn) as conn:
        save_vpn_settings(settings).run(conn)
        add_vpn_state(name).run(conn)
        record_first_epoch(name, "a").run(conn)


def on_loop(dsn: str, work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[Any]]) -> Any:
    async def scenario() -> Any:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            return await work(conn)

    return asyncio.run(scenario())


def rows(dsn: str, vpn: str = "orders") -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT epoch, first_index, last_index, closed_at IS NOT NULL FROM sync_window"
            " WHERE vpn = %s ORDER BY epoch, first_index",
            (vpn,),
        ).fetchall()


def set_ledger_index(dsn: str, vpn: str, index: int) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE vpn_state SET ledger_index = %s WHERE vpn = %s", (index, vpn))


def test_windows_are_opened_closed_added_and_listed_newest_first(dsn: str) -> None:
    async def work(conn: psycopg.AsyncConnection[Any]) -> None:
        await open_window("orders", 5).run_async(conn)
        await open_window("orders", 5).run_async(conn)  # a retry after a lost reply: one row
        await close_window("orders", 5, 9).run_async(conn)
        await close_window("orders", 5, 12).run_async(conn)  # closed already: kept as it was
        await add_window("orders", 20, 22).run_async(conn)  # a degraded transaction's group
        await add_window("orders", 20, 22).run_async(conn)
        for first in range(30, 42):
            await add_window("billing", first, first).run_async(conn)

    on_loop(dsn, work)
    assert rows(dsn) == [(1, 5, 9, True), (1, 20, 22, True)]
    with psycopg.connect(dsn) as conn:
        found = windows_by_vpn().run(conn)
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(
                "INSERT INTO sync_window (vpn, epoch, first_index, last_index, closed_at)"
                " VALUES ('orders', 1, 50, 49, now())"
            )
    assert found["orders"].total == 2
    assert [(w.first, w.last) for w in found["orders"].newest] == [(20, 22), (5, 9)]
    assert found["billing"].total == 12
    assert [w.first for w in found["billing"].newest] == list(range(41, 31, -1))  # newest 10
    doc = found["orders"].newest[0].as_dict()
    assert (doc["epoch"], doc["first_index"], doc["last_index"]) == (1, 20, 22)
    assert doc["closed_at"] is not None and doc["opened_at"] <= doc["closed_at"]


def test_a_demotion_closes_the_vpns_open_window_before_its_ledger_index_is_reset(
    dsn: str,
) -> None:
    on_loop(dsn, lambda conn: open_window("orders", 40).run_async(conn))
    on_loop(dsn, lambda conn: open_window("billing", 3).run_async(conn))
    set_ledger_index(dsn, "orders", 44)
    with psycopg.connect(dsn) as conn:
        closed = close_left_open("orders").run(conn)
    assert [(w.vpn, w.first, w.last) for w in closed] == [("orders", 40, 44)]
    assert rows(dsn, "billing") == [(1, 3, None, False)]  # another VPN's: still open
