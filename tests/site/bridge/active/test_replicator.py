"""The active's replication sink (bridge/active/_replicator.py) with a real
PostgreSQL behind its window recorder: a degraded sync gate's confirms wait
until the window's opening row is durable."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import psycopg

from bridge import VpnSettings
from bridge.active import Replicator, WindowRecorder
from bridge.ledger import LedgerWriter
from tests.site.bridge.store.test_sync_window import rows


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
