"""``txn_log`` (txn/local/_log.py) in a real PostgreSQL: which rows a resync
reads as in doubt, and the prune of rows of transactions over on both
sites, bounded and through an index."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import psycopg

from bridge import VpnSettings
from plugin.devtools import LocalSite
from plugin.ops import connect, enable_vpn
from tests.site.txn.local.test_coordinator import active_site, states
from txn.local import (
    PARTICIPANT,
    PRUNE_LIMIT,
    TXN_RETAIN_SECONDS,
    Participant,
    TxnLog,
)
from txn.local._log import _PRUNE


def _scans_of_txn_log(node: dict[str, Any]) -> Iterator[tuple[str, str | None]]:
    """(node type, index name) of every node on ``txn_log`` in a plan."""
    if node.get("Relation Name") == "txn_log":
        yield node["Node Type"], node.get("Index Name")
    for child in node.get("Plans", []):
        yield from _scans_of_txn_log(child)


def test_in_doubt_reads_the_prepared_rows_of_its_vpn_only(site_a: LocalSite) -> None:
    """A standby keeps a ``committed`` participant row per transaction it
    ever applied; a resync asks which rows are in doubt, and reads only
    the prepared ones of its VPN (not every row not ended, with events)."""
    dsn = active_site(site_a)
    with connect(dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args("w", "standby"))
    rows = [(f"1.1.{i}", "v", "committed") for i in range(200)]
    rows += [("1.2.1", "v", "prepared"), ("1.2.2", "w", "prepared"), ("1.2.3", "v", "aborted")]
    with psycopg.connect(dsn) as db:
        for txid, vpn, state in rows:
            db.execute(
                "INSERT INTO txn_log (txid, vpn, side, state, events)"
                " VALUES (%s, %s, 'participant', %s, %s)",
                (txid, vpn, state, b""),
            )

    async def scenario() -> None:
        log = TxnLog(dsn)
        await log.open()
        assert sorted(r.txid for r in await log.prepared_rows(PARTICIPANT)) == ["1.2.1", "1.2.2"]
        assert await Participant(log).in_doubt("v") == ["1.2.1"]
        await log.close()

    asyncio.run(scenario())


def test_rows_of_transactions_over_on_both_sites_are_pruned_after_their_retention(
    site_a: LocalSite,
) -> None:
    """``txn_log`` does not grow with every transaction a VPN ever had: the
    sweep deletes the rows of transactions over on both sites once they
    are an hour old, and keeps what is still undecided, unacknowledged, or
    a heuristic outcome a transaction manager must still hear of."""
    dsn = active_site(site_a)
    rows = [
        ("c-ended", "coordinator", "ended", None, "2 hours"),
        ("c-aborted", "coordinator", "aborted", None, "2 hours"),
        ("p-committed", "participant", "committed", None, "2 hours"),
        ("p-aborted", "participant", "aborted", None, "2 hours"),
        ("c-committed", "coordinator", "committed", None, "2 hours"),  # not acknowledged
        ("c-prepared", "coordinator", "prepared", None, "2 hours"),
        ("p-prepared", "participant", "prepared", None, "2 hours"),
        ("p-applied", "participant", "applied", None, "2 hours"),
        ("c-heuristic", "coordinator", "ended", "rollback", "2 hours"),
        ("c-recent", "coordinator", "ended", None, "10 minutes"),
    ]
    with psycopg.connect(dsn) as db:
        for txid, side, state, heuristic, age in rows:
            db.execute(
                "INSERT INTO txn_log (txid, vpn, side, state, events, heuristic, updated_at)"
                " VALUES (%s, 'v', %s, %s, %s, %s, now() - %s::interval)",
                (txid, side, state, b"", heuristic, age),
            )

    async def scenario() -> None:
        log = TxnLog(dsn)
        await log.open()
        assert await log.prune(TXN_RETAIN_SECONDS, limit=3) == 3  # a bounded statement
        assert await log.prune(TXN_RETAIN_SECONDS) == 1
        assert await log.prune(TXN_RETAIN_SECONDS) == 0
        await log.close()

    asyncio.run(scenario())
    assert sorted(states(dsn)) == [
        "c-committed",
        "c-heuristic",
        "c-prepared",
        "c-recent",
        "p-applied",
        "p-prepared",
    ]


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
