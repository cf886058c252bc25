"""When a publish of a sync-mode VPN may be confirmed to its client.

A ``SyncGate`` per VPN; no I/O, time is passed in. An entry durable in the
active's ledger waits (:meth:`SyncGate.wait`) until the standby has reported
it durable (:meth:`SyncGate.acked`, cumulative) or its deadline passes
(:meth:`SyncGate.expire`). Then the VPN's ``on-sync-timeout`` policy decides:

* ``degrade`` — confirm, and mark the VPN *sync-ineligible*: until the standby
  has acknowledged everything up to the newest entry that was waiting when it
  fell behind, new entries are confirmed as soon as they are durable locally
  (async behaviour), because making every client wait a full timeout per
  message while the standby is known to be away would stall the site. Once
  the standby has caught up, the VPN is eligible again.
* ``reject`` — nack that publish. Every publish waits its own timeout: a
  client that asked for "no confirm without the standby" gets exactly that.

Invariant: a waiter is resolved exactly once, and ``ok=True`` is never given
to a waiter of a sync-eligible ``reject`` VPN unless the standby acknowledged
its index.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ._settings import SyncTimeoutPolicy

__all__ = ["SyncGate"]

log = logging.getLogger(__name__)

Resolve = Callable[[bool], None]


@dataclass(slots=True)
class _Waiter:
    deadline: float
    resolve: Resolve


class SyncGate:
    """Holds sync-mode confirms of one VPN until the standby acknowledges."""

    def __init__(
        self, vpn: str, timeout_ms: int, policy: SyncTimeoutPolicy, acked_index: int = 0
    ) -> None:
        self.vpn = vpn
        self.timeout = timeout_ms / 1000.0
        self.policy = policy
        self.acked_index = acked_index
        self.eligible = True
        self.degradations = 0
        self.rejections = 0
        self._catch_up_to = 0  # ineligible until the standby acked this index
        self._waiting: dict[int, _Waiter] = {}  # index -> waiter, still unresolved
        self._by_index: list[int] = []  # heap of waiting indexes
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, index)

    def configure(self, timeout_ms: int, policy: SyncTimeoutPolicy) -> None:
        self.timeout = timeout_ms / 1000.0
        self.policy = policy

    def wait(self, index: int, now: float, resolve: Resolve) -> None:
        """``index`` is durable locally; resolve once the standby has it too."""
        if index <= self.acked_index:
            resolve(True)
            return
        if not self.eligible and self.policy is SyncTimeoutPolicy.DEGRADE:
            self._catch_up_to = max(self._catch_up_to, index)
            resolve(True)
            return
        deadline = now + self.timeout
        self._waiting[index] = _Waiter(deadline, resolve)
        heapq.heappush(self._by_index, index)
        heapq.heappush(self._deadlines, (deadline, index))

    def acked(self, index: int) -> None:
        """The standby has durably applied everything up to ``index``."""
        if index <= self.acked_index:
            return
        self.acked_index = index
        while self._by_index and self._by_index[0] <= index:
            waiter = self._waiting.pop(heapq.heappop(self._by_index), None)
            if waiter is not None:
                waiter.resolve(True)
        self._forget_if_idle()
        if not self.eligible and index >= self._catch_up_to:
            self.eligible = True
            log.info("VPN %s: standby caught up at index %d; sync-eligible again", self.vpn, index)

    def withdraw(self, index: int) -> None:
        """Stop waiting for ``index`` without resolving it: its owner learned
        another way that the standby has it (a transaction the standby
        committed early). Its deadline is no timeout any more."""
        if self._waiting.pop(index, None) is not None:
            self._forget_if_idle()

    def _forget_if_idle(self) -> None:
        """With nothing waiting, the heaps hold only entries of waiters that
        were acknowledged or withdrawn: drop them (no deadline is left)."""
        if not self._waiting:
            self._by_index.clear()
            self._deadlines.clear()

    def expire(self, now: float) -> None:
        """Apply the timeout policy to every waiter whose own deadline passed.

        Deadlines of waiters the standby acknowledged in time are skipped: only
        a publish still waiting at its deadline is a timeout.
        """
        timed_out: list[int] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, index = heapq.heappop(self._deadlines)
            if index in self._waiting:
                timed_out.append(index)
        if not timed_out:
            return
        if self.policy is SyncTimeoutPolicy.REJECT:
            for index in timed_out:
                self._waiting.pop(index).resolve(False)
                self.rejections += 1
            return
        # degrade: everything waiting is confirmed now, the VPN goes ineligible
        if self.eligible:
            self.degradations += 1
            log.warning(
                "VPN %s: standby did not acknowledge index %d within %.0f ms; "
                "confirming without it (sync-ineligible until it catches up)",
                self.vpn,
                min(timed_out),
                self.timeout * 1000,
            )
        self.eligible = False
        self._catch_up_to = max(self._catch_up_to, max(self._waiting))
        waiting, self._waiting, self._by_index, self._deadlines = self._waiting, {}, [], []
        for waiter in waiting.values():
            waiter.resolve(True)

    def release(self) -> None:
        """The VPN left sync mode: what waits for the standby is confirmed
        now, as the async mode it is in would (each entry is durable here)."""
        waiting, self._waiting, self._by_index, self._deadlines = self._waiting, {}, [], []
        for waiter in waiting.values():
            waiter.resolve(True)

    def next_deadline(self) -> float | None:
        return self._deadlines[0][0] if self._deadlines else None

    @property
    def waiting(self) -> int:
        return len(self._waiting)
