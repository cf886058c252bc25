"""The standby applier (bridge/standby/_applier.py) against a real
PostgreSQL: every entry changes the state once and in index order —
replays, overlaps, gaps and older epochs — a checkpoint replaces the live
state, and a lost database is reported and reconnected."""

from __future__ import annotations

import pytest
from psycopg_pool import ConnectionPool

from bridge import Event, Gap, StaleEpoch, UnknownVpn
from bridge.standby import NotStandby, StandbyApplier, StandbyUnavailable
from bridge.wire import CheckpointRow
from plugin.devtools import LocalSite
from tests.site.bridge.ledger.test_apply import (
    ack,
    keys,
    live,
    numbered,
    prepare,
    pub,
    rid,
    state,
)


def test_applying_the_same_batch_twice_changes_nothing(site_b: LocalSite) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    batch = numbered([pub("v", 1, "q"), pub("v", 2, "q"), ack("v", 1, "q"), ack("v", 9, "q")])
    with StandbyApplier(dsn) as applier:
        assert applier.apply_batch("v", batch) == 4
        first = (live(dsn, "v"), state(dsn, "v"))
        assert applier.apply_batch("v", batch) == 4
        assert applier.apply_batch("v", batch[1:3]) == 4
        assert (live(dsn, "v"), state(dsn, "v")) == first
        assert applier.applied_index("v") == 4


def test_an_overlapping_replay_applies_only_the_new_entries(site_b: LocalSite) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    events: list[Event] = [pub("v", n, "q") for n in range(1, 6)]
    events += [ack("v", 1, "q"), pub("v", 6, "q"), ack("v", 2, "q")]
    entries = numbered(events)
    with StandbyApplier(dsn) as applier:
        assert applier.apply_batch("v", entries[:5]) == 5
        assert applier.apply_batch("v", entries[2:]) == 8
    assert keys(dsn, "v") == {("q", 3, 3), ("q", 4, 4), ("q", 5, 5), ("q", 6, 7)}
    assert state(dsn, "v")[3] == 0


def test_a_gap_raises_and_writes_nothing(site_b: LocalSite) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    entries = numbered([pub("v", n, "q") for n in range(1, 6)])
    with StandbyApplier(dsn) as applier:
        with pytest.raises(Gap) as err:
            applier.apply_batch("v", entries[1:])
        assert (err.value.expected, err.value.got) == (1, 2)
        assert "expected index 1, got 2" in str(err.value)
        assert applier.apply_batch("v", entries[:2]) == 2
        with pytest.raises(Gap) as err:
            applier.apply_batch("v", [entries[2], entries[4]])  # 4 missing inside
        assert (err.value.expected, err.value.got) == (4, 5)
        assert applier.applied_index("v") == 2
    assert keys(dsn, "v") == {("q", 1, 1), ("q", 2, 2)}


def test_an_entry_from_an_older_epoch_is_refused(site_b: LocalSite) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    with StandbyApplier(dsn) as applier:
        assert applier.apply_batch("v", numbered([pub("v", 1, "q")], epoch=2)) == 1
        with pytest.raises(StaleEpoch):
            applier.apply_batch("v", numbered([pub("v", 2, "q")], start=2, epoch=1))
        assert applier.apply_batch("v", numbered([pub("v", 2, "q")], start=2, epoch=3)) == 2
    assert state(dsn, "v")[:2] == (2, 3)


def test_only_a_standby_vpn_of_this_site_is_applied(site_b: LocalSite) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, act="active")
    with StandbyApplier(dsn) as applier:
        with pytest.raises(NotStandby, match="active on this site"):
            applier.apply_batch("act", numbered([pub("act", 1, "q")]))
        with pytest.raises(UnknownVpn, match="not enabled"):
            applier.apply_batch("nope", numbered([pub("nope", 1, "q")]))


def test_install_checkpoint_replaces_the_live_state(site_b: LocalSite) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby", other="standby")
    rows = [
        ("q1", rid(500).value, 480, "ex", "rk", b"p", b"b1"),
        ("q2", rid(501).value, 490, "ex2", "rk2", b"", b""),
    ]
    with StandbyApplier(dsn) as applier:
        applier.apply_batch("v", numbered([pub("v", 1, "q"), pub("v", 2, "q")]))
        applier.apply_batch("other", numbered([pub("other", 1, "q")]))
        applier.install_checkpoint("v", 2, 500, rows)
        assert applier.applied_index("v") == 500
        assert live(dsn, "v") == sorted(rows)
        assert state(dsn, "v")[:2] == (500, 2)
        assert keys(dsn, "other") == {("q", 1, 1)}
        # the stream continues from the checkpoint; older entries are replays
        more = numbered([ack("v", 500, "q1"), pub("v", 502, "q1")], start=500, epoch=2)
        assert applier.apply_batch("v", more) == 501
    assert keys(dsn, "v") == {("q1", 500, 480), ("q2", 501, 490), ("q1", 502, 501)}


def test_a_checkpoint_takes_the_bridge_frames_rows(site_b: LocalSite) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    row = CheckpointRow("q1", rid(7), 7, "ex", "rk", b"p", b"b")
    with StandbyApplier(dsn) as applier:
        applier.install_checkpoint("v", 1, 9, [row])
    assert live(dsn, "v") == [("q1", rid(7).value, 7, "ex", "rk", b"p", b"b")]


def test_a_borrowed_pool_works_too(site_b: LocalSite) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as pool:
        applier = StandbyApplier(pool)
        assert applier.apply_batch("v", numbered([pub("v", 1, "q")])) == 1
        assert applier.applied_index("v") == 1


def test_a_lost_database_is_reported_and_reconnected(site_b: LocalSite) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    entries = numbered([pub("v", 1, "q"), pub("v", 2, "q")])
    with StandbyApplier(dsn) as applier:
        assert applier.apply_batch("v", entries[:1]) == 1
        site_b.pg.kill()
        with pytest.raises(StandbyUnavailable):
            applier.apply_batch("v", entries)
        site_b.pg.start()
        assert applier.apply_batch("v", entries) == 2
    assert keys(dsn, "v") == {("q", 1, 1), ("q", 2, 2)}
