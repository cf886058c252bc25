"""The active's ledger writer against a real PostgreSQL, including its death."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from bridge import Consumed, DeadLettered, Event, Published, ReplicationId, VpnSettings
from bridge._apply import apply_entries_async
from bridge._entry import LedgerEntry, decode_event, encode_event
from bridge._ledger import (
    LedgerClosed,
    LedgerPruned,
    LedgerWriter,
    UnstorableEvent,
    VpnNotOpen,
)
from plugin._localsites import LocalSite
from plugin._store import connect, enable_vpn
from sql import migrate


def prepare(dsn: str, **roles: str) -> None:
    migrate(dsn)
    with connect(dsn) as conn:
        for name, role in roles.items():
            enable_vpn(conn, VpnSettings.from_args(name, role))


def pub(vpn: str, n: int, *queues: str) -> Published:
    rid = ReplicationId.from_parts(3, n)
    return Published(vpn, rid, "ex", f"rk.{n}", b"props", n.to_bytes(4, "big") * 64, queues)


def ack(vpn: str, n: int, queue: str) -> Consumed:
    return Consumed(vpn, ReplicationId.from_parts(3, n), queue)


def stored(dsn: str, vpn: str) -> list[tuple[int, int, Event]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT idx, epoch, event FROM ledger WHERE vpn = %s ORDER BY idx", (vpn,)
        ).fetchall()
    return [(i, ep, decode_event(data, vpn)) for i, ep, data in rows]


def scalar(dsn: str, sql: str, *params: Any) -> Any:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql, params).fetchone()
    assert row is not None
    return row[0]


def live_keys(dsn: str, vpn: str) -> set[tuple[str, int]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT queue, repl_id FROM live_message WHERE vpn = %s", (vpn,)
        ).fetchall()
    return {(q, int.from_bytes(r[8:], "big")) for q, r in rows}


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 120))


class Durable:
    """Records on_durable outcomes, in call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    def cb(self, index: int) -> Callable[[bool], None]:
        return lambda ok: self.calls.append((index, ok))


# ------------------------------------------------------------- indexes and order


def test_indexes_are_dense_per_vpn_in_append_order_with_the_vpn_epoch(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, orders="active", audit="active", mirror="standby")
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE vpn_config SET epoch = 3 WHERE name = 'orders'")

    async def scenario() -> None:
        async with LedgerWriter(dsn, batch_size=100) as writer:
            events = [pub("orders" if n % 3 else "audit", n, "q") for n in range(1, 1201)]
            entries = [writer.append(e) for e in events]
            await writer.wait_durable("orders", 800)
            await writer.wait_durable("audit", 400)
            assert writer.durable_index("orders") == 800
            with pytest.raises(VpnNotOpen):
                writer.append(pub("mirror", 1, "q"))  # a standby VPN has no ledger here
        orders = [e for e in entries if e.vpn == "orders"]
        assert [e.index for e in orders] == list(range(1, 801))
        assert {e.epoch for e in orders} == {3}
        assert [e.index for e in entries if e.vpn == "audit"] == list(range(1, 401))
        assert stored(dsn, "orders") == [(e.index, 3, e.event) for e in orders]
        assert [ev for _, _, ev in stored(dsn, "audit")] == [e for e in events if e.vpn == "audit"]

    run(scenario)
    assert scalar(dsn, "SELECT ledger_index FROM vpn_state WHERE vpn = 'orders'") == 800
    assert scalar(dsn, "SELECT ledger_index FROM vpn_state WHERE vpn = 'audit'") == 400


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


def test_an_unstorable_event_is_refused_without_taking_an_index(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            with pytest.raises(UnstorableEvent):
                writer.append(pub("v", 1, "bad\x00queue"))
            with pytest.raises(UnstorableEvent):
                writer.append(
                    DeadLettered("v", ReplicationId.from_parts(3, 1), "q", ("ok", "bad\x00dlq"))
                )
            assert writer.append(pub("v", 2, "q")).index == 1

    run(scenario)


# ------------------------------------------------------------- durability


async def _hold_vpn_state(dsn: str, vpn: str) -> psycopg.AsyncConnection[Any]:
    """A transaction holding ``vpn``'s vpn_state row: the writer's commit blocks."""
    blocker = await psycopg.AsyncConnection.connect(dsn)
    await blocker.execute("SELECT 1 FROM vpn_state WHERE vpn = %s FOR UPDATE", (vpn,))
    return blocker


def test_durability_is_reported_only_after_the_commit(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")
    durable = Durable()
    seen: list[list[int]] = []

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            writer.subscribe(lambda entries: seen.append([e.index for e in entries]))
            blocker = await _hold_vpn_state(dsn, "v")
            for n in range(1, 6):
                writer.append(pub("v", n, "q"), durable.cb(n))
            await asyncio.sleep(0.3)
            assert durable.calls == [] and seen == []
            assert writer.durable_index("v") == 0
            assert scalar(dsn, "SELECT count(*) FROM ledger") == 0
            await blocker.commit()
            await blocker.close()
            await writer.wait_durable("v", 5)
            assert durable.calls == [(n, True) for n in range(1, 6)]
            assert scalar(dsn, "SELECT count(*) FROM ledger") == 5

    run(scenario)
    assert seen == [[1, 2, 3, 4, 5]]


def test_group_commit_batches_by_size_and_by_time(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")

    async def scenario() -> None:
        # max_delay is long enough that a loaded machine's slow sleeps still
        # fit the trickle below into one window
        async with LedgerWriter(dsn, batch_size=500, max_delay=0.5) as writer:
            for n in range(1, 2001):  # no await in between: all pending at once
                writer.append(pub("v", n, "q"))
            await writer.wait_durable("v", 2000)
            assert (writer.stats.batches, writer.stats.entries) == (4, 2000)
            # a trickle within max_delay of the first pending entry is one commit
            t0 = time.monotonic()
            for n in range(2001, 2011):
                writer.append(pub("v", n, "q"))
                await asyncio.sleep(0.001)
            await writer.wait_durable("v", 2010)
            assert time.monotonic() - t0 >= 0.45
            assert writer.stats.batches == 5

    run(scenario)
    # now() is the transaction's start: one distinct appended_at per transaction
    assert scalar(dsn, "SELECT count(DISTINCT appended_at) FROM ledger") == 5
    assert scalar(dsn, "SELECT count(*) FROM ledger") == 2010


def test_backpressure_holds_until_entries_are_durable(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")

    async def scenario() -> None:
        async with LedgerWriter(dsn, batch_size=10, max_pending=10) as writer:
            blocker = await _hold_vpn_state(dsn, "v")
            for n in range(1, 11):
                writer.append(pub("v", n, "q"))
            assert not writer.full()
            writer.append(pub("v", 11, "q"))
            assert writer.full()
            room = asyncio.create_task(writer.wait_for_room())
            await asyncio.sleep(0.2)
            assert not room.done()
            await blocker.commit()
            await blocker.close()
            await asyncio.wait_for(room, 10)
            # room came from the first batch turning durable; by the time this
            # task runs, the second batch may already be durable too and hold
            # the writer full until the live-state apply drains it, so "not
            # full right now" is a race, not the behaviour
            assert writer.durable_index("v") >= 10
            await writer.wait_durable("v", 11)
            await asyncio.wait_for(writer.wait_for_room(), 10)
            assert not writer.full()

    run(scenario)


# ------------------------------------------------------------- restart


def test_a_new_writer_continues_after_the_last_durable_index(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")
    durable = Durable()

    async def scenario() -> None:
        async with LedgerWriter(dsn) as first:
            for n in range(1, 11):
                first.append(pub("v", n, "q"))
            await first.wait_durable("v", 10)
            # handed out but never committed: the writer goes away while blocked
            blocker = await _hold_vpn_state(dsn, "v")
            for n in range(11, 14):
                first.append(pub("v", n, "q"), durable.cb(n))
            await first.close(grace=0.2)
            await blocker.rollback()
            await blocker.close()
            with pytest.raises(LedgerClosed):
                first.append(pub("v", 14, "q"))
            with pytest.raises(LedgerClosed):
                await first.wait_durable("v", 11)
        assert durable.calls == [(11, False), (12, False), (13, False)]
        async with LedgerWriter(dsn) as second:
            entry = second.append(pub("v", 11, "q"))
            assert entry.index == 11
            await second.wait_durable("v", 11)

    run(scenario)
    assert [i for i, _, _ in stored(dsn, "v")] == list(range(1, 12))


def test_a_vpn_enabled_after_start_is_opened_explicitly(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn)

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            with pytest.raises(VpnNotOpen):
                writer.append(pub("late", 1, "q"))
            prepare(dsn, late="active")
            await writer.open_vpn("late")
            await writer.wait_durable("late", writer.append(pub("late", 1, "q")).index)
            with pytest.raises(VpnNotOpen):
                await writer.open_vpn("never")

    run(scenario)


def test_a_commit_whose_reply_was_lost_is_not_written_twice(site_a: LocalSite) -> None:
    """What the next attempt sees when COMMIT went through but its reply was
    lost: the ledger already holds the batch's first entries, byte for byte."""
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")
    durable = Durable()

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            blocker = await _hold_vpn_state(dsn, "v")
            entries = [writer.append(pub("v", n, "q"), durable.cb(n)) for n in range(1, 6)]
            await asyncio.sleep(0.1)  # the writer now waits for the row lock
            await _commit_in(blocker, entries[:3])
            await writer.wait_durable("v", 5)
        assert durable.calls == [(n, True) for n in range(1, 6)]

    run(scenario)
    assert [i for i, _, _ in stored(dsn, "v")] == [1, 2, 3, 4, 5]
    assert live_keys(dsn, "v") == {("q", n) for n in range(1, 6)}


async def _commit_in(blocker: psycopg.AsyncConnection[Any], entries: list[LedgerEntry]) -> None:
    """Commit ``entries`` to the ledger as the writer would have, in the
    blocker's transaction (the live state is applied in a later one)."""
    for e in entries:
        await blocker.execute(
            "INSERT INTO ledger (vpn, idx, epoch, kind, event) VALUES (%s, %s, %s, %s, %s)",
            (e.vpn, e.index, e.epoch, e.kind, encode_event(e.event)),
        )
    await blocker.execute(
        "UPDATE vpn_state SET ledger_index = %s WHERE vpn = %s", (entries[-1].index, entries[0].vpn)
    )
    await blocker.commit()
    await blocker.close()


def test_a_second_writer_stops_the_first_and_nothing_is_confirmed(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")
    durable = Durable()

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            blocker = await _hold_vpn_state(dsn, "v")
            entries = [writer.append(pub("v", n, "q"), durable.cb(n)) for n in range(1, 4)]
            await asyncio.sleep(0.1)
            other = [LedgerEntry("v", 1, e.index, pub("v", 100 + e.index, "q")) for e in entries]
            await _commit_in(blocker, other[:2])
            with pytest.raises(LedgerClosed):
                await writer.wait_durable("v", 3)
            with pytest.raises(LedgerClosed, match="not ours"):
                writer.append(pub("v", 4, "q"))
        assert durable.calls == [(1, False), (2, False), (3, False)]

    run(scenario)
    assert [ev for _, _, ev in stored(dsn, "v")] == [pub("v", 101, "q"), pub("v", 102, "q")]


def test_append_many_takes_a_group_with_one_callback_all_or_none(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")
    durable = Durable()

    async def scenario() -> None:
        async with LedgerWriter(dsn, batch_size=2) as writer:  # the group spans commits
            writer.append(pub("v", 1, "q"))
            last = writer.append_many([pub("v", n, "q") for n in range(2, 7)], durable.cb(6))
            assert last.index == 6
            with pytest.raises(UnstorableEvent):  # refused before any takes an index
                writer.append_many([pub("v", 7, "q"), pub("v", 8, "bad\x00q")])
            with pytest.raises(ValueError):
                writer.append_many([pub("v", 9, "q"), pub("w", 9, "q")])
            assert writer.append(ack("v", 2, "q")).index == 7
            await writer.wait_durable("v", 7)
            assert durable.calls == [(6, True)]

    run(scenario)
    assert [i for i, _, _ in stored(dsn, "v")] == list(range(1, 8))


# ------------------------------------------------------------- the live state


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
            await asyncio.sleep(0.2)
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


# ------------------------------------------------------------- replay and retention


def test_read_range_replays_committed_entries(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            entries = [writer.append(pub("v", n, "q")) for n in range(1, 51)]
            await writer.wait_durable("v", 50)
            assert await writer.read_range("v", 1, 20) == entries[:20]
            assert await writer.read_range("v", 41, 100) == entries[40:]
            assert await writer.read_range("v", 51, 10) == []
            assert await writer.oldest_retained("v") == 1
            with pytest.raises(ValueError):
                await writer.read_range("v", 0, 10)

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
            assert await writer.prune("v", acked_index=5, retain_seconds=60) == 5
            assert await writer.oldest_retained("v") == 6
            assert await writer.prune("v", acked_index=15, retain_seconds=60) == 5
            assert await writer.oldest_retained("v") == 11
            assert await writer.prune("v", acked_index=20, retain_seconds=60) == 0
            with pytest.raises(LedgerPruned) as err:
                await writer.read_range("v", 3, 10)
            assert err.value.oldest == 11
            assert [e.index for e in await writer.read_range("v", 11, 3)] == [11, 12, 13]
            assert await writer.prune("v", acked_index=20, retain_seconds=0) == 10
            assert await writer.oldest_retained("v") == 21  # empty: the next to be written
            with pytest.raises(LedgerPruned):
                await writer.read_range("v", 20, 10)
            assert await writer.read_range("v", 21, 10) == []
            assert writer.append(pub("v", 21, "q")).index == 21
            await writer.wait_durable("v", 21)
            assert await writer.oldest_retained("v") == 21

    run(scenario)


# ------------------------------------------------------------- the database dies


def test_entries_appended_while_the_database_is_down_become_durable_once(
    site_a: LocalSite,
) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")
    durable = Durable()
    total = 3000
    events = [pub("v", n, "q") if n % 4 else ack("v", n - 1, "q") for n in range(1, total + 1)]

    async def scenario() -> None:
        async with LedgerWriter(dsn, batch_size=200, max_backoff=0.5) as writer:
            killed, restarted = asyncio.Event(), asyncio.Event()
            during_outage: list[int] = []

            async def appender() -> None:
                for n, event in enumerate(events, start=1):
                    if n == total // 3:
                        await asyncio.to_thread(site_a.pg.kill)
                        killed.set()
                    if n == 2 * total // 3:
                        restart = asyncio.create_task(asyncio.to_thread(site_a.pg.start))
                        restart.add_done_callback(lambda _: restarted.set())
                    await writer.wait_for_room()
                    entry = writer.append(event, durable.cb(n))
                    if killed.is_set() and not restarted.is_set():
                        during_outage.append(entry.index)
                    if n % 50 == 0:
                        await asyncio.sleep(0.005)

            await appender()
            await restarted.wait()
            await writer.wait_durable("v", total)
            assert writer.stats.failed_attempts > 0
            assert writer.store_error is None
            assert len(during_outage) > 500

    run(scenario)
    assert durable.calls == [(n, True) for n in range(1, total + 1)]
    assert [(i, ev) for i, _, ev in stored(dsn, "v")] == list(enumerate(events, start=1))
    assert scalar(dsn, "SELECT ledger_index FROM vpn_state WHERE vpn = 'v'") == total
    published = {n for n in range(1, total + 1) if n % 4}
    consumed = {n - 1 for n in range(1, total + 1) if not n % 4}
    assert live_keys(dsn, "v") == {("q", n) for n in published - consumed}
    assert scalar(dsn, "SELECT unknown_acks FROM vpn_state WHERE vpn = 'v'") == 0


def test_a_group_commits_in_one_transaction_whatever_the_batch_size(site_a: LocalSite) -> None:
    """append_group (a local transaction's decision) is all or nothing: with
    batches of two entries, a group of five still commits in one transaction
    (one subscriber call), and the batches around it keep their size."""
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")
    seen: list[list[int]] = []
    group_done = Durable()

    async def scenario() -> None:
        async with LedgerWriter(dsn, batch_size=2, max_pending=100) as writer:
            writer.subscribe(lambda entries: seen.append([e.index for e in entries]))
            writer.append(pub("v", 1, "q"))
            last = writer.append_group([pub("v", n, "q") for n in range(2, 7)], group_done.cb(6))
            assert last == 6
            writer.append(pub("v", 7, "q"))
            writer.append(pub("v", 8, "q"))
            await writer.wait_durable("v", 8)

    run(scenario)
    group = set(range(2, 7))
    assert any(group <= set(batch) for batch in seen)  # one commit holds the whole group
    assert all(group <= set(batch) or not group & set(batch) for batch in seen)
    assert group_done.calls == [(6, True)]


def test_a_groups_decision_moves_its_txn_row_in_the_same_commit(site_a: LocalSite) -> None:
    """append_group(decision=txid) moves the transaction's coordinator row
    prepared -> committed (with the group's last index) in the transaction
    that stores the group: still prepared while the group is not durable,
    committed once it is — also when the group went in through the checked
    path (an earlier attempt's reply lost) — and a row already decided
    otherwise is left alone."""
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")
    with psycopg.connect(dsn, autocommit=True) as db:
        for txid, state in (("t-1", "prepared"), ("t-2", "prepared"), ("t-3", "aborted")):
            db.execute(
                "INSERT INTO txn_log (txid, vpn, side, state, events)"
                " VALUES (%s, 'v', 'coordinator', %s, '')",
                (txid, state),
            )

    def row(txid: str) -> tuple[str, int | None]:
        with psycopg.connect(dsn) as db:
            found = db.execute(
                "SELECT state, ledger_last FROM txn_log WHERE txid = %s", (txid,)
            ).fetchone()
        assert found is not None
        return found[0], found[1]

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            blocker = await _hold_vpn_state(dsn, "v")
            writer.append(pub("v", 1, "q"))
            first = writer.append_group([pub("v", n, "q") for n in (2, 3)], decision="t-1")
            await asyncio.sleep(0.1)  # the writer waits for the row lock
            assert row("t-1") == ("prepared", 0)
            await blocker.rollback()
            await blocker.close()
            await writer.wait_durable("v", first)
            assert row("t-1") == ("committed", 3)
            # the checked path: the group's entries are stored already
            blocker = await _hold_vpn_state(dsn, "v")
            second = writer.append_group([pub("v", n, "q") for n in (4, 5)], decision="t-2")
            entries = [LedgerEntry("v", 1, n, pub("v", n, "q")) for n in (4, 5)]
            await asyncio.sleep(0.1)
            await _commit_in(blocker, entries)
            await writer.wait_durable("v", second)
            assert row("t-2") == ("committed", 5)
            third = writer.append_group([pub("v", 6, "q")], decision="t-3")
            await writer.wait_durable("v", third)

    run(scenario)
    assert row("t-3") == ("aborted", 0)
    assert [i for i, _, _ in stored(dsn, "v")] == [1, 2, 3, 4, 5, 6]


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
