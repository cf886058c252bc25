"""Internals, tested beside their module."""

from __future__ import annotations

import asyncio

import psycopg

from plugin.devtools import LocalSite
from tests.site.test_txn_coordinator import _scans_of_txn_log, active_site
from txn.local import (
    PRUNE_LIMIT,
    TXN_RETAIN_SECONDS,
    TxnLog,
)
from txn.local._log import _PRUNE


def test_the_prune_reaches_old_rows_through_an_index_not_a_scan_of_the_log(
    site_a: LocalSite,
) -> None:
    """The sweep runs every few minutes against a log of every transaction
    of the last hour: it must find the few rows past their retention
    through an index on ``updated_at`` (schema 0015), not read the whole
    table each time."""
    dsn = active_site(site_a)
    with psycopg.connect(dsn) as db:
        db.execute(
            "INSERT INTO txn_log (txid, vpn, side, state, events, updated_at)"
            " SELECT 'r-' || n, 'v', 'coordinator', 'ended', '', now() - n * interval '100 ms'"
            " FROM generate_series(1, 20000) AS n"
        )
        db.execute(
            "INSERT INTO txn_log (txid, vpn, side, state, events, updated_at)"
            " SELECT 'old-' || n, 'v', 'participant', 'committed', '', now() - interval '2 hours'"
            " FROM generate_series(1, 20) AS n"
        )
        db.execute("ANALYZE txn_log")
        plan = db.execute(
            "EXPLAIN (FORMAT JSON) " + _PRUNE, (TXN_RETAIN_SECONDS, PRUNE_LIMIT)
        ).fetchone()
    assert plan is not None
    scans = list(_scans_of_txn_log(plan[0][0]["Plan"]))
    assert ("Seq Scan", None) not in scans, scans
    assert any(index == "txn_log_prunable" for _, index in scans), scans

    async def scenario() -> None:
        log = TxnLog(dsn)
        await log.open()
        assert await log.prune(TXN_RETAIN_SECONDS) == 20
        await log.close()

    asyncio.run(scenario())
