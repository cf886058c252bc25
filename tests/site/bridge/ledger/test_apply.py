"""Internals, tested beside their module."""

from __future__ import annotations

import psycopg

from bridge.ledger import (
    apply_entries,
    bytea_array,
    text_array,
)
from bridge.ledger._apply import _DELETE
from plugin.devtools import LocalSite
from tests.two_sites.test_standby_apply import _scans, numbered, prepare, pub, rid


def test_acks_find_their_rows_by_primary_key_without_statistics(site_b: LocalSite) -> None:
    """A queue whose consumers keep up is empty when autovacuum analyses it;
    when a backlog builds up later, each ack must still be one primary-key
    probe, not a read of the whole queue (what PostgreSQL chose while a
    second index on ``(vpn, queue, ...)`` existed: 0.5-1 s per 500 acks of a
    10,000-message queue)."""
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE live_message")  # the statistics of an empty table
        conn.autocommit = False
        apply_entries(conn, "v", numbered([pub("v", n, "q") for n in range(1, 2001)]))
        conn.commit()
        ids = bytea_array([rid(n).value for n in range(1, 501)])
        plan = conn.execute(
            "EXPLAIN (FORMAT JSON) " + _DELETE, ("v", text_array(["q"] * 500), ids)
        ).fetchone()
    assert plan is not None
    lookups = [index for node, index in _scans(plan[0][0]["Plan"]) if "Index" in node]
    # one probe per acknowledged key, through the primary key only (the row
    # removal itself may scan the table once per batch while the statistics
    # say it is empty; autovacuum's next analysis ends that)
    assert lookups == ["live_message_pkey"], lookups
