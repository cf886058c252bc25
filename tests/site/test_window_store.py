"""Sync-ineligible windows in a real PostgreSQL (bridge/store/_sync_window.py,
bridge/active/_window_recorder.py): the statements, the restart rule, the
recorder's order and retries, who may read the table, and the sink
holding a window's confirms until its opening is durable."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, cast

import psycopg
import pytest

from bridge import VpnSettings
from bridge.active import Replicator, WindowRecorder
from bridge.ledger import LedgerWriter
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
from tests.fix_sites import role_dsn

#: what a test (or the fault suite's checker) reads: each window of a VPN,
#: one left open by a crash ending at the VPN's durable ledger index
WINDOWS = """
SELECT w.epoch, w.first_index, COALESCE(w.last_index, s.ledger_index) AS last_index
FROM sync_window w JOIN vpn_state s ON s.vpn = w.vpn
WHERE w.vpn = %s ORDER BY w.epoch, w.first_index
"""


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


def test_a_window_a_crash_left_open_is_closed_at_the_ledger_index_by_the_next_start(
    dsn: str,
) -> None:
    """Nothing is confirmed past the durable ledger index (the index is
    written with the entries), so an open window ends there at most."""
    on_loop(dsn, lambda conn: open_window("orders", 40).run_async(conn))
    on_loop(dsn, lambda conn: add_window("orders", 10, 12).run_async(conn))  # closed: untouched
    on_loop(dsn, lambda conn: open_window("billing", 3).run_async(conn))
    set_ledger_index(dsn, "orders", 57)
    set_ledger_index(dsn, "billing", 8)
    with psycopg.connect(dsn) as conn:
        assert conn.execute(WINDOWS, ("orders",)).fetchall() == [(1, 10, 12), (1, 40, 57)]

    async def restart() -> list[tuple[str, int, int | None]]:
        recorder = WindowRecorder(dsn)
        closed = await recorder.start()
        await recorder.close()
        return sorted((w.vpn, w.first, w.last) for w in closed)

    assert asyncio.run(restart()) == [("billing", 3, 8), ("orders", 40, 57)]
    assert rows(dsn) == [(1, 10, 12, True), (1, 40, 57, True)]
    assert rows(dsn, "billing") == [(1, 3, 8, True)]
    set_ledger_index(dsn, "orders", 90)  # a later start: nothing is open any more
    assert asyncio.run(restart()) == []
    assert rows(dsn)[-1] == (1, 40, 57, True)


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


def test_the_peer_role_reads_no_window_even_with_a_default_grant(site_a: LocalSite) -> None:
    """Only the owner's role touches ``sync_window``: a default privilege
    given to another role before the upgrade (``ALTER DEFAULT PRIVILEGES``)
    is revoked by it."""
    dsn = site_a.pg.dsn()
    migrate(dsn, "0015")
    peer = role_dsn(site_a, "vpnrepl_window_peer")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER DEFAULT PRIVILEGES GRANT SELECT ON TABLES TO vpnrepl_window_peer")
    try:
        migrate(dsn)
        with psycopg.connect(peer) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT * FROM sync_window")
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "ALTER DEFAULT PRIVILEGES REVOKE SELECT ON TABLES FROM vpnrepl_window_peer"
            )


def test_the_recorder_retries_a_failed_write_and_calls_back_only_once_it_committed(
    dsn: str,
) -> None:
    """The table missing (any database error) is retried, in order: the
    opening's callback comes after its row exists, the closing after it."""
    called: list[tuple[str, list[tuple[Any, ...]]]] = []

    async def scenario() -> None:
        recorder = WindowRecorder(dsn, max_backoff=0.05)
        await recorder.start()
        with psycopg.connect(dsn) as conn:
            conn.execute("ALTER TABLE sync_window RENAME TO sync_window_away")
        recorder.open_window("orders", 7, lambda: called.append(("open", rows(dsn))))
        recorder.close_window("orders", 7, 9)
        recorder.add_window("orders", 11, 11, lambda: called.append(("add", rows(dsn))))
        await asyncio.sleep(0.5)
        assert called == [] and recorder.store_error is not None and recorder.pending == 3
        with psycopg.connect(dsn) as conn:
            conn.execute("ALTER TABLE sync_window_away RENAME TO sync_window")
        for _ in range(100):
            if len(called) == 2:
                break
            await asyncio.sleep(0.05)
        assert recorder.store_error is None
        await recorder.close()

    asyncio.run(scenario())
    assert called == [
        ("open", [(1, 7, None, False)]),
        ("add", [(1, 7, 9, True), (1, 11, 11, True)]),
    ]


def test_the_sink_confirms_a_window_only_once_its_opening_row_is_durable(dsn: str) -> None:
    """A degraded sync gate's confirms wait for the ``sync_window`` row: a
    transaction holding the table locked keeps them back; the end of the
    window is written when the standby catches up, and nothing waits for it."""
    out: dict[int, bool] = {}
    seen: list[list[tuple[Any, ...]]] = []

    def resolver(index: int) -> Callable[[bool], None]:
        def resolve(ok: bool) -> None:
            out[index] = ok
            seen.append(rows(dsn))  # what a crash right after this confirm would leave

        return resolve

    async def scenario() -> None:
        recorder = WindowRecorder(dsn)
        await recorder.start()
        replicator = Replicator(cast(LedgerWriter, None), recorder)
        replicator.configure(
            VpnSettings.from_args("orders", "active", "sync", 50, "degrade"), acked_index=2
        )
        with psycopg.connect(dsn) as lock:
            lock.execute("LOCK TABLE sync_window IN EXCLUSIVE MODE")
            replicator.wait_standby("orders", 6, resolver(6), first=3)
            await asyncio.sleep(0.4)  # the timeout passed; the opening cannot be written
            assert out == {} and not replicator.sync_eligible("orders")
            replicator.wait_standby("orders", 7, resolver(7))
            assert out == {}
        for _ in range(100):  # the lock is gone: the row, then the confirms
            if len(out) == 2:
                break
            await asyncio.sleep(0.05)
        replicator.standby_acked("orders", 7)
        assert replicator.sync_eligible("orders")
        await replicator.close()
        await recorder.close()

    asyncio.run(scenario())
    assert out == {6: True, 7: True}
    assert seen == [[(1, 3, None, False)]] * 2
    assert rows(dsn) == [(1, 3, 7, True)]
