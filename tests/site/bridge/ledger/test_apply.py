"""The apply step both sites share (bridge/ledger/_apply.py) against a real
PostgreSQL: a batch leaves what applying its entries one by one leaves,
replays included; unknown ACKs are counted and logged, never raised; a
guarded statement leaves what the transaction leaves; an ACK finds its row
by the primary key.

The helpers here (:func:`prepare`, :func:`pub`, :func:`ack`,
:func:`numbered`, :func:`live`, :func:`state`, :func:`keys`) are those of
the standby applier's, early commits', prepared rows', role changes' and
the two sites' apply tests too."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from bridge import (
    Consumed,
    DeadLettered,
    Event,
    LedgerEntry,
    Published,
    Purged,
    ReplicationId,
    VpnSettings,
)
from bridge.ledger import (
    apply_entries,
    bytea_array,
    guarded_apply,
    run_guarded,
    text_array,
)
from bridge.ledger._apply import _DELETE
from bridge.standby import StandbyApplier
from plugin.devtools import LocalSite
from plugin.ops import connect, enable_vpn
from sql import migrate

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


def test_acks_find_their_rows_by_primary_key_without_statistics(site_b: LocalSite) -> None:
    """A queue whose consumers keep up is empty when autovacuum analyses it;
    when a backlog builds up later, each ack must still be one primary-key
    probe, not a read of the whole queue (what PostgreSQL chose while a
    second index on ``(vpn, queue, ...)`` existed: 0.5-1 s per 500 acks of a
    10,000-message queue)."""
    dsn = site_b.pg.dsn()
    prepare(dsn, v="standby")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE live_message")  # the statistics of an empty table
        conn.autocommit = False
        apply_entries(conn, "v", numbered([pub("v", n, "q") for n in range(1, 2001)]))
        conn.commit()
        ids = bytea_array([rid(n).value for n in range(1, 501)])
        plan = conn.execute(
            "EXPLAIN (FORMAT JSON) " + _DELETE, ("v", text_array(["q"] * 500), ids)
        ).fetchone()
    assert plan is not None
    lookups = [index for node, index in _scans(plan[0][0]["Plan"]) if "Index" in node]
    # one probe per acknowledged key, through the primary key only (the row
    # removal itself may scan the table once per batch while the statistics
    # say it is empty; autovacuum's next analysis ends that)
    assert lookups == ["live_message_pkey"], lookups
