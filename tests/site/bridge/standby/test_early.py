"""Transactions committed early on the standby (bridge/standby/_early.py),
against a real PostgreSQL: only when the state is right before the group,
once, the stream's copy skipped (also after a lost reply, a restart that
re-appended the group, a checkpoint), and the gates' locks taken in the
promotion's order.

Its helpers (:func:`prepared`, :func:`txn_state`, :func:`voted`) are those of
the prepared rows' tests too."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from bridge import Event, Gap, StaleEpoch, encode_event
from bridge.ledger import run_guarded_async
from bridge.standby import StandbyApplier
from plugin.devtools import LocalSite
from tests.site.bridge.ledger.test_apply import ack, keys, numbered, prepare, pub, state
from txn.local import encode_events


def prepared(dsn: str, vpn: str, txid: str, events: list[Event], state: str = "prepared") -> None:
    """The participant's row for ``txid``, as ``TxnPrepare`` leaves it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO txn_log (txid, vpn, side, state, events)"
            " VALUES (%s, %s, 'participant', %s, %s)",
            (txid, vpn, state, encode_events(events)),
        )


def txn_state(dsn: str, txid: str) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT state FROM txn_log WHERE txid = %s", (txid,)).fetchone()
    assert row is not None
    return str(row[0])


def voted(events: list[Event]) -> list[tuple[bytes, Event]]:
    """The events as the participant keeps them from its vote."""
    return [(encode_event(e), e) for e in events]


def early_committed_group(dsn: str, one_statement: bool = False) -> list[Event]:
    """VPN ``v`` with entries 1-2 applied and transaction ``t1`` (an ack of
    1 and a publish) committed early, ahead of the stream, at 3-4; its events.
    ``one_statement``: from the events the participant voted on."""
    prepare(dsn, v="standby")
    group: list[Event] = [ack("v", 1, "q"), pub("v", 3, "q")]
    prepared(dsn, "v", "t1", group)
    with StandbyApplier(dsn) as applier:
        applier.apply_batch("v", numbered([pub("v", 1, "q"), pub("v", 2, "q")]))
        events = voted(group) if one_statement else None
        assert applier.apply_prepared("v", "t1", 1, first=3, after=0, voted=events) == 4
    return group


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


@pytest.mark.parametrize("one_statement", [False, True], ids=["read-back", "voted"])
def test_a_transaction_committed_early_is_skipped_when_the_stream_brings_it(
    site_b: LocalSite, one_statement: bool
) -> None:
    dsn = site_b.pg.dsn()
    group = early_committed_group(dsn, one_statement)
    # committed here, but the stream's copy is still to come
    assert keys(dsn, "v") == {("q", 2, 2), ("q", 3, 4)}
    assert txn_state(dsn, "t1") == "applied"
    with StandbyApplier(dsn) as applier:
        assert applier.applied_index("v") == 2
        # the stream brings the group and one entry more: the group is not
        # applied twice (its ack would count as unknown), the rest is
        stream = numbered([*group, pub("v", 5, "q")], start=3)
        assert applier.apply_batch("v", stream) == 5
    assert keys(dsn, "v") == {("q", 2, 2), ("q", 3, 4), ("q", 5, 5)}
    assert state(dsn, "v")[3] == 0  # no unknown ack
    assert txn_state(dsn, "t1") == "committed"


@pytest.mark.parametrize("one_statement", [False, True], ids=["read-back", "voted"])
def test_a_transaction_is_left_to_the_stream_unless_the_state_is_right_before_it(
    site_b: LocalSite, one_statement: bool
) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    groups = {"t1": [pub("v", 3, "q")], "t2": [pub("v", 4, "q")], "gone": [pub("v", 9, "q")]}
    prepared(dsn, "v", "t1", groups["t1"])
    prepared(dsn, "v", "t2", groups["t2"])
    prepared(dsn, "v", "gone", groups["gone"], state="aborted")

    def ahead(applier: StandbyApplier, txid: str, first: int, after: int) -> int | None:
        events = voted(groups[txid]) if one_statement else None
        return applier.apply_prepared("v", txid, 1, first=first, after=after, voted=events)

    with StandbyApplier(dsn) as applier:
        applier.apply_batch("v", numbered([pub("v", 1, "q")]))
        # entry 2 has not come yet: applying at 3 would put it out of order
        assert ahead(applier, "t1", first=3, after=0) is None
        assert ahead(applier, "gone", first=2, after=0) is None
        assert keys(dsn, "v") == {("q", 1, 1)}  # a declined group writes nothing
        applier.apply_batch("v", numbered([pub("v", 2, "q")], start=2))
        assert ahead(applier, "t1", first=3, after=0) == 3
        # the next group may follow the one committed early on this connection
        assert ahead(applier, "t2", first=4, after=2) is None
        assert ahead(applier, "t2", first=4, after=3) == 4
        assert ahead(applier, "t2", first=4, after=3) is None  # once
    assert keys(dsn, "v") == {("q", 1, 1), ("q", 2, 2), ("q", 3, 3), ("q", 4, 4)}
    assert [txn_state(dsn, t) for t in ("t1", "t2", "gone")] == ["applied", "applied", "aborted"]


@pytest.mark.parametrize("one_statement", [False, True], ids=["read-back", "voted"])
def test_the_streams_copy_of_a_group_committed_early_only_moves_the_applied_index(
    site_b: LocalSite, one_statement: bool
) -> None:
    """The usual sync-mode case: the stream brings exactly the group, at the
    indexes it was applied at (cut in two here), and later again (a replay)."""
    dsn = site_b.pg.dsn()
    group = early_committed_group(dsn, one_statement)
    with StandbyApplier(dsn) as applier:
        stream = numbered(group, start=3)
        assert applier.apply_batch("v", stream[:1]) == 3
        assert txn_state(dsn, "t1") == "applied"
        assert applier.apply_batch("v", stream[1:]) == 4
        assert txn_state(dsn, "t1") == "committed"
        assert applier.apply_batch("v", stream) == 4  # replayed: nothing twice
        assert applier.apply_batch("v", numbered([pub("v", 5, "q")], start=5)) == 5
    assert keys(dsn, "v") == {("q", 2, 2), ("q", 3, 4), ("q", 5, 5)}
    assert state(dsn, "v")[0] == 5
    assert state(dsn, "v")[3] == 0  # the group's ACK was not applied twice


def test_the_streams_copy_of_a_group_committed_early_keeps_the_gap_check(
    site_b: LocalSite,
) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    group: list[Event] = [pub("v", 2, "q"), pub("v", 3, "q")]
    prepared(dsn, "v", "t1", group)
    with StandbyApplier(dsn) as applier:
        applier.apply_batch("v", numbered([pub("v", 1, "q")], epoch=2))
        assert applier.apply_prepared("v", "t1", 2, first=2, after=0, voted=voted(group)) == 3
        with pytest.raises(Gap):  # entry 2 is missing
            applier.apply_batch("v", numbered(group, start=2, epoch=2)[1:])
        with pytest.raises(StaleEpoch):  # from a fenced active: epoch 2 is applied
            applier.apply_batch("v", numbered(group, start=2, epoch=1))
        assert applier.applied_index("v") == 1
    assert txn_state(dsn, "t1") == "applied"


def test_one_statement_counts_an_unknown_ack_with_the_group(site_b: LocalSite) -> None:
    """The voted group's statement locks the VPN's state row, and counts an
    ACK of a message the standby never had on that same row."""
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    group: list[Event] = [ack("v", 9, "q"), ack("v", 1, "q"), pub("v", 3, "q")]
    prepared(dsn, "v", "t1", group)
    with StandbyApplier(dsn) as applier:
        applier.apply_batch("v", numbered([pub("v", 1, "q")]))
        assert applier.apply_prepared("v", "t1", 1, first=2, after=0, voted=voted(group)) == 4
        assert keys(dsn, "v") == {("q", 3, 4)}
        assert state(dsn, "v")[3] == 1
        # the stream's copy is skipped: the ACK is not counted twice
        assert applier.apply_batch("v", numbered(group, start=2)) == 4
    assert state(dsn, "v")[3] == 1
    assert txn_state(dsn, "t1") == "committed"


def test_one_statement_declines_a_vpn_no_longer_standby_here(site_b: LocalSite) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    prepared(dsn, "v", "t1", [pub("v", 2, "q")])
    with StandbyApplier(dsn) as applier:
        applier.apply_batch("v", numbered([pub("v", 1, "q")]))
        with psycopg.connect(dsn, autocommit=True) as conn:  # promoted meanwhile
            conn.execute("UPDATE vpn_config SET role = 'active' WHERE name = 'v'")
        events = voted([pub("v", 2, "q")])
        assert applier.apply_prepared("v", "t1", 1, first=2, after=0, voted=events) is None
    assert keys(dsn, "v") == {("q", 1, 1)}
    assert txn_state(dsn, "t1") == "prepared"


def test_a_commit_ahead_whose_reply_was_lost_is_recognised_from_its_row(
    site_b: LocalSite,
) -> None:
    """The bridge runs an early commit's statement on its own asyncio
    connection; when that connection fails, the statement may have
    committed without the applier hearing of it. ``forget_early`` makes the
    applier read the applied rows again, so the stream's copy of the group
    is skipped, not applied a second time."""
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    group: list[Event] = [ack("v", 1, "q"), pub("v", 3, "q")]
    prepared(dsn, "v", "t1", group)
    with StandbyApplier(dsn) as applier:
        applier.apply_batch("v", numbered([pub("v", 1, "q"), pub("v", 2, "q")]))
        ready = applier.ready_early_commit("v", "t1", voted(group))
        statement = applier.early_commit_statement("v", ready, first=3, after=0)
        assert statement is not None

        async def commit_early() -> None:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                assert await run_guarded_async(conn, statement) is not None

        asyncio.run(commit_early())  # committed; the reply "lost": not registered
        assert txn_state(dsn, "t1") == "applied"
        applier.forget_early("v")
        assert applier.apply_batch("v", numbered(group, start=3)) == 4
    assert keys(dsn, "v") == {("q", 2, 2), ("q", 3, 4)}
    assert state(dsn, "v")[3] == 0  # the group's ACK was not applied twice
    assert txn_state(dsn, "t1") == "committed"


def test_a_group_re_appended_elsewhere_after_the_active_restarted_is_applied_once(
    site_b: LocalSite,
) -> None:
    """The active crashed before its ledger commit of the group; at start it
    re-appended the group after another recovered one. A restarted standby
    still recognises it, and its rows take the active's indexes."""
    dsn = site_b.pg.dsn()
    group = early_committed_group(dsn)
    with StandbyApplier(dsn) as restarted:
        # split over two batches, as the stream may cut it
        assert restarted.apply_batch("v", numbered([pub("v", 7, "q"), group[0]], start=3)) == 4
        assert txn_state(dsn, "t1") == "applied"
        assert restarted.apply_batch("v", numbered([group[1]], start=5)) == 5
    assert keys(dsn, "v") == {("q", 2, 2), ("q", 7, 3), ("q", 3, 5)}
    assert state(dsn, "v")[3] == 0
    assert txn_state(dsn, "t1") == "committed"


def test_a_checkpoint_supersedes_what_was_committed_early(site_b: LocalSite) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    prepared(dsn, "v", "t1", [pub("v", 1, "q")])
    with StandbyApplier(dsn) as applier:
        assert applier.apply_prepared("v", "t1", 1, first=1, after=0) == 1
        applier.install_checkpoint("v", 1, 0, [])  # the active's state before the group
        assert txn_state(dsn, "t1") == "committed"
        assert keys(dsn, "v") == set()
        # the replay after the checkpoint brings the group: applied as usual
        assert applier.apply_batch("v", numbered([pub("v", 1, "q")])) == 1
    assert keys(dsn, "v") == {("q", 1, 1)}
