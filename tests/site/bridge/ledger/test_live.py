"""The active's live state (bridge/ledger/_live.py) kept in step with the ledger
its writer commits, against a real PostgreSQL, including crashes between
the two."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from bridge import Event
from bridge.ledger import LedgerWriter, apply_entries_async
from plugin.devtools import LocalSite
from tests.site.bridge.ledger.test_writer import (
    Durable,
    _until_blocked,
    ack,
    live_keys,
    prepare,
    pub,
    run,
    scalar,
)


async def _hold_live_state(dsn: str, vpn: str) -> psycopg.AsyncConnection[Any]:
    """A transaction holding ``vpn``'s vpn_live_state row: the live apply
    blocks, the ledger commit does not."""
    blocker = await psycopg.AsyncConnection.connect(dsn)
    await blocker.execute(
        "INSERT INTO vpn_live_state (vpn) VALUES (%s) ON CONFLICT DO NOTHING", (vpn,)
    )
    await blocker.commit()
    await blocker.execute("SELECT 1 FROM vpn_live_state WHERE vpn = %s FOR UPDATE", (vpn,))
    return blocker


def test_the_active_applies_its_own_entries_to_live_message(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            events: list[Event] = [pub("v", 1, "q1", "q2"), pub("v", 2, "q1"), ack("v", 1, "q2")]
            for event in events:
                last = writer.append(event)
            writer.append(ack("v", 99, "q1"))  # never published through us
            await writer.wait_durable("v", last.index + 1)

    run(scenario)
    assert live_keys(dsn, "v") == {("q1", 1), ("q1", 2)}
    assert scalar(dsn, "SELECT unknown_acks FROM vpn_state WHERE vpn = 'v'") == 1


def test_confirms_wait_for_the_ledger_commit_not_for_the_live_state(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")
    durable = Durable()

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            blocker = await _hold_live_state(dsn, "v")
            for n in range(1, 6):
                writer.append(pub("v", n, "q"), durable.cb(n))
            await writer.wait_durable("v", 5)
            assert durable.calls == [(n, True) for n in range(1, 6)]
            await _until_blocked(dsn)  # the live state's apply waits for the blocker
            assert writer.live_index("v") == 0
            assert live_keys(dsn, "v") == set()
            await blocker.rollback()
            await blocker.close()
            await writer.wait_live("v", 5)
            assert live_keys(dsn, "v") == {("q", n) for n in range(1, 6)}

    run(scenario)
    assert scalar(dsn, "SELECT live_index FROM vpn_live_state WHERE vpn = 'v'") == 5


def test_a_crash_between_ledger_commit_and_live_apply_is_caught_up_at_start(
    site_a: LocalSite,
) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active", w="active")
    events: list[Event] = [pub("v", n, "q1", "q2") for n in range(1, 31)]
    events += [ack("v", n, "q1") for n in range(1, 31, 2)]
    events += [ack("v", 99, "q1")]  # an unknown ACK: counted once, not once per attempt

    async def scenario() -> None:
        async with LedgerWriter(dsn, apply_batch_size=7) as first:
            for n in range(1, 4):  # w's live state is applied, v's is stuck
                first.append(pub("w", n, "q"))
            await first.wait_live("w", 3)
            blocker = await _hold_live_state(dsn, "v")
            for event in events:
                last = first.append(event)
            await first.wait_durable("v", last.index)
            await first.close(grace=0.2)  # the applier is still blocked: cancelled
            await blocker.rollback()
            await blocker.close()
        assert live_keys(dsn, "v") == set()
        assert scalar(dsn, "SELECT live_index FROM vpn_live_state WHERE vpn = 'v'") == 0
        async with LedgerWriter(dsn, apply_batch_size=7) as second:
            assert second.live_index("v") == second.durable_index("v") == last.index
            assert second.live_index("w") == 3
            entry = second.append(ack("v", 2, "q2"))
            await second.wait_live("v", entry.index)

    run(scenario)
    expected = {(q, n) for n in range(1, 31) for q in ("q1", "q2")}
    expected -= {("q1", n) for n in range(1, 31, 2)} | {("q2", 2)}
    assert live_keys(dsn, "v") == expected
    assert scalar(dsn, "SELECT unknown_acks FROM vpn_state WHERE vpn = 'v'") == 1
    assert scalar(dsn, "SELECT live_index FROM vpn_live_state WHERE vpn = 'v'") == len(events) + 1
    with psycopg.connect(dsn) as conn:
        w_rows = conn.execute("SELECT count(*) FROM live_message WHERE vpn = 'w'").fetchone()
    assert w_rows == (3,)


def test_a_live_apply_whose_reply_was_lost_is_not_applied_twice(site_a: LocalSite) -> None:
    """What the next apply attempt sees when its COMMIT went through but the
    reply was lost: live_index already covers the batch's first entries."""
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            blocker = await _hold_live_state(dsn, "v")
            entries = [writer.append(pub("v", n, "q")) for n in range(1, 4)]
            entries.append(writer.append(ack("v", 1, "q")))
            await writer.wait_durable("v", 4)
            await asyncio.sleep(0.1)  # the applier now waits for the row lock
            # as if a previous attempt had applied 1..4 and committed: the
            # ack must not be applied again (it would count an unknown ACK)
            await apply_entries_async(blocker, "v", entries)
            await blocker.execute("UPDATE vpn_live_state SET live_index = 4 WHERE vpn = 'v'")
            await blocker.commit()
            await blocker.close()
            last = writer.append(pub("v", 5, "q"))
            await writer.wait_live("v", last.index)

    run(scenario)
    assert live_keys(dsn, "v") == {("q", 2), ("q", 3), ("q", 5)}
    assert scalar(dsn, "SELECT unknown_acks FROM vpn_state WHERE vpn = 'v'") == 0


def test_live_applies_lost_with_a_database_crash_are_applied_again_from_the_ledger(
    site_a: LocalSite,
) -> None:
    """Live-state applies commit with synchronous_commit off, so a database
    crash can lose the newest ones (rows and live_index together). The next
    apply must find the gap and re-apply those entries from the ledger, not
    stop the writer."""
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            for n in range(1, 21):
                writer.append(pub("v", n, "q"))
            await writer.wait_durable("v", 20)
            await writer.wait_live("v", 20)
            # what a crash losing the applies of entries 11..20 leaves behind
            with psycopg.connect(dsn, autocommit=True) as db:
                db.execute("UPDATE vpn_live_state SET live_index = 10 WHERE vpn = 'v'")
                db.execute("DELETE FROM live_message WHERE vpn = 'v' AND publish_index > 10")
            for n in range(21, 26):
                writer.append(pub("v", n, "q"))
            await writer.wait_live("v", 25)
            assert writer.store_error is None

    run(scenario)
    assert live_keys(dsn, "v") == {("q", n) for n in range(1, 26)}
    assert scalar(dsn, "SELECT live_index FROM vpn_live_state WHERE vpn = 'v'") == 25
