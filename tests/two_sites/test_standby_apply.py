"""The shared apply step and the standby applier against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from psycopg_pool import ConnectionPool

from bridge import (
    Consumed,
    DeadLettered,
    Event,
    Gap,
    LedgerEntry,
    Published,
    Purged,
    ReplicationId,
    StaleEpoch,
    UnknownVpn,
    VpnSettings,
    encode_event,
)
from bridge.ledger import (
    LedgerWriter,
    apply_entries,
    guarded_apply,
    run_guarded,
    run_guarded_async,
)
from bridge.standby import NotStandby, StandbyApplier, StandbyUnavailable
from bridge.wire import CheckpointRow
from plugin.devtools import LocalSite
from plugin.ops import connect, enable_vpn
from sql import migrate
from txn.local import encode_events

LIVE_SQL = (
    "SELECT queue, repl_id, publish_index, exchange, routing_key, properties, body"
    " FROM live_message WHERE vpn = %s ORDER BY queue, repl_id"
)


def prepare(dsn: str, **roles: str) -> None:
    migrate(dsn)
    with connect(dsn) as conn:
        for name, role in roles.items():
            enable_vpn(conn, VpnSettings.from_args(name, role))


def rid(n: int) -> ReplicationId:
    return ReplicationId.from_parts(9, n)


def pub(vpn: str, n: int, *queues: str, body: bytes = b"secret-body") -> Published:
    return Published(vpn, rid(n), "ex", f"rk.{n}", b"\x80props", body, queues)


def ack(vpn: str, n: int, queue: str) -> Consumed:
    return Consumed(vpn, rid(n), queue)


def numbered(events: list[Event], start: int = 1, epoch: int = 1) -> list[LedgerEntry]:
    return [LedgerEntry(e.vpn, epoch, start + i, e) for i, e in enumerate(events)]


def live(dsn: str, vpn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(LIVE_SQL, (vpn,)).fetchall()


def state(dsn: str, vpn: str) -> tuple[Any, ...]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT applied_index, applied_epoch, applied_at, unknown_acks FROM vpn_state "
            "WHERE vpn = %s",
            (vpn,),
        ).fetchone()
    assert row is not None
    return tuple(row)


def keys(dsn: str, vpn: str) -> set[tuple[str, int, int]]:
    """(queue, replication counter, publish index) of every live message."""
    return {(r[0], int.from_bytes(r[1][8:], "big"), r[2]) for r in live(dsn, vpn)}


# ------------------------------------------------------------- apply step


def test_publish_makes_one_row_per_queue_and_ack_removes_one(site_b: LocalSite) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, orders="standby")
    with StandbyApplier(dsn) as applier:
        applied = applier.apply_batch(
            "orders",
            numbered(
                [pub("orders", 1, "q1", "q2"), pub("orders", 2, "q1"), ack("orders", 1, "q2")]
            ),
        )
    assert applied == 3
    assert keys(dsn, "orders") == {("q1", 1, 1), ("q1", 2, 2)}
    row = live(dsn, "orders")[0]
    assert row[3:] == ("ex", "rk.1", b"\x80props", b"secret-body")
    applied_index, applied_epoch, applied_at, unknown = state(dsn, "orders")
    assert (applied_index, applied_epoch, unknown) == (3, 1, 0)
    assert applied_at is not None


def test_a_purge_removes_only_what_was_published_before_its_request_went_out(
    site_b: LocalSite,
) -> None:
    """The purge's request went out at index 2: the message at 1 was
    purged; the one at 2 (another connection's, its event in the ledger
    before the purge-ok came) may have reached the queue after the purge,
    and stays. A purge that does not say (an older active's) removes all
    that came before it, as it always did."""
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    events: list[Event] = [
        pub("v", 1, "q"),
        pub("v", 2, "q", "other"),
        Purged("v", "q", (), sent_at=2),
        pub("v", 3, "q"),
    ]
    with psycopg.connect(dsn) as conn:
        result = apply_entries(conn, "v", numbered(events))
    assert keys(dsn, "v") == {("q", 2, 2), ("other", 2, 2), ("q", 3, 4)}
    assert result.deleted == 1
    with psycopg.connect(dsn) as conn:
        apply_entries(conn, "v", numbered([Purged("v", "q")], start=5))
    assert keys(dsn, "v") == {("other", 2, 2)}


def test_order_within_a_batch_is_kept_for_the_same_key(site_b: LocalSite) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    events: list[Event] = [
        pub("v", 1, "q"),
        ack("v", 1, "q"),  # published and consumed in one batch: gone, not unknown
        ack("v", 2, "q"),  # consumed first (row not there): unknown
        pub("v", 2, "q"),  # ... then published: present
        pub("v", 3, "q"),
        ack("v", 3, "q"),
        pub("v", 3, "q"),  # back again (dead-lettered to the same queue): present, index 7
        ack("v", 4, "q"),
        ack("v", 4, "q"),  # twice unknown
    ]
    with psycopg.connect(dsn) as conn:
        result = apply_entries(conn, "v", numbered(events))
    assert keys(dsn, "v") == {("q", 2, 4), ("q", 3, 7)}
    assert (result.inserted, result.unknown_acks) == (2, 3)
    assert state(dsn, "v")[3] == 3


def _scans(node: dict[str, Any]) -> Iterator[tuple[str, str | None]]:
    """(node type, index name) of every node on ``live_message`` in a plan."""
    if node.get("Relation Name") == "live_message":
        yield node["Node Type"], node.get("Index Name")
    for child in node.get("Plans", []):
        yield from _scans(child)


def test_unknown_ack_is_counted_and_logged_not_raised(
    site_b: LocalSite, caplog: pytest.LogCaptureFixture
) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, orders="standby")
    with StandbyApplier(dsn) as applier, caplog.at_level(logging.WARNING, "bridge.ledger._apply"):
        applier.apply_batch("orders", numbered([pub("orders", 1, "q1"), ack("orders", 77, "q1")]))
        applier.apply_batch("orders", numbered([ack("orders", 78, "q9")], start=3))
    assert state(dsn, "orders")[3] == 2
    assert keys(dsn, "orders") == {("q1", 1, 1)}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "'orders'" in warnings[0] and "'q1'" in warnings[0] and rid(77).hex in warnings[0]
    assert "'q9'" in warnings[1] and rid(78).hex in warnings[1]
    assert "secret-body" not in caplog.text


def test_many_unknown_acks_are_summarised(
    site_b: LocalSite, caplog: pytest.LogCaptureFixture
) -> None:
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    with StandbyApplier(dsn) as applier, caplog.at_level(logging.WARNING, "bridge.ledger._apply"):
        applier.apply_batch("v", numbered([ack("v", n, "q") for n in range(100)]))
    assert state(dsn, "v")[3] == 100
    warnings = [r.getMessage() for r in caplog.records if r.name == "bridge.ledger._apply"]
    assert len(warnings) == 21
    assert "80 more" in warnings[-1]


_op = st.tuples(
    st.sampled_from(["P", "C", "P", "C", "X", "D"]),  # publish, consume, purge, dead-letter
    st.integers(0, 4),
    st.lists(st.sampled_from(["q0", "q1", "q2"]), min_size=1, max_size=3, unique=True),
)
_vpn_names = itertools.count()


def two_fresh_vpns(dsn: str, *prefixes: str) -> tuple[str, ...]:
    """New standby VPNs (one per prefix) in the schema a hypothesis example
    shares with the ones before it (the site fixture resets per test)."""
    n = next(_vpn_names)
    with psycopg.connect(dsn) as plain:
        schema = plain.execute("SELECT to_regclass('vpn_config')").fetchone()
    if schema is None or schema[0] is None:
        prepare(dsn)
    names = tuple(f"{prefix}{n}" for prefix in prefixes)
    with connect(dsn) as store:
        for name in names:
            enable_vpn(store, VpnSettings.from_args(name, "standby"))
    return names


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=st.lists(_op, max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=6),
    replay=st.booleans(),
)
def test_a_batch_leaves_the_state_one_by_one_apply_leaves(
    site_b: LocalSite, ops: list[tuple[str, int, list[str]]], cuts: list[int], replay: bool
) -> None:
    """The invariant of bridge.ledger._apply: batching never changes the outcome,
    including replays of entries already applied."""
    dsn = site_b.pg.dsn()
    batched, single = two_fresh_vpns(dsn, "b", "s")

    def events_for(vpn: str) -> list[LedgerEntry]:
        return numbered([_event(vpn, *op) for op in ops])

    bounds = sorted({0, len(ops), *(c for c in cuts if c <= len(ops))})
    chunks = [slice(a, b) for a, b in itertools.pairwise(bounds)]
    if replay and chunks:
        chunks.append(chunks[0])
    with psycopg.connect(dsn) as conn:
        for chunk in chunks:
            with conn.transaction():
                apply_entries(conn, batched, events_for(batched)[chunk])
            for entry in events_for(single)[chunk]:
                with conn.transaction():
                    apply_entries(conn, single, [entry])
    assert live(dsn, batched) == live(dsn, single)
    assert state(dsn, batched)[3] == state(dsn, single)[3]
    # and one by one means what the events say, replays included
    applied = [e for chunk in chunks for e in events_for(single)[chunk]]
    assert keys(dsn, single) == model_keys(applied)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(_op, max_size=20), cut=st.integers(0, 20), guard=st.booleans())
def test_one_guarded_statement_leaves_what_the_transaction_leaves(
    site_b: LocalSite, ops: list[tuple[str, int, list[str]]], cut: int, guard: bool
) -> None:
    """bridge.ledger._apply.guarded_apply against apply_entries, after a first
    batch the same on both VPNs: the same live rows and unknown ACKs when
    the guard lets it apply, nothing at all when it does not, and a
    refusal (None) exactly for runs one statement cannot hold."""
    dsn = site_b.pg.dsn()
    one, steps = two_fresh_vpns(dsn, "o", "t")
    cut = min(cut, len(ops))
    with psycopg.connect(dsn, autocommit=True) as conn:
        for vpn in (one, steps):
            with conn.transaction():
                apply_entries(conn, vpn, numbered([_event(vpn, *op) for op in ops[:cut]]))
        before = live(dsn, one), state(dsn, one)[3]
        rest = numbered([_event(one, *op) for op in ops[cut:]], start=cut + 1)
        go = "WITH go AS (SELECT 1 WHERE %s)"
        statement = guarded_apply(one, rest, go, (guard,))
        with conn.transaction():
            apply_entries(conn, steps, numbered([_event(steps, *op) for op in ops[cut:]], cut + 1))
        if statement is None:
            kinds = {op[0] for op in ops[cut:]}
            assert not rest or kinds & {"X", "D"} or _removed_then_inserted(rest)
            return
        result = run_guarded(conn, statement)
    if not guard:
        assert result is None
        assert (live(dsn, one), state(dsn, one)[3]) == before
        return
    assert result is not None
    assert [r[1:] for r in live(dsn, one)] == [r[1:] for r in live(dsn, steps)]
    assert state(dsn, one)[3] == state(dsn, steps)[3]


def _removed_then_inserted(entries: list[LedgerEntry]) -> bool:
    """A key whose row the run must delete and then insert again: a
    consumption of it followed by a publish."""
    consumed: set[tuple[str, bytes]] = set()
    for entry in entries:
        event = entry.event
        if isinstance(event, Published):
            if any((q, event.repl_id.value) in consumed for q in event.queues):
                return True
        elif isinstance(event, Consumed):
            consumed.add((event.queue, event.repl_id.value))
    return False


def _event(vpn: str, kind: str, i: int, queues: list[str]) -> Event:
    if kind == "P":
        return pub(vpn, i, *queues)
    if kind == "C":
        return ack(vpn, i, queues[0])
    if kind == "D":  # rejected from the first queue, dead-lettered to the others
        return DeadLettered(vpn, rid(i), queues[0], tuple(queues[1:]))
    # a purge sparing one delivered message (i even) and saying where its
    # request went out (some index, maybe 0: not said), or a delete (i odd)
    if i % 2 == 0:
        return Purged(vpn, queues[0], (rid(i),), sent_at=i // 3)
    return Purged(vpn, queues[0], (), deleted=True)


def model_keys(entries: list[LedgerEntry]) -> set[tuple[str, int, int]]:
    """:func:`keys` as applying ``entries`` one by one must leave them, from
    what each event means (a purge removes what its queue got before it)."""
    model: dict[tuple[str, int], int] = {}  # (queue, counter) -> publish index
    for entry in entries:
        event = entry.event
        if isinstance(event, Published):
            for q in event.queues:
                model.setdefault((q, _counter(event.repl_id)), entry.index)
        elif isinstance(event, Consumed):
            model.pop((event.queue, _counter(event.repl_id)), None)
        elif isinstance(event, DeadLettered):
            if model.pop((event.queue, _counter(event.repl_id)), None) is not None:
                for q in event.to:
                    model.setdefault((q, _counter(event.repl_id)), entry.index)
        else:
            spared = {_counter(r) for r in event.spared}
            below = min(entry.index, event.sent_at) if event.sent_at else entry.index
            for key, index in list(model.items()):
                if key[0] == event.queue and index < below and key[1] not in spared:
                    del model[key]
    return {(q, n, index) for (q, n), index in model.items()}


def _counter(r: ReplicationId) -> int:
    return int.from_bytes(r.value[8:], "big")


# ------------------------------------------------------------- standby applier


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


# ------------------------------------------------------------- both sites


def _mixed_events(vpn: str, count: int, seed: int) -> list[Event]:
    rnd = random.Random(seed)  # noqa: S311 - a reproducible workload
    queues = ["orders.q1", "orders.q2", "orders.q3", "audit"]
    live_pairs: list[tuple[int, str]] = []
    events: list[Event] = []
    for n in range(1, count + 1):
        roll = rnd.random()
        if roll < 0.55 or not live_pairs:
            routed = rnd.sample(queues, rnd.randint(1, 3))
            body = rnd.randbytes(rnd.randint(0, 2048))
            events.append(pub(vpn, n, *routed, body=body))
            live_pairs += [(n, q) for q in routed]
        elif roll < 0.95:
            i, q = live_pairs.pop(rnd.randrange(len(live_pairs)))
            events.append(ack(vpn, i, q))
        else:
            events.append(ack(vpn, 100_000 + n, rnd.choice(queues)))  # predates replication
    return events


async def _write_through_ledger(dsn: str, events: list[Event]) -> list[LedgerEntry]:
    async with LedgerWriter(dsn, batch_size=128) as writer:
        entries = [writer.append(e) for e in events]
        await writer.wait_durable(events[0].vpn, entries[-1].index)
        shipped: list[LedgerEntry] = []
        while len(shipped) < len(entries):
            shipped += await writer.reader.read_range("orders", len(shipped) + 1, 300)
    assert shipped == entries
    return shipped


def test_both_sites_compute_the_same_state_with_the_same_apply_code(
    site_a: LocalSite, site_b: LocalSite
) -> None:
    dsn_a, dsn_b = site_a.pg.dsn(), site_b.pg.dsn()
    prepare(dsn_a, orders="active")
    prepare(dsn_b, orders="standby")
    events = _mixed_events("orders", 1000, seed=7)
    shipped = asyncio.run(_write_through_ledger(dsn_a, events))
    with StandbyApplier(dsn_b) as applier:
        for start in range(0, len(shipped), 170):  # other boundaries than the active's
            applier.apply_batch("orders", shipped[start : start + 170])
        assert applier.applied_index("orders") == 1000
    rows_a, rows_b = live(dsn_a, "orders"), live(dsn_b, "orders")
    assert rows_a == rows_b
    assert len(rows_a) > 100
    unknown = sum(
        1
        for e in events
        if isinstance(e, Consumed) and int.from_bytes(e.repl_id.value[8:]) > 100_000
    )
    assert state(dsn_a, "orders")[3] == state(dsn_b, "orders")[3] == unknown > 0


# ---------------------------------------------------------------- committed early


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
