"""A VPN's role changes in the site database: the promotion's first step and
fencing (bridge/roles/_roles.py), against a real PostgreSQL."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from bridge.roles import (
    RoleError,
    TakeoverUnknown,
    begin_promotion,
    demote_to_standby,
    fail_promotion,
    finish_promotion,
    read_tail,
    record_fenced,
)
from bridge.standby import NotStandby, StandbyApplier
from plugin.devtools import LocalSite
from plugin.ops import connect, status
from tests.site.bridge.ledger.test_apply import ack, keys, numbered, prepare, pub
from txn.local import Participant, TxnLog, encode_events

VPN = "orders"


def one(dsn: str, sql: str, *params: Any) -> tuple[Any, ...]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql, params).fetchone()
    assert row is not None
    return tuple(row)


def prepared_txn(dsn: str, txid: str, events: list[Any], state: str = "prepared") -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO txn_log (txid, vpn, side, state, events)"
            " VALUES (%s, %s, 'participant', %s, %s)",
            (txid, VPN, state, encode_events(events)),
        )


@pytest.fixture
def standby(site_a: LocalSite) -> str:
    """Site A's database holding ``orders`` as a standby at epoch 3 that has
    applied five events (messages 1-4 published, 2 consumed)."""
    dsn = site_a.pg.dsn()
    prepare(dsn, **{VPN: "standby"})
    events = [pub(VPN, 1, "q1"), pub(VPN, 2, "q1"), pub(VPN, 3, "q1", "q2"), ack(VPN, 2, "q1")]
    events.append(pub(VPN, 4, "q2"))
    with StandbyApplier(dsn) as applier:
        applier.apply_batch(VPN, numbered(events, epoch=3))
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE vpn_config SET epoch = 3 WHERE name = %s", (VPN,))
    return dsn


def test_promotion_raises_the_epoch_and_makes_the_vpn_active_in_one_step(standby: str) -> None:
    with connect(standby) as conn:
        start = begin_promotion(conn, VPN, "b")
    assert (start.epoch, start.resumed, start.ledger_index) == (4, False, 5)
    assert one(standby, "SELECT role, epoch FROM vpn_config WHERE name = %s", VPN) == ("active", 4)
    assert one(
        standby,
        "SELECT ledger_index, applied_index, fenced FROM vpn_state WHERE vpn = %s",
        VPN,
    ) == (5, 0, False)
    assert one(standby, "SELECT live_index FROM vpn_live_state WHERE vpn = %s", VPN) == (5,)
    assert one(standby, "SELECT state, epoch FROM promotion WHERE vpn = %s", VPN) == ("running", 4)
    assert one(standby, "SELECT site FROM vpn_epoch WHERE vpn = %s AND epoch = 4", VPN) == ("b",)
    # the old active's stream is refused from now on
    with StandbyApplier(standby) as applier, pytest.raises(NotStandby):
        applier.apply_batch(VPN, numbered([pub(VPN, 9, "q1")], start=6, epoch=3))


def test_a_rerun_resumes_the_promotion_without_raising_the_epoch_again(standby: str) -> None:
    with connect(standby) as conn:
        begin_promotion(conn, VPN, "b")
        fail_promotion(conn, VPN, "broker unreachable")
        again = begin_promotion(conn, VPN, "b")
        assert (again.epoch, again.resumed) == (4, True)
        conn.execute("UPDATE promotion SET materialised = 4 WHERE vpn = %s", (VPN,))
        finish_promotion(conn, VPN, 4)
        with pytest.raises(RoleError, match="already active"):
            begin_promotion(conn, VPN, "b")
        doc = status(conn, "b")
    [vpn] = doc["vpns"]
    assert vpn["promotion"]["state"] == "done" and vpn["promotion"]["materialised"] == 4
    assert [(e["epoch"], e["site"]) for e in vpn["epochs"]] == [(4, "b")]


def test_in_doubt_transactions_are_committed_after_what_was_applied(standby: str) -> None:
    prepared_txn(standby, "t-prepared", [pub(VPN, 10, "q1"), ack(VPN, 1, "q1")])
    prepared_txn(standby, "t-ahead", [pub(VPN, 11, "q2")], state="applied")
    with connect(standby) as conn:
        start = begin_promotion(conn, VPN, "b")
    assert (start.txns_committed, start.txns_committed_early) == (1, 1)
    # the prepared transaction's events came right after the applied index
    assert start.ledger_index == 7
    assert keys(standby, VPN) == {("q1", 3, 3), ("q2", 3, 3), ("q2", 4, 5), ("q1", 10, 6)}
    assert one(standby, "SELECT count(*) FROM txn_log WHERE state = 'committed'") == (2,)
    assert one(standby, "SELECT txns_committed FROM promotion WHERE vpn = %s", VPN) == (2,)


def _participant_hears(dsn: str, txid: str, events: list[Any], *, outcome: bool | None) -> None:
    """The participant prepares ``txid`` (a yes vote) and, unless
    ``outcome`` is None, hears how it ended, as the bridge feeds it."""

    async def run() -> None:
        log = TxnLog(dsn)
        await log.open()
        participant = Participant(log)
        try:
            assert await participant.prepare(VPN, txid, encode_events(events)) is not None
            if outcome is not None:
                await participant.outcome(VPN, txid, outcome)
            await participant.close()
        finally:
            await log.close()

    asyncio.run(run())


def test_a_commit_heard_before_its_group_leaves_the_group_to_the_promotion(standby: str) -> None:
    """The active committed ``t`` and said so, then was lost before its
    ledger stream brought the group: the promotion must still commit it
    here (the client may have been told committed)."""
    _participant_hears(standby, "t", [pub(VPN, 10, "q1")], outcome=True)
    with connect(standby) as conn:
        start = begin_promotion(conn, VPN, "b")
    assert start.txns_committed == 1
    assert ("q1", 10, 6) in keys(standby, VPN)
    assert one(standby, "SELECT state, ledger_last FROM txn_log WHERE txid = 't'") == (
        "committed",
        6,
    )


@pytest.mark.parametrize("outcome", [None, True], ids=["outcome-unheard", "outcome-heard"])
def test_a_group_the_stream_applied_is_not_applied_again_by_the_promotion(
    standby: str, outcome: bool | None
) -> None:
    """The stream brought ``t``'s group, and a consumer then took its
    message, before the outcome (if any) reached the participant: a
    promotion must not publish the consumed message again."""
    _participant_hears(standby, "t", [pub(VPN, 10, "q1")], outcome=None)
    with StandbyApplier(standby) as applier:
        applier.apply_batch(VPN, numbered([pub(VPN, 10, "q1"), ack(VPN, 10, "q1")], 6, epoch=3))
    if outcome is not None:
        asyncio.run(_outcome(standby, "t", outcome))
    with connect(standby) as conn:
        begin_promotion(conn, VPN, "b")
    assert not {k for k in keys(standby, VPN) if k[1] in (10,)}
    assert one(standby, "SELECT state, ledger_last FROM txn_log WHERE txid = 't'") == (
        "committed",
        6,
    )


async def _outcome(dsn: str, txid: str, commit: bool) -> None:
    log = TxnLog(dsn)
    await log.open()
    participant = Participant(log)
    try:
        await participant.outcome(VPN, txid, commit)
        await participant.close()
    finally:
        await log.close()


def test_in_doubt_transactions_and_the_new_ledger_start_past_groups_committed_early(
    standby: str,
) -> None:
    """A group the standby committed early holds the indexes right after
    the applied index in its live state: what the promotion commits, and
    the new ledger, come after it (a checkpoint of the live state then
    never holds a row past its index)."""
    prepared_txn(standby, "t-ahead", [pub(VPN, 11, "q2")], state="applied")
    with psycopg.connect(standby, autocommit=True) as conn:  # its group, applied early at 6
        conn.execute(
            "INSERT INTO live_message (vpn, queue, repl_id, publish_index, exchange,"
            " routing_key, properties, body)"
            " SELECT vpn, 'q2', decode(repeat('ab', 16), 'hex'), 6, exchange, routing_key,"
            " properties, body FROM live_message WHERE vpn = %s LIMIT 1",
            (VPN,),
        )
    with psycopg.connect(standby, autocommit=True) as conn:
        conn.execute("UPDATE txn_log SET ledger_floor = 6 WHERE txid = 't-ahead'")
    prepared_txn(standby, "t-prepared", [pub(VPN, 10, "q1")])
    with connect(standby) as conn:
        start = begin_promotion(conn, VPN, "b")
    assert start.ledger_index == 7  # 6: the early group; 7: the prepared one
    assert one(standby, "SELECT max(publish_index) FROM live_message WHERE vpn = %s", VPN) == (7,)
    assert one(standby, "SELECT live_index FROM vpn_live_state WHERE vpn = %s", VPN) == (7,)
    # each row committed keeps where its group is here (what republish trusts)
    with psycopg.connect(standby) as conn:
        settled = conn.execute("SELECT txid, state, ledger_last FROM txn_log ORDER BY txid")
        assert settled.fetchall() == [("t-ahead", "committed", 6), ("t-prepared", "committed", 7)]


def test_the_new_active_hands_out_incarnations_above_those_it_took_over(standby: str) -> None:
    # the standby's rows carry incarnation 9 (tests/site/bridge/ledger/test_apply.py's ids)
    with connect(standby) as conn:
        begin_promotion(conn, VPN, "b")
    [incarnation] = one(
        standby, "INSERT INTO node_incarnation (site) VALUES ('b') RETURNING incarnation"
    )
    assert incarnation > 9


def test_only_an_enabled_standby_can_be_promoted(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, **{VPN: "active", "audit": "standby"})
    with connect(dsn) as conn:
        with pytest.raises(RoleError, match="already active"):
            begin_promotion(conn, VPN, "a")
        with pytest.raises(RoleError, match="not known"):
            begin_promotion(conn, "nowhere", "a")
        conn.execute("UPDATE vpn_config SET enabled = false WHERE name = 'audit'")
        with pytest.raises(RoleError, match="disabled"):
            begin_promotion(conn, "audit", "a")


def test_a_fenced_former_active_is_told_to_demote(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    prepare(dsn, **{VPN: "active"})
    with connect(dsn) as conn:
        assert record_fenced(conn, VPN, 2, "b")
        assert not record_fenced(conn, VPN, 2, "b")  # once
        with pytest.raises(RoleError, match="demote"):
            begin_promotion(conn, VPN, "a")
    assert one(dsn, "SELECT fenced FROM vpn_state WHERE vpn = %s", VPN) == (True,)
    assert one(dsn, "SELECT site FROM vpn_epoch WHERE vpn = %s AND epoch = 2", VPN) == ("b",)


def test_a_site_fenced_by_a_report_exports_no_tail_until_it_knows_where_the_epoch_took_over(
    site_a: LocalSite,
) -> None:
    """Fenced by a standby's report (no epoch recorded), the newest epoch
    this site knows is its own: a tail read then would start where this
    site took the VPN over and take in what the new active holds. Demote
    waits for the new epoch's take-over index instead."""
    dsn = site_a.pg.dsn()
    prepare(dsn, **{VPN: "active"})
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE vpn_state SET fenced = true WHERE vpn = %s", (VPN,))
    with connect(dsn) as conn:
        with pytest.raises(TakeoverUnknown, match="not known here yet"):
            read_tail(conn, VPN)
        with pytest.raises(TakeoverUnknown):
            demote_to_standby(conn, VPN)
        record_fenced(conn, VPN, 2, "b", 0)  # the listing: epoch 2 took over at 0
        tail = read_tail(conn, VPN)
    assert (tail.epoch, tail.taken_over_at) == (2, 0)


def test_demotion_retires_the_old_epochs_prepared_transactions(site_a: LocalSite) -> None:
    """A branch prepared on the old active was the new active's to decide:
    once this site is active again, its transaction manager must not find
    it in ``recover`` (and commit it a second time)."""
    dsn = site_a.pg.dsn()
    prepare(dsn, **{VPN: "active"})
    rows = [("xa/1:61:62/1.1", "prepared", "1:61:62"), ("1.1.2", "prepared", None)]
    rows.append(("1.1.3", "committed", None))
    with psycopg.connect(dsn) as conn:
        for txid, state, xid in rows:
            conn.execute(
                "INSERT INTO txn_log (txid, vpn, side, state, events, xid)"
                " VALUES (%s, %s, 'coordinator', %s, %s, %s)",
                (txid, VPN, state, encode_events([pub(VPN, 1, "q1")]), xid),
            )
    with connect(dsn) as conn:
        assert record_fenced(conn, VPN, 2, "b")
        assert demote_to_standby(conn, VPN) == 2
    with psycopg.connect(dsn) as conn:
        states = dict(conn.execute("SELECT txid, state FROM txn_log").fetchall())
    assert states == {"xa/1:61:62/1.1": "ended", "1.1.2": "ended", "1.1.3": "committed"}
    assert one(dsn, "SELECT role, epoch FROM vpn_config WHERE name = %s", VPN) == ("standby", 2)


def test_demotion_closes_a_sync_window_left_open_at_the_ledger_index_it_resets(
    site_a: LocalSite,
) -> None:
    """A former active's node stopped while the VPN was sync-ineligible:
    its window ends where its ledger ended, before the index goes to 0."""
    dsn = site_a.pg.dsn()
    prepare(dsn, **{VPN: "active"})
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE vpn_state SET ledger_index = 9 WHERE vpn = %s", (VPN,))
        conn.execute("INSERT INTO sync_window (vpn, epoch, first_index) VALUES (%s, 1, 4)", (VPN,))
    with connect(dsn) as conn:
        assert record_fenced(conn, VPN, 2, "b")
        assert demote_to_standby(conn, VPN) == 2
    assert one(dsn, "SELECT first_index, last_index FROM sync_window WHERE vpn = %s", VPN) == (4, 9)
    assert one(dsn, "SELECT ledger_index FROM vpn_state WHERE vpn = %s", VPN) == (0,)
