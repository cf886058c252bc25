"""Replay and retention of the committed ledger (bridge/ledger/_reader.py),
against a real PostgreSQL."""

from __future__ import annotations

import psycopg
import pytest

from bridge.ledger import LedgerClosed, LedgerPruned, LedgerReader, LedgerWriter, VpnNotOpen
from plugin.devtools import LocalSite
from tests.site.bridge.ledger.test_writer import prepare, pub, run


def test_read_range_replays_committed_entries(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            entries = [writer.append(pub("v", n, "q")) for n in range(1, 51)]
            await writer.wait_durable("v", 50)
            assert await writer.reader.read_range("v", 1, 20) == entries[:20]
            assert await writer.reader.read_range("v", 41, 100) == entries[40:]
            assert await writer.reader.read_range("v", 51, 10) == []
            assert await writer.reader.oldest_retained("v") == 1
            with pytest.raises(ValueError):
                await writer.reader.read_range("v", 0, 10)

    run(scenario)


def test_prune_keeps_what_the_standby_lacks_and_what_is_recent(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            for n in range(1, 21):
                writer.append(pub("v", n, "q"))
            await writer.wait_live("v", 20)  # pruning never goes past the live state
            with psycopg.connect(dsn) as conn:  # entries 1..10 are an hour old
                conn.execute(
                    "UPDATE ledger SET appended_at = now() - interval '1 hour' WHERE idx <= 10"
                )
            assert await writer.reader.prune("v", acked_index=5, retain_seconds=60) == 5
            assert await writer.reader.oldest_retained("v") == 6
            assert await writer.reader.prune("v", acked_index=15, retain_seconds=60) == 5
            assert await writer.reader.oldest_retained("v") == 11
            assert await writer.reader.prune("v", acked_index=20, retain_seconds=60) == 0
            with pytest.raises(LedgerPruned) as err:
                await writer.reader.read_range("v", 3, 10)
            assert err.value.oldest == 11
            assert [e.index for e in await writer.reader.read_range("v", 11, 3)] == [11, 12, 13]
            assert await writer.reader.prune("v", acked_index=20, retain_seconds=0) == 10
            assert await writer.reader.oldest_retained("v") == 21  # empty: the next to be written
            with pytest.raises(LedgerPruned):
                await writer.reader.read_range("v", 20, 10)
            assert await writer.reader.read_range("v", 21, 10) == []
            assert writer.append(pub("v", 21, "q")).index == 21
            await writer.wait_durable("v", 21)
            assert await writer.reader.oldest_retained("v") == 21

    run(scenario)


def test_a_reader_of_its_own_replays_and_prunes_what_a_writer_committed(
    site_a: LocalSite,
) -> None:
    """Without a writer in the process, a prune goes by what the database says
    the live state holds (and does not wait for it)."""
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            entries = [writer.append(pub("v", n, "q")) for n in range(1, 11)]
            await writer.wait_live("v", 10)
        reader = LedgerReader(dsn, pool_size=1)
        with pytest.raises(LedgerClosed):
            await reader.read_range("v", 1, 10)
        await reader.open()
        try:
            assert await reader.read_range("v", 1, 10) == entries
            assert await reader.prune("v", acked_index=5, retain_seconds=0) == 5
            assert await reader.oldest_retained("v") == 6
            with pytest.raises(VpnNotOpen):
                await reader.oldest_retained("nowhere")
        finally:
            await reader.close()

    run(scenario)
