"""Internals, tested beside their module."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from plugin.devtools import LocalSite
from tests.two_sites.test_standby_apply import prepare


@pytest.mark.parametrize("gate", ["take-prepared", "skip-early"])
def test_a_gate_waiting_on_a_promotion_reads_the_role_it_left(site_b: LocalSite, gate: str) -> None:
    """The one-statement paths (a transaction committed early, the stream's
    copy of one skipped) gate on the VPN being standby here. One that waits
    for a promotion's locks must then see it active and decline: with only
    the state row locked, PostgreSQL re-read that row after the wait but
    kept the role of its first snapshot, 'standby'."""
    import threading

    from bridge.standby._early import _SKIP_EARLY_BATCH, _TAKE_GUARD
    from bridge.store import become_active, lock_for_promotion
    from tests.fix_sites import until_a_lock_waits

    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    if gate == "take-prepared":
        sql = _TAKE_GUARD + "SELECT count(*) FROM gate"  # noqa: S608 - constant text
        params: tuple[Any, ...] = ("v", 0, 0, 0, 0, 0, "t1", "v")
    else:
        sql = _SKIP_EARLY_BATCH.replace("RETURNING 1", "RETURNING applied_index")
        params = ("v", 0, 1, [], 1, 1, "v")
    passed: list[Any] = []
    with psycopg.connect(dsn) as promoting:
        assert lock_for_promotion("v").run(promoting) is not None
        become_active("v", 2, 0).run(promoting)

        def apply() -> None:
            with psycopg.connect(dsn) as conn:
                row = conn.execute(sql, params).fetchone()
                passed.append(row[0] if row else 0)

        waiter = threading.Thread(target=apply)
        waiter.start()
        until_a_lock_waits(dsn, "the gate")
        promoting.commit()
    waiter.join(10)
    assert passed == [0], "the gate let an apply into a VPN already active"


def test_a_gate_takes_the_config_row_before_the_state_row(site_b: LocalSite) -> None:
    """A promotion locks the config row, then the state row; a gate that
    took them the other way round would deadlock with it."""
    import threading

    from bridge.standby._early import _TAKE_GUARD

    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    done: list[Any] = []
    with psycopg.connect(dsn) as promoting:
        promoting.execute("SELECT FROM vpn_config WHERE name = 'v' FOR UPDATE")

        def gate() -> None:
            with psycopg.connect(dsn) as conn:
                done.append(conn.execute(_TAKE_GUARD + "SELECT 1", ("v", 0, 0, 0, 0, 0, "t", "v")))

        waiter = threading.Thread(target=gate)
        waiter.start()
        waiter.join(1.0)  # waiting on the config row, holding nothing
        promoting.execute("SET lock_timeout = '5s'")
        promoting.execute("SELECT FROM vpn_state WHERE vpn = 'v' FOR UPDATE")  # free
        promoting.commit()
    waiter.join(10)
    assert done, "the gate did not finish once the promotion committed"
