"""A statement of ``bridge/store`` (bridge/store/_statement.py) against a
real PostgreSQL: it runs on the caller's connection, inside the caller's
transaction, and commits nothing of its own."""

from __future__ import annotations

import psycopg

from bridge.store import (
    applied_position,
    disable_replication,
    set_applied,
)
from tests.site.bridge.store.test_vpn_config import enable, one


def test_the_functions_run_in_the_callers_transaction(dsn: str) -> None:
    enable(dsn, "orders", "active")
    with psycopg.connect(dsn) as conn:
        disable_replication("orders").run(conn)
        set_applied("orders", 7, 2).run(conn)
        conn.rollback()
    assert one(dsn, "SELECT enabled FROM vpn_config WHERE name = 'orders'") == (True,)
    with psycopg.connect(dsn) as conn:
        assert applied_position("orders").run(conn) == (0, 0)
