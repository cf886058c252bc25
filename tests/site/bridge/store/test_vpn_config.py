"""The statements on ``vpn_config`` (bridge/store/_vpn_config.py) against a
real PostgreSQL: a VPN's settings saved, locked, read and disabled, and a
standby's followed settings and epoch, run blocking and on asyncio.

The helpers here (:func:`enable`, :func:`one`, :func:`on_loop`) are those
the other tests of ``bridge/store`` share; the migrated store is the
``dsn`` fixture of this folder's ``conftest.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from bridge import Mode, Role, SyncTimeoutPolicy, TopicFilter, VpnSettings
from bridge.store import (
    ConfigLock,
    FollowedSettings,
    add_standby_vpn,
    add_vpn_state,
    disable_replication,
    known_epochs,
    lock_vpn_config,
    raise_epoch,
    read_followed_settings,
    read_vpn_settings,
    record_first_epoch,
    role_state,
    save_followed_settings,
    save_vpn_settings,
    vpn_status_rows,
)
from bridge.wire import VpnResource


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
