"""The active site's replication sink: what the listener hands its events to.

A client's confirm of a replicated publish is released when the broker has
confirmed it (the listener's part) **and** the entry is durable in the ledger
(:class:`~bridge._ledger.LedgerWriter` reports it after its commit) **and**,
for a VPN in sync mode, the standby has acknowledged the entry or the sync
timeout applied the VPN's policy (:class:`~bridge._syncgate.SyncGate`).
Nothing here ever reports an entry durable before the ledger did, so a
confirmed message is always in the active's ledger, from which a standby can
be brought up to date.

A VPN whose epoch was overtaken by a promoted standby is *fenced*: its
publishes are nacked (the listener closes nothing; the client sees nacks and
``status`` says ``fenced``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from plugin._events import Event, LocalTransaction, ReplicationSink, TransactionRefused
from plugin._vpn import Mode, VpnSettings

from ._ledger import LedgerError, LedgerWriter
from ._syncgate import SyncGate

__all__ = ["Replicator"]

log = logging.getLogger(__name__)

_TICK = 0.005  # how often sync deadlines are checked


class Replicator(ReplicationSink):
    """Ledger first, then (sync mode) the standby, then the client's confirm."""

    def __init__(self, writer: LedgerWriter) -> None:
        self.writer = writer
        self.gates: dict[str, SyncGate] = {}
        self.fenced: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def configure(self, settings: VpnSettings, acked_index: int) -> None:
        """Apply a VPN's (possibly changed) mode, timeout and policy."""
        gate = self.gates.get(settings.name)
        if settings.mode is Mode.ASYNC:
            self.gates.pop(settings.name, None)
        elif gate is None:
            self.gates[settings.name] = SyncGate(
                settings.name, settings.sync_timeout_ms, settings.on_sync_timeout, acked_index
            )
        else:
            gate.configure(settings.sync_timeout_ms, settings.on_sync_timeout)

    def standby_acked(self, vpn: str, index: int) -> None:
        gate = self.gates.get(vpn)
        if gate is not None:
            gate.acked(index)

    def sync_eligible(self, vpn: str) -> bool:
        gate = self.gates.get(vpn)
        return gate is None or gate.eligible

    def start(self) -> None:
        self._task = asyncio.create_task(self._expire_loop(), name="sync-deadlines")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _expire_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(_TICK)
            now = loop.time()
            for gate in self.gates.values():
                gate.expire(now)

    # -- ReplicationSink ------------------------------------------------------

    def append(self, event: Event, on_durable: Callable[[bool], None] | None) -> None:
        if event.vpn in self.fenced:
            if on_durable is not None:
                on_durable(False)
            return
        gate = self.gates.get(event.vpn)
        if on_durable is None or gate is None:
            self._append(event, on_durable)
            return
        loop = asyncio.get_running_loop()
        index = 0

        def ledger_durable(ok: bool) -> None:
            if not ok:
                on_durable(False)
            else:
                gate.wait(index, loop.time(), on_durable)

        index = self._append(event, ledger_durable)

    def _append(self, event: Event, on_durable: Callable[[bool], None] | None) -> int:
        try:
            return self.writer.append(event, on_durable).index
        except LedgerError as e:
            log.error("VPN %s: event not replicated: %s", event.vpn, e)
            if on_durable is not None:
                on_durable(False)
            return 0

    def full(self) -> bool:
        return self.writer.full()

    async def wait_for_room(self) -> None:
        await self.writer.wait_for_room()

    async def prepare(self, txn: LocalTransaction) -> None:
        if txn.vpn in self.fenced:
            raise TransactionRefused(f"VPN {txn.vpn!r} is fenced: a standby was promoted")

    async def commit(self, txn: LocalTransaction) -> None:
        """Ledger the transaction's events and wait as a confirm would."""
        loop = asyncio.get_running_loop()
        outcomes: list[asyncio.Future[bool]] = []
        for event in txn.events:
            done: asyncio.Future[bool] = loop.create_future()
            outcomes.append(done)
            self.append(event, _settle(done))
        results = await asyncio.gather(*outcomes)
        if not all(results):
            log.error(
                "VPN %s: transaction %s committed at the broker but not replicated",
                txn.vpn,
                txn.txid,
            )

    async def abort(self, txn: LocalTransaction) -> None:
        return None


def _settle(future: asyncio.Future[bool]) -> Callable[[bool], None]:
    def settle(ok: bool) -> None:
        if not future.done():
            future.set_result(ok)

    return settle
