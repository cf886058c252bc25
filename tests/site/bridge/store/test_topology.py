"""A standby's stored definitions (bridge/store/_topology.py) against a
real PostgreSQL: the apply step keeps streamed topology changes, a listing
forgets those at or below its index (never a newer listing for an older
one), and what a promotion imports is the listing with the rest applied."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from bridge import LedgerEntry, TopologyChanged, name_item, queue_item
from bridge.ledger import apply_entries
from bridge.store import keep_definitions, stored_topology
from tests.site.bridge.store.test_vpn_config import enable, on_loop

VPN = "orders"


def declare(name: str) -> TopologyChanged:
    return TopologyChanged(
        VPN, "queue.declare", queue_item(name, {}, durable=True, auto_delete=False)
    )


def apply(dsn: str, changes: list[tuple[int, TopologyChanged]], keep: bool = True) -> None:
    with psycopg.connect(dsn) as conn:
        apply_entries(
            conn, VPN, [LedgerEntry(VPN, 1, i, e) for i, e in changes], keep_topology=keep
        )


def queues(doc: bytes | None) -> list[str]:
    assert doc is not None
    return [q["name"] for q in json.loads(doc)["queues"]]


def keep(dsn: str, listing: dict[str, Any], index: int | None) -> Any:
    async def work(conn: psycopg.AsyncConnection[Any]) -> Any:
        return await keep_definitions(VPN, json.dumps(listing).encode(), index).run_async(conn)

    return on_loop(dsn, work)


def test_a_standby_keeps_changes_until_a_listing_after_them(dsn: str) -> None:
    enable(dsn, VPN, "standby")
    with psycopg.connect(dsn) as conn:
        assert stored_topology(VPN).run(conn).merged() is None  # nothing yet
    apply(dsn, [(1, declare("q1")), (2, declare("q2")), (2, declare("q2"))])  # a replay
    with psycopg.connect(dsn) as conn:
        stored = stored_topology(VPN).run(conn)
    assert stored.listing is None and [c.op for c in stored.changes] == ["queue.declare"] * 2
    assert queues(stored.merged()) == ["q1", "q2"]

    # a listing read at index 1 shows q1: q1's change is forgotten, q2's kept
    superseded = keep(dsn, {"queues": [json.loads(declare("q1").item)], "users": []}, 1)
    assert superseded == (declare("q1"),)
    apply(dsn, [(3, TopologyChanged(VPN, "queue.delete", name_item("q1")))])
    with psycopg.connect(dsn) as conn:
        stored = stored_topology(VPN).run(conn)
    assert stored.index == 1 and [c.op for c in stored.changes] == ["queue.declare", "queue.delete"]
    assert queues(stored.merged()) == ["q2"]
    assert json.loads(stored.merged() or b"")["users"] == []  # the rest of the listing stays

    # an older listing (a slow answer) does not replace the newer one
    assert keep(dsn, {"queues": []}, 0) is None
    with psycopg.connect(dsn) as conn:
        assert stored_topology(VPN).run(conn).index == 1
    # a listing of a protocol-5 active (no index) replaces it, and every change
    keep(dsn, {"queues": []}, None)
    with psycopg.connect(dsn) as conn:
        stored = stored_topology(VPN).run(conn)
    assert stored.index is None and stored.changes == () and queues(stored.merged()) == []


def test_the_active_does_not_keep_its_own_topology_changes(dsn: str) -> None:
    enable(dsn, VPN, "active")
    apply(dsn, [(1, declare("q1"))], keep=False)
    with psycopg.connect(dsn) as conn:
        assert stored_topology(VPN).run(conn).changes == ()


def test_an_unreadable_stored_change_is_a_clear_error(dsn: str) -> None:
    enable(dsn, VPN, "standby")
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO topology_change (vpn, ledger_index, event) VALUES (%s, 1, %s)",
            (VPN, b"T\x09"),
        )
    with psycopg.connect(dsn) as conn, pytest.raises(Exception, match="topology change 1"):
        stored_topology(VPN).run(conn)
