"""The active site's replication sink: what the listener hands its events to.

A client's confirm of a replicated publish is released when the broker
confirmed it, the entry is durable in the ledger
(:class:`~bridge.ledger._writer.LedgerWriter`) and, in sync mode, the
standby acknowledged it or the timeout's policy applied
(:class:`~bridge.active._syncgate.SyncGate`; docs/behaviour.md, "When a
client's publisher confirm is released"). Nothing here reports an entry
durable before the ledger did, so a confirmed message is always in the
ledger a standby is brought up to date from. Sync-ineligible windows, a
gate's and those of transactions confirmed without the standby
(:meth:`Replicator.confirmed_without_standby`, before their answer), are
written by a :class:`~bridge.active._window_recorder.WindowRecorder`. A
fenced VPN's publishes are nacked.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from bridge._events import (
    ConfirmKey,
    Event,
    TransactionRefused,
)
from bridge._settings import Mode, VpnSettings
from bridge.ledger import LedgerError, LedgerWriter, UnstorableEvent

from ._syncgate import SyncGate, WindowClosed, WindowOpened
from ._window_recorder import WindowRecorder

__all__ = ["Replicator", "commit_in_task"]

log = logging.getLogger(__name__)

#: sync deadlines closer together than this are checked in one wake-up
_TICK = 0.005

#: commits under way in :func:`commit_in_task` (the loop keeps only weak
#: references to tasks)
_COMMITTING: set[asyncio.Task[None]] = set()


def commit_in_task(
    commit: Coroutine[Any, Any, None], done: Callable[[BaseException | None], None]
) -> None:
    """Run ``commit`` in a task and report its end through ``done(error)``
    (``None``: committed): a sink's ``commit_soon`` for a sink whose commit
    is awaited, not learnt in a callback."""
    task = asyncio.ensure_future(commit)
    _COMMITTING.add(task)

    def finished(task: asyncio.Task[None]) -> None:
        _COMMITTING.discard(task)
        done(asyncio.CancelledError() if task.cancelled() else task.exception())

    task.add_done_callback(finished)


class Replicator:
    """Ledger first, then (sync mode) the standby, then the client's confirm.

    The events half of the listener's replication sink; ``txn``'s
    ``TransactionalSink`` adds local transactions on top of it."""

    def __init__(self, writer: LedgerWriter, windows: WindowRecorder | None = None) -> None:
        self.writer = writer
        #: records the gates' windows; without one (tests of the sink
        #: alone) nothing is recorded and no confirm is held for a record
        self.windows = windows
        self.gates: dict[str, SyncGate] = {}
        self.fenced: set[str] = set()
        #: checks the sync deadlines when the earliest passes; None while no
        #: publish waits for the standby (no wake-ups on an idle or async
        #: site, nor on a standby)
        self._timer: asyncio.TimerHandle | None = None

    def configure(self, settings: VpnSettings, acked_index: int) -> None:
        """Apply a VPN's (possibly changed) mode, timeout and policy."""
        gate = self.gates.get(settings.name)
        if settings.mode is Mode.ASYNC:
            if gate is not None:
                del self.gates[settings.name]
                # no confirm is left waiting for a gate gone; its window ends
                self._closed(gate.release())
                self._disarm_if_idle()
        elif gate is None:
            self.gates[settings.name] = SyncGate(
                settings.name,
                settings.sync_timeout_ms,
                settings.on_sync_timeout,
                acked_index,
                recording=self.windows is not None,
            )
        else:
            gate.configure(settings.sync_timeout_ms, settings.on_sync_timeout)

    def standby_acked(self, vpn: str, index: int) -> None:
        gate = self.gates.get(vpn)
        if gate is not None:
            self._closed(gate.acked(index))
            self._disarm_if_idle()

    def _opened(self, gate: SyncGate, opened: WindowOpened | None) -> None:
        """Record a window the gate opened; the gate holds its confirms
        until then."""
        if opened is None or self.windows is None:
            return
        first = opened.first
        self.windows.open_window(opened.vpn, first, lambda: gate.window_recorded(first))

    def _closed(self, closed: WindowClosed | None) -> None:
        """Record the end of a window (no confirm waits for it)."""
        if closed is not None and self.windows is not None:
            self.windows.close_window(closed.vpn, closed.first, closed.last)

    def confirmed_without_standby(
        self, vpn: str, first: int, last: int, then: Callable[[], None]
    ) -> bool:
        """Record ``first``..``last`` of ``vpn`` as a window (a transaction
        the coordinator degraded) and call ``then()`` once durable; False,
        and no call, when nothing records windows here."""
        if self.windows is None:
            return False
        self.windows.add_window(vpn, first, last, then)
        return True

    def _disarm_if_idle(self) -> None:
        if self._timer is not None and not any(g.waiting for g in self.gates.values()):
            self._timer.cancel()  # nothing left to time out
            self._timer = None

    def wait_standby(
        self, vpn: str, index: int, resolve: Callable[[bool], None], first: int | None = None
    ) -> bool:
        """Resolve once the standby acknowledged ``index`` (or the sync
        timeout passed: ``resolve(False)``); False if ``vpn`` is not in sync
        mode (nothing to wait for). ``first``: the first index of the group
        that waits at ``index``. Called in the ledger's durable callback of
        ``index`` (so in index order, which the gate's windows rely on)."""
        gate = self.gates.get(vpn)
        if gate is None:
            return False
        self._wait(gate, index, resolve, first)
        return True

    def withdraw(self, vpn: str, index: int) -> None:
        """Stop a :meth:`wait_standby` for ``index`` (it never resolves)."""
        gate = self.gates.get(vpn)
        if gate is not None:
            gate.withdraw(index)
            self._disarm_if_idle()

    def sync_eligible(self, vpn: str) -> bool:
        gate = self.gates.get(vpn)
        return gate is None or gate.eligible

    def sync_counts(self) -> dict[str, tuple[int, int]]:
        """Per sync-mode VPN, since this node started (a VPN switched to
        async loses its counts): how often its sync timeout made it
        ineligible, and how many confirms were nacked waiting for the record
        of a window's opening."""
        return {vpn: (gate.degradations, gate.nacked_held) for vpn, gate in self.gates.items()}

    def start(self) -> None:
        """Nothing runs until a publish waits for the standby (:meth:`_wait`)."""

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wait(
        self,
        gate: SyncGate,
        index: int,
        resolve: Callable[[bool], None],
        first: int | None = None,
    ) -> None:
        """``gate.wait``, with the deadline check armed for it (the gate's
        earliest deadline, a heap's top: no scan of the gates per publish)."""
        loop = asyncio.get_running_loop()
        gate.wait(index, loop.time(), resolve, first)
        deadline = gate.next_deadline()
        if deadline is not None:
            self._arm(loop, deadline)

    def _arm(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """Make sure the deadline check runs by ``deadline`` (at least a tick
        from now, so a burst of deadlines is one wake-up)."""
        when = max(deadline, loop.time() + _TICK)
        if self._timer is not None:
            if self._timer.when() <= when:
                return
            self._timer.cancel()
        self._timer = loop.call_at(when, self._expire, loop)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        for gate in list(self.gates.values()):
            try:
                self._opened(gate, gate.expire(now))
            except Exception:
                log.exception("VPN %s: applying the sync timeout failed", gate.vpn)
            deadline = gate.next_deadline()
            if deadline is not None:
                self._arm(loop, deadline)

    # -- the listener's sink ---------------------------------------------------

    def append(self, event: Event, on_durable: Callable[[bool], None] | None) -> None:
        if event.vpn in self.fenced:
            if on_durable is not None:
                on_durable(False)
            return
        gate = self.gates.get(event.vpn)
        if on_durable is None or gate is None:
            self._append(event, on_durable)
            return
        index = 0

        def ledger_durable(ok: bool) -> None:
            if not ok:
                on_durable(False)
            else:
                self._wait(gate, index, on_durable)

        index = self._append(event, ledger_durable)

    def append_many(
        self,
        events: Sequence[tuple[Event, ConfirmKey | None]],
        on_durable: Callable[[ConfirmKey, bool], None],
    ) -> None:
        """One read's events of one VPN as one ledger group with one callback
        (and, in sync mode, one waiter at its last index): the listener's
        confirms of the group are released together, as each would be."""
        vpn = events[0][0].vpn if events else ""
        if not events or any(event.vpn != vpn for event, _ in events):
            self._one_by_one(events, on_durable)
            return
        keys = [key for _, key in events if key is not None]

        def settle(ok: bool) -> None:
            for key in keys:
                on_durable(key, ok)

        if vpn in self.fenced:
            settle(False)
            return
        gate = self.gates.get(vpn)
        callback: Callable[[bool], None] | None = settle if keys else None
        last: list[int] = []  # the group's last index, once appended
        if callback is not None and gate is not None:
            callback = self._then_standby(gate, last, len(events), settle)
        try:
            last.append(self.writer.append_many([event for event, _ in events], callback).index)
        except UnstorableEvent:
            self._one_by_one(events, on_durable)  # only the bad one is refused
        except LedgerError as e:
            log.error("VPN %s: %d events not replicated: %s", vpn, len(events), e)
            settle(False)

    def _one_by_one(
        self,
        events: Sequence[tuple[Event, ConfirmKey | None]],
        on_durable: Callable[[ConfirmKey, bool], None],
    ) -> None:
        for event, key in events:
            self.append(event, None if key is None else functools.partial(on_durable, key))

    def _then_standby(
        self, gate: SyncGate, last: list[int], size: int, settle: Callable[[bool], None]
    ) -> Callable[[bool], None]:
        """A ledger callback that hands a durable group of ``size`` entries
        to the sync gate."""

        def ledger_durable(ok: bool) -> None:
            if not ok:
                settle(False)
            else:
                self._wait(gate, last[0], settle, last[0] - size + 1)

        return ledger_durable

    def _append(self, event: Event, on_durable: Callable[[bool], None] | None) -> int:
        try:
            return self.writer.append(event, on_durable).index
        except LedgerError as e:
            log.error("VPN %s: event not replicated: %s", event.vpn, e)
            if on_durable is not None:
                on_durable(False)
            return 0

    def next_index(self, vpn: str) -> int:
        """The ledger index the next event of ``vpn`` takes (0: not known)."""
        return self.writer.next_index(vpn)

    def full(self) -> bool:
        return self.writer.full()

    async def wait_for_room(self) -> None:
        await self.writer.wait_for_room()

    def refuse_if_fenced(self, vpn: str) -> None:
        """Raise :class:`TransactionRefused` if ``vpn`` is fenced here."""
        if vpn in self.fenced:
            raise TransactionRefused(f"VPN {vpn!r} is fenced: a standby was promoted")
