"""The apply step both sites share (bridge/ledger/_apply.py), on the two
sites' PostgreSQL: the active's writer and the standby's applier, cutting
the same entries at different boundaries, leave the same live state row
for row and count the same unknown ACKs."""

from __future__ import annotations

import asyncio
import random

from bridge import Consumed, Event, LedgerEntry
from bridge.ledger import LedgerWriter
from bridge.standby import StandbyApplier
from plugin.devtools import LocalSite
from tests.site.bridge.ledger.test_apply import ack, live, prepare, pub, state


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
