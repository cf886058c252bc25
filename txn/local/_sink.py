"""The listener's replication sink on a site that runs local transactions.

The replicator (``bridge.active``) ledgers events and holds confirms for
the standby; the coordinator runs a client's transaction as a two-phase
commit whose decision it records in that same ledger. This sink sits above
both and calls each downward, so no Protocol hides a call running upward:
a consumption passes the coordinator first (a committing transaction that
published the message is decided before the ack is ledgered), then the
replicator; a transaction goes to the coordinator.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from bridge import ConfirmKey, Consumed, DeadLettered, Event, LocalTransaction, VpnSettings
from bridge.active import Replicator

from ._coordinator import Coordinator

__all__ = ["TransactionalSink"]


class TransactionalSink:
    """The replicator and the coordinator as one sink (``plugin``'s
    ``ReplicationSink``, implemented structurally)."""

    def __init__(self, replicator: Replicator, coordinator: Coordinator) -> None:
        self.replicator = replicator
        self.coordinator = coordinator

    def configure(self, settings: VpnSettings, acked_index: int) -> None:
        """A VPN's (possibly changed) mode, timeout and policy, for both."""
        self.coordinator.configure(settings)
        self.replicator.configure(settings, acked_index)

    def append(self, event: Event, on_durable: Callable[[bool], None] | None) -> None:
        if isinstance(event, Consumed | DeadLettered):
            self.coordinator.before_consumed(event)  # a committing publish goes first
        self.replicator.append(event, on_durable)

    def append_many(
        self,
        events: Sequence[tuple[Event, ConfirmKey | None]],
        on_durable: Callable[[ConfirmKey, bool], None],
    ) -> None:
        for event, _ in events:
            if isinstance(event, Consumed | DeadLettered):
                self.coordinator.before_consumed(event)
        self.replicator.append_many(events, on_durable)

    def prepare(self, txn: LocalTransaction) -> Awaitable[None]:
        """Start ``txn``'s two-phase prepare, unless its VPN is fenced."""
        self.replicator.refuse_if_fenced(txn.vpn)
        return self.coordinator.prepare(txn)

    async def commit(self, txn: LocalTransaction) -> None:
        await self.coordinator.commit(txn)

    def commit_soon(
        self, txn: LocalTransaction, done: Callable[[BaseException | None], None]
    ) -> None:
        self.coordinator.commit_soon(txn, done)  # it answers in the standby's callback

    async def abort(self, txn: LocalTransaction) -> None:
        await self.coordinator.abort(txn)

    async def resolve(self, txn: LocalTransaction) -> None:
        await self.coordinator.resolve(txn)

    def next_index(self, vpn: str) -> int:
        return self.replicator.next_index(vpn)

    def full(self) -> bool:
        return self.replicator.full()

    async def wait_for_room(self) -> None:
        await self.replicator.wait_for_room()
