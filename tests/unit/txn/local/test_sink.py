"""The transactional sink: what drives the coordinator sits above it and
above the replicator, and calls each in the order the ledger needs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, cast

import pytest

from bridge import (
    ConfirmKey,
    Consumed,
    Event,
    LocalTransaction,
    Published,
    ReplicationId,
    TransactionRefused,
    VpnSettings,
)
from bridge.active import Replicator
from txn.local import Coordinator, TransactionalSink


class Calls:
    """The order the sink called its two parts in."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []


class FakeReplicator:
    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.fenced: set[str] = set()

    def configure(self, settings: VpnSettings, acked_index: int) -> None:
        self.calls.log.append(("replicator.configure", acked_index))

    def append(self, event: Event, on_durable: Callable[[bool], None] | None) -> None:
        self.calls.log.append(("replicator.append", event))

    def append_many(
        self,
        events: Sequence[tuple[Event, ConfirmKey | None]],
        on_durable: Callable[[ConfirmKey, bool], None],
    ) -> None:
        self.calls.log.append(("replicator.append_many", len(events)))

    def refuse_if_fenced(self, vpn: str) -> None:
        if vpn in self.fenced:
            raise TransactionRefused(f"VPN {vpn!r} is fenced")


class FakeCoordinator:
    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    def configure(self, settings: VpnSettings) -> None:
        self.calls.log.append(("coordinator.configure", settings.name))

    def before_consumed(self, event: Consumed) -> None:
        self.calls.log.append(("coordinator.before_consumed", event))

    async def prepare(self, txn: LocalTransaction) -> None:
        self.calls.log.append(("coordinator.prepare", txn.vpn))

    async def commit(self, txn: LocalTransaction) -> None:
        self.calls.log.append(("coordinator.commit", txn.vpn))

    async def abort(self, txn: LocalTransaction) -> None:
        self.calls.log.append(("coordinator.abort", txn.vpn))


def _sink() -> tuple[TransactionalSink, Calls, FakeReplicator]:
    calls = Calls()
    replicator = FakeReplicator(calls)
    sink = TransactionalSink(
        cast(Replicator, replicator), cast(Coordinator, FakeCoordinator(calls))
    )
    return sink, calls, replicator


def _ack(n: int) -> Consumed:
    return Consumed("orders", ReplicationId.from_parts(1, n), "q")


def _publish(n: int) -> Published:
    return Published("orders", ReplicationId.from_parts(1, n), "", "q", ("q",), b"", b"")


def test_a_consumption_passes_the_coordinator_before_the_ledger() -> None:
    """A committing transaction that published the acked message is decided
    first, so the ledger holds the publish before the ack."""
    sink, calls, _ = _sink()
    sink.append(_ack(1), None)
    sink.append(_publish(2), None)
    assert calls.log == [
        ("coordinator.before_consumed", _ack(1)),
        ("replicator.append", _ack(1)),
        ("replicator.append", _publish(2)),
    ]


def test_a_read_of_events_passes_each_consumption_first_then_goes_as_one_group() -> None:
    sink, calls, _ = _sink()
    sink.append_many([(_publish(1), None), (_ack(2), None), (_ack(3), None)], lambda k, ok: None)
    assert calls.log == [
        ("coordinator.before_consumed", _ack(2)),
        ("coordinator.before_consumed", _ack(3)),
        ("replicator.append_many", 3),
    ]


def test_settings_reach_both_and_transactions_reach_the_coordinator() -> None:
    sink, calls, _ = _sink()
    sink.configure(VpnSettings.from_args("orders", "active", "sync"), acked_index=7)
    txn = LocalTransaction("orders", 1, 1, 1, (_publish(1),))
    asyncio.run(sink.prepare(txn))
    asyncio.run(sink.commit(txn))
    asyncio.run(sink.abort(txn))
    assert calls.log == [
        ("coordinator.configure", "orders"),
        ("replicator.configure", 7),
        ("coordinator.prepare", "orders"),
        ("coordinator.commit", "orders"),
        ("coordinator.abort", "orders"),
    ]


def test_a_fenced_vpn_refuses_a_transaction_before_the_coordinator_hears_of_it() -> None:
    sink, calls, replicator = _sink()
    replicator.fenced.add("orders")
    with pytest.raises(TransactionRefused, match="fenced"):
        sink.prepare(LocalTransaction("orders", 1, 1, 1, (_publish(1),)))
    assert calls.log == []
