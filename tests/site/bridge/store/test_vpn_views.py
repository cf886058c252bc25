"""The reads that join a VPN's rows (bridge/store/_vpn_views.py) against a
real PostgreSQL: what ``status`` shows, and which VPNs the active lists
and the node loads."""

from __future__ import annotations

import psycopg

from bridge import Role
from bridge.store import (
    active_vpns,
    disable_replication,
    enabled_vpns,
    set_applied,
    vpn_status_rows,
)
from tests.site.bridge.store.test_vpn_config import enable, on_loop


def test_status_rows_carry_progress_and_transactions(dsn: str) -> None:
    enable(dsn, "orders", "active", topics=("amq.topic:orders.#",))
    enable(dsn, "audit", "standby")
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE vpn_state SET ledger_index = 9 WHERE vpn = 'orders'")
        set_applied("orders", 4, 1).run(conn)
        conn.execute(
            "INSERT INTO txn_log (txid, vpn, side, state, events)"
            " VALUES ('t1', 'orders', 'coordinator', 'prepared', '')"
        )
    with psycopg.connect(dsn) as conn:
        audit, orders = vpn_status_rows().run(conn)
    assert (audit.name, audit.role, orders.name, orders.role) == (
        "audit",
        Role.STANDBY,
        "orders",
        Role.ACTIVE,
    )
    assert (orders.ledger_index, orders.applied_index, orders.in_doubt_txns) == (9, 4, 1)
    assert orders.topic_filters == ["amq.topic:orders.#"]
    assert orders.since_applied >= 0.0 and orders.degraded_txns == 0


def test_the_active_listing_leaves_out_fenced_promoting_and_standby_vpns(dsn: str) -> None:
    served = enable(dsn, "orders", "active", mode="sync", topics=("amq.topic:orders.#",))
    for name in ("fenced", "promoting", "disabled"):
        enable(dsn, name, "active")
    enable(dsn, "mirror", "standby")
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE vpn_config SET epoch = 2 WHERE name = 'orders'")
        conn.execute(
            "INSERT INTO vpn_epoch (vpn, epoch, site, taken_over_at) VALUES ('orders', 2, 'a', 5)"
        )
        conn.execute("UPDATE vpn_state SET fenced = true WHERE vpn = 'fenced'")
        conn.execute("INSERT INTO promotion (vpn, epoch, state) VALUES ('promoting', 1, 'running')")
        disable_replication("disabled").run(conn)
    listed = on_loop(dsn, active_vpns().run_async)
    assert [(v.settings, v.epoch, v.taken_over_at) for v in listed] == [(served, 2, 5)]

    enabled = on_loop(dsn, enabled_vpns().run_async)
    assert [v.settings.name for v in enabled] == ["fenced", "mirror", "orders", "promoting"]
    by_name = {v.settings.name: v for v in enabled}
    assert by_name["fenced"].fenced and not by_name["orders"].fenced
    assert by_name["promoting"].promotion == "running"
    assert by_name["mirror"].promotion is None and by_name["mirror"].newest_epoch is None
    assert (by_name["orders"].newest_epoch, by_name["orders"].newest_site) == (2, "a")
