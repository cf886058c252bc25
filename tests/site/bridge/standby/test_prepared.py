"""The participant's prepared rows on the standby (bridge/standby/_prepared.py),
against a real PostgreSQL: a row settles in the transaction that applies its
group's last publish (an XA branch's without its acks too), a group applied
before its row is remembered for it, and a checkpoint settles the rows whose
messages it holds."""

from __future__ import annotations

import psycopg

from bridge.standby import StandbyApplier
from plugin.devtools import LocalSite
from tests.site.bridge.ledger.test_apply import ack, numbered, prepare, pub, rid
from tests.site.bridge.standby.test_early import prepared, txn_state, voted


def test_a_prepared_row_settles_in_the_transaction_that_applies_its_group(
    site_b: LocalSite,
) -> None:
    """The row of a transaction the stream brings (not committed early)
    moves to committed, with the index of its group's last publish,
    exactly when that entry is applied; a row whose vote was withdrawn, or
    whose group has not come, stays prepared."""
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    group = [ack("v", 1, "q"), pub("v", 3, "q")]
    prepared(dsn, "v", "t1", group)
    prepared(dsn, "v", "t2", [pub("v", 4, "q")])
    prepared(dsn, "v", "t3", [pub("v", 9, "q")])
    with StandbyApplier(dsn) as applier:
        applier.expect("v", "t1", voted(group))
        applier.expect("v", "t2", voted([pub("v", 4, "q")]))
        applier.apply_batch("v", numbered([pub("v", 1, "q"), pub("v", 2, "q"), group[0]]))
        assert txn_state(dsn, "t1") == "prepared"  # half its group is here
        applier.forget_prepared("t2")
        applier.apply_batch("v", numbered([group[1], pub("v", 4, "q")], start=4))
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT txid, state, ledger_last FROM txn_log ORDER BY txid")
        assert rows.fetchall() == [
            ("t1", "committed", 4),
            ("t2", "prepared", 0),
            ("t3", "prepared", 0),
        ]


def test_a_branch_recorded_without_its_acks_settles_with_its_publishes(
    site_b: LocalSite,
) -> None:
    """An XA branch committed from its log after its channel closed records
    its publishes alone (the broker requeued what it acked): its row still
    settles, so a promotion does not apply its acks (their messages are in
    the broker again)."""
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    branch = [pub("v", 5, "q"), ack("v", 1, "q")]
    prepared(dsn, "v", "xa/1:ab:cd/9.1.1.1", branch)  # read at the first batch
    with StandbyApplier(dsn) as applier:
        applier.apply_batch("v", numbered([pub("v", 1, "q"), branch[0]]))
    assert txn_state(dsn, "xa/1:ab:cd/9.1.1.1") == "committed"


def test_a_group_applied_before_its_row_is_written_is_remembered_for_it(
    site_b: LocalSite,
) -> None:
    """A late prepare (the active went on without the vote): the stream
    applies the group before the participant's row exists; the applier
    keeps where it went, once, for the row; and forgets early-committed
    transactions' events (nothing kept per transaction once it settled)."""
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    late = [pub("v", 2, "q")]
    with StandbyApplier(dsn) as applier:
        applier.apply_batch("v", numbered([pub("v", 1, "q")]))  # the rows are read
        applier.expect("v", "late", voted(late))
        applier.apply_batch("v", numbered(late, start=2))
        assert applier.arrived_before_its_row("late") == 2
        assert applier.arrived_before_its_row("late") is None
        early = [pub("v", 3, "q")]
        prepared(dsn, "v", "early", early)
        applier.expect("v", "early", voted(early))
        assert applier.apply_prepared("v", "early", 1, first=3, after=0, voted=voted(early)) == 3
        assert applier._prepared._rows == {}


def test_a_checkpoint_settles_the_prepared_rows_whose_messages_it_holds(
    site_b: LocalSite,
) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    prepared(dsn, "v", "held", [pub("v", 3, "q")])
    prepared(dsn, "v", "later", [pub("v", 4, "q")])
    row = ("q", rid(3).value, 7, "ex", "rk.3", b"\x80props", b"secret-body")
    with StandbyApplier(dsn) as applier:
        applier.install_checkpoint("v", 1, 8, [row])
        assert txn_state(dsn, "held") == "committed"
        assert txn_state(dsn, "later") == "prepared"
        applier.apply_batch("v", numbered([pub("v", 4, "q")], start=9))
    assert txn_state(dsn, "later") == "committed"
