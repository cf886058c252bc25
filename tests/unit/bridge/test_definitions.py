"""The definitions a standby holds (``bridge._definitions``): the active's
last listing plus the topology changes streamed after its index must be
the active broker's topology, whatever the interleaving of declares,
binds, deletes, publishes and listings; and a publish is never applied on
the standby before the declare of its queue."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from bridge import (
    DefinitionsError,
    TopologyChanged,
    binding_item,
    exchange_item,
    merge_definitions,
    name_item,
    queue_item,
    streamed_deletions,
)

QUEUES = ("q1", "q2", "q3")
EXCHANGES = ("x1", "x2")
ARGS: tuple[dict[str, object], ...] = (
    {},
    {"x-queue-type": "quorum"},
    {"x-max-length": 5, "x-dead-letter-exchange": "x1"},
)


@dataclass
class Broker:
    """The active's broker, as RabbitMQ behaves for these operations."""

    queues: dict[str, str] = field(default_factory=dict)  # name -> item
    exchanges: dict[str, str] = field(default_factory=dict)
    bindings: dict[str, str] = field(default_factory=dict)  # item -> item

    def doc(self) -> dict[str, Any]:
        return {
            "queues": [json.loads(self.queues[n]) for n in sorted(self.queues)],
            "exchanges": [json.loads(self.exchanges[n]) for n in sorted(self.exchanges)],
            "bindings": [json.loads(b) for b in sorted(self.bindings)],
            "users": [{"name": "app"}],
        }

    def exists(self, kind: str, name: str) -> bool:
        if kind == "queue":
            return name in self.queues
        return name.startswith("amq.") or name in self.exchanges

    def do(self, op: str, a: int, b: int, c: int) -> tuple[str, str] | None:
        """Carry out an operation; the (op, item) the listener replicates, or
        None when the broker refused it."""
        if op == "queue.declare":
            name, item = QUEUES[a], queue_item(QUEUES[a], ARGS[c], durable=True, auto_delete=False)
            if self.queues.get(name, item) != item:
                return None  # 406: inequivalent arguments
            self.queues[name] = item
            return op, item
        if op == "exchange.declare":
            name = EXCHANGES[a % 2]
            kind = ("direct", "fanout", "topic")[c]
            item = exchange_item(name, kind, {}, durable=True, auto_delete=False, internal=False)
            if self.exchanges.get(name, item) != item:
                return None
            self.exchanges[name] = item
            return op, item
        if op == "queue.delete":
            self.queues.pop(QUEUES[a], None)
            self._unbind_all("queue", QUEUES[a])
            return op, name_item(QUEUES[a])
        if op == "exchange.delete":
            self.exchanges.pop(EXCHANGES[a % 2], None)
            self._unbind_all("exchange", EXCHANGES[a % 2])
            return op, name_item(EXCHANGES[a % 2])
        source = (*EXCHANGES, "amq.topic")[a % 3]
        to_queue = c % 2 == 0
        destination = QUEUES[b] if to_queue else EXCHANGES[b % 2]
        kind = "queue" if to_queue else "exchange"
        item = binding_item(source, destination, kind, f"k{c % 2}", {})
        if op == "bind":
            if not (self.exists("exchange", source) and self.exists(kind, destination)):
                return None  # 404
            self.bindings[item] = item
            return op, item
        assert op == "unbind"
        self.bindings.pop(item, None)
        return op, item

    def _unbind_all(self, kind: str, name: str) -> None:
        for key in list(self.bindings):
            b = json.loads(key)
            if (b["destination_type"] == kind and b["destination"] == name) or (
                kind == "exchange" and b["source"] == name
            ):
                del self.bindings[key]


TOPOLOGY = (
    "queue.declare",
    "exchange.declare",
    "queue.delete",
    "exchange.delete",
    "bind",
    "unbind",
)
STEP = st.tuples(
    st.sampled_from((*TOPOLOGY, *TOPOLOGY, "publish", "publish", "listing", "bypass")),
    st.integers(0, 2),
    st.integers(0, 2),
    st.integers(0, 2),
)


def comparable(doc: dict[str, Any]) -> dict[str, Any]:
    out = {k: doc.get(k) for k in ("queues", "exchanges", "users")}
    out["bindings"] = sorted(json.dumps(b, sort_keys=True) for b in doc["bindings"])
    return out


@dataclass
class History:
    """What the active did: its broker, the ledger's topology entries and
    publishes, and the listings it sent (index read, definitions read, a
    bypass came after it)."""

    broker: Broker = field(default_factory=Broker)
    stream: list[tuple[int, TopologyChanged]] = field(default_factory=list)
    publishes: list[tuple[int, str]] = field(default_factory=list)
    listings: list[list[Any]] = field(default_factory=list)

    @classmethod
    def of(cls, steps: list[tuple[str, int, int, int]]) -> History:
        h = cls()
        h.listings.append([0, h.broker.doc(), False])
        index = 0
        for op, a, b, c in steps:
            if op == "listing":  # the active reads its durable index, then the definitions
                h.listings.append([index, h.broker.doc(), False])
            elif op == "bypass":  # a declare or delete at the broker directly: not streamed
                h.broker.do("queue.declare" if c else "queue.delete", a, b, c)
                for listing in h.listings:
                    listing[2] = True
            elif op == "publish":
                if QUEUES[a] in h.broker.queues:
                    index += 1
                    h.publishes.append((index, QUEUES[a]))
            elif (done := h.broker.do(op, a, b, c)) is not None:
                index += 1
                h.stream.append((index, TopologyChanged("orders", *done)))
        return h

    def held(self, at: int, listing: dict[str, Any], below: int | None = None) -> dict[str, Any]:
        """What a standby holding this listing holds once it applied the
        stream up to ``below`` (exclusive; None: all of it)."""
        changes = [e for i, e in self.stream if i > at and (below is None or i < below)]
        return merge_definitions(listing, changes)


@settings(max_examples=400, deadline=None)
@given(st.lists(STEP, max_size=60), st.data())
def test_the_listing_and_the_changes_after_it_are_the_actives_topology(
    steps: list[tuple[str, int, int, int]], data: st.DataObject
) -> None:
    h = History.of(steps)
    # The standby holds the newest listing it received, which may be any one
    # of them (the listings and the stream race), and every change above it.
    at, listing, bypassed = data.draw(st.sampled_from(h.listings))
    if not bypassed:  # what bypasses the listener shows at the next listing only
        assert comparable(h.held(at, listing)) == comparable(h.broker.doc())


@settings(max_examples=300, deadline=None)
@given(st.lists(STEP, max_size=60))
def test_a_publish_is_never_applied_before_its_queues_declare(
    steps: list[tuple[str, int, int, int]],
) -> None:
    """A publish to a queue the listener declared finds it in what the
    standby holds at the publish's index, whichever listing it holds then."""
    h = History.of(steps)
    for p, queue in h.publishes:
        last = [e.op for i, e in h.stream if i < p and json.loads(e.item).get("name") == queue]
        if not last or last[-1] != "queue.declare":
            continue  # the queue came by a bypass, not through the listener
        for at, listing, _ in h.listings:
            if at < p:
                assert queue in {q["name"] for q in h.held(at, listing, below=p)["queues"]}


def test_a_listing_older_than_a_streamed_declare_or_delete_does_not_revert_it() -> None:
    listing = {"queues": [json.loads(queue_item("old", {}, durable=True, auto_delete=False))]}
    changes = [
        TopologyChanged("orders", "queue.delete", name_item("old")),
        TopologyChanged(
            "orders", "queue.declare", queue_item("new", {}, durable=True, auto_delete=False)
        ),
    ]
    merged = merge_definitions(listing, changes)
    assert [q["name"] for q in merged["queues"]] == ["new"]


def test_deleting_a_queue_or_an_exchange_drops_their_bindings_and_a_dangling_one_is_left_out() -> (
    None
):
    listing = {
        "queues": [{"name": "q", "durable": True, "auto_delete": False, "arguments": {}}],
        "exchanges": [{"name": "x", "type": "fanout", "durable": True, "auto_delete": False,
                       "internal": False, "arguments": {}}],
        "bindings": [
            json.loads(binding_item("x", "q", "queue", "", {})),
            json.loads(binding_item("amq.topic", "q", "queue", "#", {})),
        ],
        "policies": [{"name": "p"}],
    }  # fmt: skip
    merged = merge_definitions(
        listing, [TopologyChanged("orders", "exchange.delete", name_item("x"))]
    )
    assert [b["source"] for b in merged["bindings"]] == ["amq.topic"]
    assert merged["policies"] == [{"name": "p"}]
    merged = merge_definitions(listing, [TopologyChanged("orders", "queue.delete", name_item("q"))])
    assert merged["bindings"] == []
    bound_to_nothing = TopologyChanged("orders", "bind", binding_item("x", "gone", "queue", "", {}))
    assert len(merge_definitions(listing, [bound_to_nothing])["bindings"]) == 2


def test_streamed_deletions_name_only_what_the_definitions_do_not_hold_again() -> None:
    declare = TopologyChanged(
        "orders", "queue.declare", queue_item("q", {}, durable=True, auto_delete=False)
    )
    delete = TopologyChanged("orders", "queue.delete", name_item("q"))
    unbind = TopologyChanged("orders", "unbind", binding_item("amq.topic", "r", "queue", "k", {}))
    gone = merge_definitions({}, [declare, delete])
    assert streamed_deletions([declare, delete, unbind], gone) == [
        ("queue.delete", {"name": "q"}),
        ("unbind", json.loads(unbind.item)),
    ]
    back = merge_definitions({}, [delete, declare])
    assert streamed_deletions([delete, declare], back) == []


def test_arguments_take_the_json_the_management_api_shows() -> None:
    import datetime
    import decimal

    item = json.loads(
        queue_item(
            "q",
            {"b": b"bytes", "d": decimal.Decimal("1.5"), "t": datetime.datetime(2026, 1, 1),
             "l": [1, b"x"], "n": {"k": True}},
            durable=True,
            auto_delete=False,
        )
    )  # fmt: skip
    assert item["arguments"]["b"] == "bytes" and item["arguments"]["d"] == 1.5
    assert isinstance(item["arguments"]["t"], int) and item["arguments"]["l"] == [1, "x"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (TopologyChanged("orders", "queue.declare", "not json"), "not JSON"),
        (TopologyChanged("orders", "queue.declare", "[1]"), "not a JSON object"),
        (TopologyChanged("orders", "bind", '{"source": "x"}'), "no 'destination'"),
        (TopologyChanged("orders", "rename", '{"name": "x"}'), "unknown topology operation"),
    ],
)
def test_a_bad_item_is_a_clear_error(change: TopologyChanged, message: str) -> None:
    with pytest.raises(DefinitionsError, match=message):
        merge_definitions({}, [change])


def test_a_listing_that_is_not_the_definitions_shape_is_a_clear_error() -> None:
    with pytest.raises(DefinitionsError, match="'queues' is not a list of objects"):
        merge_definitions({"queues": {"q": 1}}, [])
