"""The standby's participant (txn/local/_participant.py) on a real
PostgreSQL: its vote and the events it was for, a no where the VPN is not
a standby (or is being promoted), and outcomes that leave a row to its
group or abort it."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from bridge import IdSource, VpnSettings, encode_event
from plugin.devtools import LocalSite
from plugin.ops import connect, enable_vpn
from sql import migrate
from tests.site.txn.local.test_coordinator import active_site, states, txn
from txn.local import Participant, TxnLog, encode_events


def test_a_participants_yes_vote_returns_the_events_it_was_for(site_a: LocalSite) -> None:
    """The events a yes vote was for (for the early commit);
    none for a no vote, whose row is aborted."""
    dsn = site_a.pg.dsn()
    migrate(dsn)
    with connect(dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args("v", "standby"))
    ids = IdSource(12)
    t1, t2 = txn(ids, 1), txn(ids, 2)

    async def scenario() -> None:
        log = TxnLog(dsn)
        await log.open()
        p = Participant(log)
        seen: list[tuple[tuple[bytes, object], ...]] = []
        voted = await p.prepare("v", t1.txid, encode_events(t1.events), seen.append)
        assert voted is not None
        assert [event for _, event in voted] == list(t1.events)
        assert [data for data, _ in voted] == [encode_event(e) for e in t1.events]
        assert seen == [voted]  # what the caller makes ready meanwhile gets the same events

        def fails(voted: object) -> None:
            raise ValueError("not this one")

        # the caller's own failure does not change the vote
        assert await p.prepare("v", t2.txid, encode_events(t2.events), fails) is not None
        assert await p.prepare("v", "unreadable", b"\x00\x00\x00\x09abc", seen.append) is None
        assert len(seen) == 1  # nothing made ready for unreadable events
        await p.close()
        await log.close()

    asyncio.run(scenario())
    assert states(dsn) == {t1.txid: "prepared", t2.txid: "prepared", "unreadable": "aborted"}


def test_a_participant_where_the_vpn_is_not_standby_votes_no(site_a: LocalSite) -> None:
    """A promoted site still linked to the old active (it serves the VPN
    until it is fenced) gets its prepares: a yes would let the old active
    commit, and under sync+reject confirm, a transaction this site holds
    only as a row its promotion never saw — its messages nowhere here."""
    dsn = site_a.pg.dsn()
    migrate(dsn)
    with connect(dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args("v", "active"))
    ids = IdSource(13)
    t1 = txn(ids, 1)

    async def scenario() -> None:
        log = TxnLog(dsn)
        await log.open()
        p = Participant(log)
        seen: list[object] = []
        assert await p.prepare("v", t1.txid, encode_events(t1.events), seen.append) is None
        assert await p.prepare("unknown", "1.9.9", encode_events(t1.events)) is None
        await p.close()
        await log.close()

    asyncio.run(scenario())
    assert states(dsn) == {}


def test_a_prepare_waiting_for_a_promotion_votes_no(site_a: LocalSite) -> None:
    """A prepare racing the promotion: one that waits for the promotion's
    locks sees the VPN active and writes nothing (a row written after the
    promotion read the prepared rows would be resolved by no one)."""
    import threading

    from bridge.store import become_active, lock_for_promotion
    from tests.fix_sites import until_a_lock_waits

    dsn = site_a.pg.dsn()
    migrate(dsn)
    with connect(dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args("v", "standby"))
    ids = IdSource(14)
    t1 = txn(ids, 1)
    votes: list[object] = []

    def vote() -> None:
        async def scenario() -> None:
            log = TxnLog(dsn)
            await log.open()
            votes.append(await Participant(log).prepare("v", t1.txid, encode_events(t1.events)))
            await log.close()

        asyncio.run(scenario())

    with psycopg.connect(dsn) as promoting:
        assert lock_for_promotion("v").run(promoting) is not None
        become_active("v", 2, 0).run(promoting)
        waiter = threading.Thread(target=vote)
        waiter.start()
        until_a_lock_waits(dsn, f"the prepare (votes {votes})", waiter.is_alive)
        promoting.commit()
    waiter.join(10)
    assert votes == [None]
    assert states(dsn) == {}


def test_a_commit_outcome_leaves_the_row_to_its_group_and_an_abort_is_recorded_at_once(
    site_a: LocalSite,
) -> None:
    """A commit outcome settles nothing (the row settles with its group,
    ``bridge/standby/_prepared.py``), so it stays in doubt until the group comes; an
    abort is recorded at once."""
    dsn = site_a.pg.dsn()
    migrate(dsn)
    with connect(dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args("v", "standby"))
    ids = IdSource(11)
    t1, t2, t3, t4 = (txn(ids, n) for n in range(1, 5))

    async def scenario() -> None:
        log = TxnLog(dsn)
        await log.open()
        p = Participant(log)
        for t in (t1, t2, t3):
            assert await p.prepare("v", t.txid, encode_events(t.events)) is not None
        await p.outcome("v", t1.txid, commit=True)
        await p.outcome("v", t2.txid, commit=False)
        assert states(dsn)[t2.txid] == "aborted"
        assert sorted(await p.in_doubt("v")) == sorted([t1.txid, t3.txid])
        # an abort handled before its prepare's row is written (they run as
        # separate tasks): the prepare votes no and its row ends aborted
        await p.outcome("v", t4.txid, commit=False)
        assert await p.prepare("v", t4.txid, encode_events(t4.events)) is None
        await p.close()
        await log.close()

    asyncio.run(scenario())
    rows = states(dsn)
    assert [rows[t.txid] for t in (t1, t2, t3, t4)] == [
        "prepared",
        "aborted",
        "prepared",
        "aborted",
    ]


def test_an_abort_the_standby_database_does_not_take_stays_in_doubt_quietly(
    site_a: LocalSite, caplog: pytest.LogCaptureFixture
) -> None:
    """The standby's PostgreSQL died as an abort outcome came: the row stays
    prepared (the next resync asks the active), with a warning, not an
    unhandled error in the node."""
    dsn = active_site(site_a)
    with psycopg.connect(dsn) as db:
        db.execute(
            "INSERT INTO txn_log (txid, vpn, side, state, events)"
            " VALUES ('1.3.1', 'v', 'participant', 'prepared', '')"
        )

    async def scenario() -> None:
        log = TxnLog(dsn)
        await log.open()
        p = Participant(log)
        site_a.pg.stop()
        try:
            await p.outcome("v", "1.3.1", commit=False)  # raises nothing
        finally:
            site_a.pg.start()
        await log.close()

    asyncio.run(scenario())
    assert "its abort is not recorded yet" in caplog.text
    assert states(dsn) == {"1.3.1": "prepared"}
