"""Reconcile's building blocks: which rows events touch, how rows compare,
the SQL the comparison sends (its literal quoting, its digest against a real
PostgreSQL), and the bridge's Repair frame (its encoding, and where the
protocol takes it)."""

from __future__ import annotations

import psycopg
import pytest

from bridge import (
    DIFFERS,
    EXTRA_ON_STANDBY,
    MISSING_ON_STANDBY,
    Consumed,
    DeadLettered,
    Difference,
    LocalProtocolError,
    Mode,
    Published,
    Purged,
    ReplicationId,
    Role,
    SyncTimeoutPolicy,
    compare_rows,
    quote_literal,
    row_digest_sql,
    segment_sql,
    touched,
)
from bridge.wire import (
    PROTOCOL_VERSION,
    BridgeConnection,
    CheckpointRow,
    GetAllResources,
    Hello,
    Repair,
    ResourceList,
    SyncAccepted,
    SyncFinished,
    SyncRequest,
    VpnResource,
    decode_frame,
)
from plugin.devtools import LocalSite
from tests.unit.bridge.wire.test_versions import frames

R1, R2, R3 = (ReplicationId.from_parts(1, n) for n in (1, 2, 3))


def test_touched_names_each_event_kinds_rows_and_a_purge_its_queue() -> None:
    events = [
        Published("v", R1, "x", "k", b"", b"b", ("q1", "q2")),
        Consumed("v", R2, "q1"),
        DeadLettered("v", R3, "q1", ("dlq",)),
        Purged("v", "q9"),
    ]
    keys, queues = touched(events)
    assert keys == {
        ("q1", R1.value),
        ("q2", R1.value),
        ("q1", R2.value),
        ("q1", R3.value),
        ("dlq", R3.value),
    }
    assert queues == {"q9"}


def test_rows_compare_into_the_three_kinds() -> None:
    row = (1, "x", "k", b"p", b"body")
    active = {("q", b"a"): row, ("q", b"b"): row, ("q", b"same"): row}
    standby = {("q", b"b"): (1, "x", "k", b"p", b"other"), ("q", b"c"): row, ("q", b"same"): row}
    keys = [("q", b"a"), ("q", b"b"), ("q", b"c"), ("q", b"same"), ("q", b"none")]
    assert compare_rows(active, standby, keys) == [
        Difference(MISSING_ON_STANDBY, "q", b"a"),
        Difference(DIFFERS, "q", b"b"),
        Difference(EXTRA_ON_STANDBY, "q", b"c"),
    ]


def test_literals_are_quoted_and_bounds_checked() -> None:
    assert quote_literal("it's") == "'it''s'"
    with pytest.raises(ValueError, match="NUL"):
        quote_literal("a\x00b")
    with pytest.raises(ValueError, match="segments must be 1 to 65536"):
        segment_sql(0)


def test_the_digest_covers_every_field_a_consumer_gets(site_a: LocalSite) -> None:
    base = {
        "repl_id": R1.value,
        "publish_index": 7,
        "exchange": "events",
        "routing_key": "order.created",
        "properties": b"\x10\x00\x02",
        "body": b"hello",
    }
    variants = [base] + [
        {**base, field: value}
        for field, value in (
            ("repl_id", R2.value),
            ("publish_index", 8),
            ("exchange", "events2"),
            ("routing_key", "order.created2"),
            ("properties", b"\x10\x00\x01"),
            ("body", b"hellO"),
            # the same bytes moved across a field boundary
            ("exchange", "event"),
        )
    ]
    variants[-1]["routing_key"] = "sorder.created"
    with psycopg.connect(site_a.pg.dsn("postgres")) as db:
        digests = [
            db.execute(
                f"SELECT {row_digest_sql()} FROM (SELECT %(repl_id)s::bytea AS repl_id,"  # noqa: S608
                " %(publish_index)s::bigint AS publish_index, %(exchange)s::text AS exchange,"
                " %(routing_key)s::text AS routing_key, %(properties)s::bytea AS properties,"
                " %(body)s::bytea AS body) AS r",
                v,
            ).fetchone()[0]
            for v in variants
        ]
        segments = db.execute(
            f"SELECT {segment_sql(16)} FROM (SELECT %s::bytea AS repl_id) AS r",  # noqa: S608
            (ReplicationId.from_parts(3, 0x1234).value,),
        ).fetchone()[0]
    assert len(set(digests)) == len(digests), digests
    assert segments == 0x1234 % 16


def _live_pair(version: int) -> tuple[BridgeConnection, BridgeConnection]:
    active = BridgeConnection(Role.ACTIVE, "a")
    standby = BridgeConnection(Role.STANDBY, "b", version=version)
    frames(active, standby.send(Hello("b", version, Role.STANDBY)))
    frames(standby, active.send(Hello("a", active.version, Role.ACTIVE)))
    frames(active, standby.send(GetAllResources()))
    vpn = VpnResource("orders", 1, Mode.SYNC, 2000, SyncTimeoutPolicy.REJECT, (), (), b"{}")
    frames(standby, active.send(ResourceList((vpn,))))
    frames(active, standby.send(SyncRequest("orders", 1, 0, 0)))
    frames(standby, active.send(SyncAccepted("orders", 1, 1)))
    frames(standby, active.send(SyncFinished("orders", 1, 0)))
    return active, standby


def _repair() -> Repair:
    row = CheckpointRow("orders.q1", R1, 3, "events", "order.created", b"\x10\x00\x02", b"x" * 10)
    return Repair("orders", 1, (row,), (("orders.q2", R2),))


def test_a_repair_travels_in_the_live_stream_from_version_5() -> None:
    frame = _repair()
    decoded, used = decode_frame(frame.encode())
    assert decoded == frame and used == len(frame.encode())
    active, standby = _live_pair(PROTOCOL_VERSION)
    assert frames(standby, active.send(frame)) == [frame]
    with pytest.raises(ValueError, match="at least one row or absent key"):
        Repair("orders", 1, (), ())


def test_a_repair_before_the_stream_is_live_is_refused() -> None:
    active = BridgeConnection(Role.ACTIVE, "a")
    standby = BridgeConnection(Role.STANDBY, "b")
    frames(active, standby.send(Hello("b", PROTOCOL_VERSION, Role.STANDBY)))
    frames(standby, active.send(Hello("a", active.version, Role.ACTIVE)))
    frames(active, standby.send(GetAllResources()))
    vpn = VpnResource("orders", 1, Mode.SYNC, 2000, SyncTimeoutPolicy.REJECT, (), (), b"{}")
    frames(standby, active.send(ResourceList((vpn,))))
    with pytest.raises(LocalProtocolError, match="Repair in state"):
        active.send(_repair())
