"""The active's ledger writer against a real PostgreSQL, including its death."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from bridge import (
    Consumed,
    DeadLettered,
    Event,
    LedgerEntry,
    Published,
    ReplicationId,
    VpnSettings,
    decode_event,
    encode_event,
)
from bridge.ledger import LedgerClosed, LedgerWriter, UnstorableEvent, VpnNotOpen
from bridge.store import SITE, Fence, take_lease
from plugin.devtools import LocalSite
from plugin.ops import connect, enable_vpn
from sql import migrate
from tests.fix_sites import until_a_lock_waits


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


async def _until_blocked(dsn: str) -> None:
    """Wait until a session of the database waits for a lock (the writer
    behind a blocker): what a test then sees not happening is held back."""

    await asyncio.to_thread(until_a_lock_waits, dsn, "the writer")


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
            await _until_blocked(dsn)
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


def test_a_confirm_the_store_does_not_answer_in_time_is_a_nack_and_its_entry_still_commits(
    site_a: LocalSite,
) -> None:
    """A black-holed or stuck store holds no client forever: past the
    answer timeout its confirm is a nack (never a confirm: the entry is
    not durable yet); the entry commits once the store answers, with no
    second answer. A transaction's group is not the client's to nack."""
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")
    durable = Durable()

    async def scenario() -> None:
        async with LedgerWriter(dsn, answer_timeout=1.0) as writer:
            blocker = await _hold_vpn_state(dsn, "v")
            writer.append(pub("v", 1, "q"), durable.cb(1))
            writer.append_many([pub("v", 2, "q"), pub("v", 3, "q")], durable.cb(3))
            writer.append_group([pub("v", 4, "q")], durable.cb(4))
            await _until_blocked(dsn)
            await asyncio.sleep(2.5)  # the watchdog looks once a second
            assert durable.calls == [(1, False), (3, False)]
            assert writer.stats.answered_late == 2
            await blocker.commit()
            await blocker.close()
            await writer.wait_durable("v", 4)
            assert durable.calls == [(1, False), (3, False), (4, True)]
            assert scalar(dsn, "SELECT count(*) FROM ledger") == 4

    run(scenario)


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
            await _until_blocked(dsn)
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


# ------------------------------------------------------------- forgetting a VPN


async def _hold_vpn_live_state(dsn: str, vpn: str) -> psycopg.AsyncConnection[Any]:
    """A transaction holding ``vpn``'s vpn_live_state row: the live-state
    apply blocks (the ledger commits go on)."""
    blocker = await psycopg.AsyncConnection.connect(dsn)
    await blocker.execute("SELECT 1 FROM vpn_live_state WHERE vpn = %s FOR UPDATE", (vpn,))
    return blocker


async def _until_scalar(dsn: str, sql: str, want: Any) -> None:
    deadline = time.monotonic() + 10.0
    while await asyncio.to_thread(scalar, dsn, sql) != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"{sql} never gave {want!r}")
        await asyncio.sleep(0.02)


def test_forgetting_a_vpn_whose_entries_wait_for_their_commit_loses_nothing(
    site_a: LocalSite,
) -> None:
    """A demotion forgets the VPN while entries of it still wait for their
    commit: they still become durable, their callbacks fire and the writer
    goes on; an open_vpn meanwhile waits for them and continues after."""
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active", w="active")
    durable = Durable()

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            blocker = await _hold_vpn_state(dsn, "v")
            for n in range(1, 6):
                writer.append(pub("v", n, "q"), durable.cb(n))
            await _until_blocked(dsn)
            writer.forget_vpn("v")
            with pytest.raises(VpnNotOpen):
                writer.append(pub("v", 6, "q"))
            await blocker.commit()
            await blocker.close()
            await writer.wait_durable("v", 5)  # a waiter of a forgotten VPN still hears
            assert durable.calls == [(n, True) for n in range(1, 6)]
            await writer.wait_durable("w", writer.append(pub("w", 1, "q")).index)
            # forgotten again with entries in flight: open_vpn waits for them
            await writer.open_vpn("v")
            blocker = await _hold_vpn_state(dsn, "v")
            writer.append(pub("v", 6, "q"), durable.cb(6))
            await _until_blocked(dsn)
            writer.forget_vpn("v")
            reopened = asyncio.create_task(writer.open_vpn("v"))
            await asyncio.sleep(0.1)
            assert not reopened.done()  # its indexes continue after the one in flight
            await blocker.commit()
            await blocker.close()
            await asyncio.wait_for(reopened, 10)
            assert writer.append(pub("v", 7, "q")).index == 7
            await writer.wait_live("v", 7)
        assert durable.calls == [(n, True) for n in range(1, 7)]

    run(scenario)
    assert [i for i, _, _ in stored(dsn, "v")] == list(range(1, 8))
    assert live_keys(dsn, "v") == {("q", n) for n in range(1, 8)}


def test_forgetting_a_vpn_whose_entries_wait_for_their_live_apply_loses_nothing(
    site_a: LocalSite,
) -> None:
    """Entries durable but not yet applied to the live state when their VPN
    is forgotten are applied, and the writer goes on."""
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active", w="active")
    durable = Durable()

    async def scenario() -> None:
        async with LedgerWriter(dsn, apply_delay=0) as writer:
            blocker = await _hold_vpn_live_state(dsn, "v")
            for n in range(1, 6):
                writer.append(pub("v", n, "q"), durable.cb(n))
            await writer.wait_durable("v", 5)
            await _until_blocked(dsn)
            writer.forget_vpn("v")
            await blocker.commit()
            await blocker.close()
            await _until_scalar(dsn, "SELECT live_index FROM vpn_live_state WHERE vpn = 'v'", 5)
            await writer.wait_durable("w", writer.append(pub("w", 1, "q")).index)
            await writer.wait_live("w", 1)
            await writer.open_vpn("v")
            assert writer.append(pub("v", 6, "q")).index == 6
            await writer.wait_live("v", 6)
        assert durable.calls == [(n, True) for n in range(1, 6)]

    run(scenario)
    assert live_keys(dsn, "v") == {("q", n) for n in range(1, 7)}
    assert live_keys(dsn, "w") == {("q", 1)}


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
            await _until_blocked(dsn)
            other = [LedgerEntry("v", 1, e.index, pub("v", 100 + e.index, "q")) for e in entries]
            await _commit_in(blocker, other[:2])
            with pytest.raises(LedgerClosed):
                await writer.wait_durable("v", 3)
            with pytest.raises(LedgerClosed, match="not ours"):
                writer.append(pub("v", 4, "q"))
        assert durable.calls == [(1, False), (2, False), (3, False)]

    run(scenario)
    assert [ev for _, _, ev in stored(dsn, "v")] == [pub("v", 101, "q"), pub("v", 102, "q")]


def test_a_writer_whose_lease_another_node_took_commits_nothing_more(site_a: LocalSite) -> None:
    """The fence (schema 0018): a leader paused past its lease and woken
    after another node took the site cannot append a single entry, whatever
    its clock says; what it committed before stays."""
    dsn = site_a.pg.dsn()
    prepare(dsn, v="active")
    durable = Durable()
    with psycopg.connect(dsn, autocommit=True) as db:
        term = take_lease(SITE, "a1.0", 30).run(db)
    assert term == 1

    async def scenario() -> None:
        async with LedgerWriter(dsn) as writer:
            writer.fence = Fence(SITE, "a1.0", term)
            writer.on_fenced = lambda: fenced.append(True)
            writer.append(pub("v", 1, "q"), durable.cb(1))
            await writer.wait_durable("v", 1)
            with psycopg.connect(dsn, autocommit=True) as db:
                db.execute("UPDATE lease SET expires_at = now() WHERE scope = %s", (SITE,))
                assert take_lease(SITE, "a2.0", 30).run(db) == 2
            writer.append(pub("v", 2, "q"), durable.cb(2))
            with pytest.raises(LedgerClosed):
                await writer.wait_durable("v", 2)
            with pytest.raises(LedgerClosed, match="another node took over"):
                writer.append(pub("v", 3, "q"))
        assert durable.calls == [(1, True), (2, False)]
        assert fenced == [True]  # the node hears of it at once

    fenced: list[bool] = []
    run(scenario)
    assert [ev for _, _, ev in stored(dsn, "v")] == [pub("v", 1, "q")]
    assert scalar(dsn, "SELECT ledger_index FROM vpn_state WHERE vpn = 'v'") == 1


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
            await _until_blocked(dsn)
            await _commit_in(blocker, entries)
            await writer.wait_durable("v", second)
            assert row("t-2") == ("committed", 5)
            third = writer.append_group([pub("v", 6, "q")], decision="t-3")
            await writer.wait_durable("v", third)

    run(scenario)
    assert row("t-3") == ("aborted", 0)
    assert [i for i, _, _ in stored(dsn, "v")] == [1, 2, 3, 4, 5, 6]
