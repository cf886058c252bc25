"""The writer of sync-ineligible windows (bridge/active/_window_recorder.py)
in a real PostgreSQL: a window a crash left open is closed at the ledger
index by the next start, and a failed write is retried in order, its
callback run only once it committed."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from bridge.active import WindowRecorder
from bridge.store import add_window, open_window
from tests.site.bridge.store.test_sync_window import on_loop, rows, set_ledger_index

#: what a test (or the fault suite's checker) reads: each window of a VPN,
#: one left open by a crash ending at the VPN's durable ledger index
WINDOWS = """
SELECT w.epoch, w.first_index, COALESCE(w.last_index, s.ledger_index) AS last_index
FROM sync_window w JOIN vpn_state s ON s.vpn = w.vpn
WHERE w.vpn = %s ORDER BY w.epoch, w.first_index
"""


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
