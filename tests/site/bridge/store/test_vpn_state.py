"""The statements on ``vpn_state`` (bridge/store/_vpn_state.py) against a
real PostgreSQL: the bridge's progress, the ledger's indexes, and the
standby apply's lock on its row, run blocking and on asyncio."""

from __future__ import annotations

from typing import Any

import psycopg

from bridge import Role
from bridge.store import (
    active_ledgers,
    advance_ledger_indexes,
    applied_position,
    become_active,
    ledger_progress,
    ledger_start,
    lock_applied,
    lock_for_promotion,
    lock_ledger_indexes,
    mark_fenced,
    record_sync_eligible,
    reset_bridge_states,
    set_applied,
    set_bridge_state,
)
from tests.fix_sites import until_a_lock_waits
from tests.site.bridge.store.test_vpn_config import enable, on_loop, one


def test_the_bridge_records_its_progress_in_vpn_state(dsn: str) -> None:
    enable(dsn, "orders", "active")
    enable(dsn, "audit", "active")
    enable(dsn, "mirror", "standby")

    async def record(conn: psycopg.AsyncConnection[Any]) -> None:
        async with conn.transaction():
            await set_bridge_state("orders", "connected").run_async(conn)
            await set_bridge_state("mirror", "syncing").run_async(conn)
            await set_applied("orders", 12, 2).run_async(conn)
            await mark_fenced("audit").run_async(conn)
            await record_sync_eligible("orders", False).run_async(conn)
        assert await applied_position("orders").run_async(conn) == (12, 2)
        assert await applied_position("nowhere").run_async(conn) is None
        assert await ledger_progress("orders").run_async(conn) == (0, 12)
        assert await ledger_progress("nowhere").run_async(conn) is None

    on_loop(dsn, record)
    row = "SELECT bridge_state, fenced, sync_eligible, applied_at IS NOT NULL FROM vpn_state"
    assert one(dsn, row + " WHERE vpn = 'orders'") == ("connected", False, False, True)
    assert one(dsn, row + " WHERE vpn = 'audit'") == ("disconnected", True, True, False)

    async def reset(conn: psycopg.AsyncConnection[Any]) -> None:
        await reset_bridge_states(Role.ACTIVE).run_async(conn)

    on_loop(dsn, reset)  # a restarting active: its links are all down
    assert one(dsn, row + " WHERE vpn = 'orders'")[0] == "disconnected"
    assert one(dsn, row + " WHERE vpn = 'mirror'")[0] == "syncing"


def test_the_ledger_indexes_are_loaded_locked_and_advanced(dsn: str) -> None:
    enable(dsn, "orders", "active")
    enable(dsn, "audit", "active")
    enable(dsn, "mirror", "standby")
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO vpn_live_state (vpn, live_index) VALUES ('orders', 3)")

    async def ledger(conn: psycopg.AsyncConnection[Any]) -> None:
        starts = await active_ledgers().run_async(conn)  # in no particular order
        assert sorted((s.vpn, s.epoch, s.ledger_index, s.live_index) for s in starts) == [
            ("audit", 1, 0, 0),
            ("orders", 1, 0, 3),
        ]
        mirror = await ledger_start("mirror").run_async(conn)  # any role
        assert mirror is not None and mirror.ledger_index == 0
        assert await ledger_start("nowhere").run_async(conn) is None
        async with conn.transaction():
            locked = await lock_ledger_indexes({"orders", "audit", "nowhere"}).run_async(conn)
            assert locked == {"audit": 0, "orders": 0}
            await advance_ledger_indexes({"orders": 10, "audit": 4}).run_async(conn)
        orders = await ledger_start("orders").run_async(conn)
        assert orders is not None and (orders.ledger_index, orders.live_index) == (10, 3)

    on_loop(dsn, ledger)


def test_a_standby_apply_locks_its_row_and_reads_its_role(dsn: str) -> None:
    enable(dsn, "mirror", "standby")
    with psycopg.connect(dsn) as conn:
        set_applied("mirror", 5, 2).run(conn)
        found = lock_applied("mirror").run(conn)
        assert found is not None
        assert (found.applied_index, found.applied_epoch, found.role) == (5, 2, Role.STANDBY)
        assert lock_applied("nowhere").run(conn) is None


def test_a_standby_apply_waiting_on_a_promotion_reads_the_role_it_left(dsn: str) -> None:
    """An apply that waits for a promotion's locks must see the VPN active
    once it gets them: with only the state row locked, PostgreSQL re-read
    that row but took the role from its first snapshot ('standby'), and the
    stream was applied past the index the promotion began the ledger at."""
    import threading

    enable(dsn, "mirror", "standby")
    found: list[Role] = []
    with psycopg.connect(dsn) as promoting:
        assert lock_for_promotion("mirror").run(promoting) is not None
        become_active("mirror", 2, 0).run(promoting)

        def apply() -> None:
            with psycopg.connect(dsn) as conn:
                lock = lock_applied("mirror").run(conn)
                assert lock is not None
                found.append(lock.role)

        waiter = threading.Thread(target=apply)
        waiter.start()
        until_a_lock_waits(dsn, "the apply")
        promoting.commit()
    waiter.join(10)
    assert found == [Role.ACTIVE]
