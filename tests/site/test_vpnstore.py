"""The statements on ``vpn_config``, ``vpn_state`` and ``vpn_epoch``
(bridge/store/_vpn_*.py) against a real PostgreSQL: what each reads and
writes, run blocking and on asyncio, and that it stays inside the caller's
transaction."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from bridge import Mode, Role, SyncTimeoutPolicy, TopicFilter, VpnSettings
from bridge.store import (
    ConfigLock,
    FollowedSettings,
    active_ledgers,
    active_vpns,
    add_standby_vpn,
    add_vpn_state,
    advance_ledger_indexes,
    applied_position,
    become_active,
    disable_replication,
    enabled_vpns,
    fence_vpn,
    known_epochs,
    ledger_progress,
    ledger_start,
    lock_applied,
    lock_for_promotion,
    lock_ledger_indexes,
    lock_vpn_config,
    mark_fenced,
    raise_epoch,
    read_followed_settings,
    read_vpn_settings,
    record_first_epoch,
    record_sync_eligible,
    reset_bridge_states,
    role_state,
    save_followed_settings,
    save_vpn_settings,
    set_applied,
    set_bridge_state,
    vpn_status_rows,
)
from bridge.wire import VpnResource
from plugin.devtools import LocalSite
from sql import migrate
from tests.fix_sites import until_a_lock_waits


@pytest.fixture
def dsn(site_a: LocalSite) -> str:
    dsn = site_a.pg.dsn()
    migrate(dsn)
    return dsn


def enable(dsn: str, name: str, role: str, **options: Any) -> VpnSettings:
    settings = VpnSettings.from_args(name, role, **options)
    with psycopg.connect(dsn) as conn:
        save_vpn_settings(settings).run(conn)
        add_vpn_state(settings.name).run(conn)
        record_first_epoch(settings.name, "a").run(conn)
    return settings


def one(dsn: str, sql: str, *params: Any) -> tuple[Any, ...]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql, params).fetchone()
    assert row is not None
    return tuple(row)


def on_loop(dsn: str, work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[Any]]) -> Any:
    """``work(conn)`` on an autocommit asyncio connection, as the bridge's pools give."""

    async def scenario() -> Any:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            return await work(conn)

    return asyncio.run(scenario())


def resource(name: str, epoch: int, **changes: Any) -> VpnResource:
    fields: dict[str, Any] = {
        "mode": Mode.ASYNC,
        "sync_timeout_ms": 2000,
        "on_sync_timeout": SyncTimeoutPolicy.DEGRADE,
        "queue_patterns": ("orders\\..*",),
        "topic_filters": (TopicFilter.parse("amq.topic:orders.#"),),
        "definitions_json": b'{"queues": []}',
        "expose_id": False,
        **changes,
    }
    return VpnResource(name, epoch, **fields)


# ------------------------------------------------------------- settings


def test_settings_are_saved_locked_read_and_disabled(dsn: str) -> None:
    settings = enable(dsn, "orders", "active", mode="sync", queues=("q.*",), expose_id=True)
    with psycopg.connect(dsn) as conn:
        assert lock_vpn_config("orders").run(conn) == ConfigLock(Role.ACTIVE, True, 1)
        assert lock_vpn_config("nowhere").run(conn) is None
        assert read_vpn_settings("orders").run(conn) == settings
        assert read_vpn_settings("nowhere").run(conn) is None
        found = role_state("orders").run(conn)
        assert found is not None
        assert (found.role, found.fenced) == (Role.ACTIVE, False)
        assert found.bridge_state == "disconnected"
    assert one(dsn, "SELECT epoch, site FROM vpn_epoch WHERE vpn = 'orders'") == (1, "a")
    with psycopg.connect(dsn) as conn:
        assert disable_replication("orders").run(conn)
        assert not disable_replication("orders").run(conn)
        assert role_state("orders").run(conn) is None  # only enabled VPNs have one
        assert lock_vpn_config("orders").run(conn) == ConfigLock(Role.ACTIVE, False, 1)
    with psycopg.connect(dsn) as conn:
        status = vpn_status_rows().run(conn)
    assert status == []


def test_the_functions_run_in_the_callers_transaction(dsn: str) -> None:
    enable(dsn, "orders", "active")
    with psycopg.connect(dsn) as conn:
        disable_replication("orders").run(conn)
        set_applied("orders", 7, 2).run(conn)
        conn.rollback()
    assert one(dsn, "SELECT enabled FROM vpn_config WHERE name = 'orders'") == (True,)
    with psycopg.connect(dsn) as conn:
        assert applied_position("orders").run(conn) == (0, 0)


def test_status_rows_carry_progress_and_transactions(dsn: str) -> None:
    enable(dsn, "orders", "active", topics=("amq.topic:orders.#",))
    enable(dsn, "audit", "standby")
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE vpn_state SET ledger_index = 9 WHERE vpn = 'orders'")
        set_applied("orders", 4, 1).run(conn)
        conn.execute(
            "INSERT INTO txn_log (txid, vpn, side, state, events)"
            " VALUES ('t1', 'orders', 'coordinator', 'prepared', '')"
        )
    with psycopg.connect(dsn) as conn:
        audit, orders = vpn_status_rows().run(conn)
    assert (audit.name, audit.role, orders.name, orders.role) == (
        "audit",
        Role.STANDBY,
        "orders",
        Role.ACTIVE,
    )
    assert (orders.ledger_index, orders.applied_index, orders.in_doubt_txns) == (9, 4, 1)
    assert orders.topic_filters == ["amq.topic:orders.#"]
    assert orders.since_applied >= 0.0 and orders.degraded_txns == 0


# ------------------------------------------------------------- what the bridge needs


def test_a_listed_vpn_is_added_as_standby_and_follows_the_active(dsn: str) -> None:
    listed = resource("orders", 3)

    async def adopt(conn: psycopg.AsyncConnection[Any]) -> None:
        async with conn.transaction():
            assert await lock_vpn_config("orders").run_async(conn) is None
            await add_standby_vpn("orders", 3, FollowedSettings.of(listed)).run_async(conn)
            await add_vpn_state("orders").run_async(conn)
            await add_vpn_state("orders").run_async(conn)  # once only
        assert await lock_vpn_config("orders").run_async(conn) == ConfigLock(Role.STANDBY, True, 3)
        assert await read_followed_settings("orders").run_async(conn) == FollowedSettings.of(listed)
        assert await read_followed_settings("nowhere").run_async(conn) is None

    on_loop(dsn, adopt)
    changed = resource("orders", 4, mode=Mode.SYNC, queue_patterns=("billing",), expose_id=True)

    async def follow(conn: psycopg.AsyncConnection[Any]) -> list[str]:
        stored = await read_followed_settings("orders").run_async(conn)
        assert stored is not None
        changes = stored.changes(FollowedSettings.of(changed))
        following = FollowedSettings.of(changed)
        await save_followed_settings("orders", following).run_async(conn)
        assert await read_followed_settings("orders").run_async(conn) == following
        await raise_epoch("orders", 4).run_async(conn)
        await raise_epoch("orders", 2).run_async(conn)  # an epoch never falls
        return changes

    assert on_loop(dsn, follow) == [
        "mode 'async' -> 'sync'",
        "queue_patterns ['orders\\\\..*'] -> ['billing']",
        "expose_id False -> True",
    ]
    with psycopg.connect(dsn) as conn:
        found = read_vpn_settings("orders").run(conn)
    assert found is not None
    assert (found.role, found.mode, found.queue_patterns, found.expose_id) == (
        Role.STANDBY,
        Mode.SYNC,
        ("billing",),
        True,
    )
    assert on_loop(dsn, known_epochs().run_async) == {"orders": 4}


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


def test_the_active_listing_leaves_out_fenced_promoting_and_standby_vpns(dsn: str) -> None:
    served = enable(dsn, "orders", "active", mode="sync", topics=("amq.topic:orders.#",))
    for name in ("fenced", "promoting", "disabled"):
        enable(dsn, name, "active")
    enable(dsn, "mirror", "standby")
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE vpn_config SET epoch = 2 WHERE name = 'orders'")
        conn.execute(
            "INSERT INTO vpn_epoch (vpn, epoch, site, taken_over_at) VALUES ('orders', 2, 'a', 5)"
        )
        conn.execute("UPDATE vpn_state SET fenced = true WHERE vpn = 'fenced'")
        conn.execute("INSERT INTO promotion (vpn, epoch, state) VALUES ('promoting', 1, 'running')")
        disable_replication("disabled").run(conn)
    listed = on_loop(dsn, active_vpns().run_async)
    assert [(v.settings, v.epoch, v.taken_over_at) for v in listed] == [(served, 2, 5)]

    enabled = on_loop(dsn, enabled_vpns().run_async)
    assert [v.settings.name for v in enabled] == ["fenced", "mirror", "orders", "promoting"]
    by_name = {v.settings.name: v for v in enabled}
    assert by_name["fenced"].fenced and not by_name["orders"].fenced
    assert by_name["promoting"].promotion == "running"
    assert by_name["mirror"].promotion is None and by_name["mirror"].newest_epoch is None
    assert (by_name["orders"].newest_epoch, by_name["orders"].newest_site) == (2, "a")


# ------------------------------------------------------------- the ledger's indexes


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
