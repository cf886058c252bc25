"""A VPN's role changes as statements (bridge/store/_vpn_role.py) against a
real PostgreSQL: a fence marks an active VPN once and records the epoch
that fenced it, and where it took over."""

from __future__ import annotations

from typing import Any

import psycopg

from bridge.store import (
    fence_vpn,
)
from tests.site.bridge.store.test_vpn_config import enable, on_loop, one


def test_fencing_marks_an_active_vpn_once_and_records_the_epoch(dsn: str) -> None:
    enable(dsn, "orders", "active")
    enable(dsn, "audit", "active")
    enable(dsn, "mirror", "standby")

    async def fence(conn: psycopg.AsyncConnection[Any]) -> list[bool]:
        async with conn.transaction():
            return [
                await fence_vpn("orders", 2, "b", 7).run_async(conn),
                await fence_vpn("orders", 2, "b", 7).run_async(conn),
                await fence_vpn("mirror", 2, "b").run_async(conn),  # not active here
                await fence_vpn("audit", 1, "b").run_async(conn),  # not a higher epoch
            ]

    assert on_loop(dsn, fence) == [True, False, False, False]
    with psycopg.connect(dsn) as conn:
        assert fence_vpn("audit", 3, "c").run(conn)
    assert one(dsn, "SELECT fenced FROM vpn_state WHERE vpn = 'orders'") == (True,)
    epochs = "SELECT site, taken_over_at FROM vpn_epoch WHERE vpn = %s AND epoch = %s"
    assert one(dsn, epochs, "orders", 2) == ("b", 7)
    assert one(dsn, epochs, "audit", 3) == ("c", 0)


def test_a_fence_without_the_take_over_index_then_with_it_records_the_split_brain(
    dsn: str,
) -> None:
    """A standby's report of a newer epoch fences first, with no index;
    the peer's listing then says where the epoch took over: this site
    confirmed past it, a split brain, recorded though already fenced."""
    enable(dsn, "orders", "active")
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE vpn_state SET ledger_index = 40 WHERE vpn = 'orders'")
        assert fence_vpn("orders", 2, "b").run(conn)  # no index: nothing claimed
        assert one(dsn, "SELECT split_brain FROM vpn_state WHERE vpn = 'orders'") == (False,)
        conn.commit()
        assert not fence_vpn("orders", 2, "b", 10).run(conn)  # fenced already
    assert one(dsn, "SELECT fenced, split_brain FROM vpn_state WHERE vpn = 'orders'") == (
        True,
        True,
    )
