"""When a publish of a sync-mode VPN may be confirmed to its client (sans-IO).

One :class:`SyncGate` per VPN, time passed in: an entry durable in the
active's ledger waits (:meth:`SyncGate.wait`) until the standby acknowledges
it (:meth:`SyncGate.acked`, cumulative) or its deadline passes
(:meth:`SyncGate.expire`) and the VPN's policy decides. Under ``degrade`` the
gate reports sync-ineligible windows opening and closing
(:class:`WindowOpened`, :class:`WindowClosed`) and, ``recording``, holds a
window's confirms until its opening is recorded (:meth:`window_recorded`),
nacking one held :data:`HOLD_BOUND` seconds. Rules and reasons:
docs/behaviour.md, "When a client's publisher confirm is released" and
"Sync-ineligible windows". A window's ``first`` is exact because waits come
in ledger order: each is made in the ledger's durable callback of its index,
and a group waits once, at its last index, naming its first.

Invariants: a waiter is resolved exactly once; ``ok=True`` never reaches a
waiter of a sync-eligible ``reject`` VPN before the standby acknowledged its
index; and a recording gate gives ``ok=True`` past that index only once the
window holding it is recorded (or the VPN left sync mode, :meth:`release`).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from dataclasses import dataclass

from bridge._settings import SyncTimeoutPolicy

__all__ = ["SyncGate", "WindowClosed", "WindowOpened"]

log = logging.getLogger(__name__)

Resolve = Callable[[bool], None]

#: seconds a confirm may wait for its window's opening to be recorded before
#: it is nacked (the ledger's own bound on an unanswered store, ``answer_timeout``)
HOLD_BOUND = 10.0


@dataclass(frozen=True, slots=True)
class WindowOpened:
    """``vpn`` went sync-ineligible: indexes from ``first`` on are confirmed
    without the standby (once this is recorded, when the gate records)."""

    vpn: str
    first: int


@dataclass(frozen=True, slots=True)
class WindowClosed:
    """``vpn``'s window from ``first`` is over: ``last`` is the highest index
    confirmed without the standby (the catch-up index)."""

    vpn: str
    first: int
    last: int


@dataclass(slots=True)
class _Waiter:
    deadline: float
    resolve: Resolve
    first: int  # the first index of the group that waits at this index


class SyncGate:
    """Holds sync-mode confirms of one VPN until the standby acknowledges."""

    def __init__(
        self,
        vpn: str,
        timeout_ms: int,
        policy: SyncTimeoutPolicy,
        acked_index: int = 0,
        *,
        recording: bool = False,
    ) -> None:
        self.vpn = vpn
        self.timeout = timeout_ms / 1000.0
        self.policy = policy
        self.acked_index = acked_index
        #: hold a window's confirms until its opening is recorded
        self.recording = recording
        self.degradations = 0
        self.rejections = 0
        self._catch_up_to = 0  # ineligible until the standby acked this index
        self._waiting: dict[int, _Waiter] = {}  # index -> waiter, still unresolved
        self._by_index: list[int] = []  # heap of waiting indexes
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, index)
        #: the open window's first index; None while sync-eligible
        self._window: int | None = None
        #: the first index of the window whose opening is not recorded yet
        #: (its confirms are held); None when nothing waits for a record
        self._unrecorded: int | None = None
        #: (index, resolve, held since), in index order
        self._held: list[tuple[int, Resolve, float]] = []
        #: confirms nacked after :data:`HOLD_BOUND`
        #: (``vpnrepl_sync_confirms_nacked_unrecorded_total``)
        self.nacked_held = 0

    @property
    def eligible(self) -> bool:
        """Confirms wait for the standby (no window is open)."""
        return self._window is None

    @property
    def window_first(self) -> int | None:
        """The open window's first index (None: sync-eligible)."""
        return self._window

    def configure(self, timeout_ms: int, policy: SyncTimeoutPolicy) -> None:
        self.timeout = timeout_ms / 1000.0
        self.policy = policy

    def wait(self, index: int, now: float, resolve: Resolve, first: int | None = None) -> None:
        """``index`` is durable locally; resolve once the standby has it too.
        ``first``: the first index of the group whose confirms wait at
        ``index``, its last (default: ``index`` alone)."""
        if index <= self.acked_index:
            resolve(True)
            return
        if not self.eligible and self.policy is SyncTimeoutPolicy.DEGRADE:
            low = max(self.acked_index + 1, index if first is None else first)
            if low < (self._window or 0):
                log.error(
                    "VPN %s: index %d confirmed without the standby below its window's first "
                    "index %d (a wait out of ledger order)",
                    self.vpn,
                    low,
                    self._window,
                )
            self._catch_up_to = max(self._catch_up_to, index)
            self._confirm(index, resolve, now)
            return
        deadline = now + self.timeout
        self._waiting[index] = _Waiter(deadline, resolve, index if first is None else first)
        heapq.heappush(self._by_index, index)
        heapq.heappush(self._deadlines, (deadline, index))

    def _confirm(self, index: int, resolve: Resolve, now: float) -> None:
        """Confirm ``index`` without the standby: now, or once the window's
        opening is recorded."""
        if self._unrecorded is not None:
            self._held.append((index, resolve, now))
        else:
            resolve(True)

    def acked(self, index: int) -> WindowClosed | None:
        """The standby has durably applied everything up to ``index``; the
        window that closed with it, if any."""
        if index <= self.acked_index:
            return None
        self.acked_index = index
        while self._by_index and self._by_index[0] <= index:
            waiter = self._waiting.pop(heapq.heappop(self._by_index), None)
            if waiter is not None:
                waiter.resolve(True)
        self._forget_if_idle()
        if self._held and self._held[0][0] <= index:  # the standby has them after all
            acknowledged = [h for h in self._held if h[0] <= index]
            self._held = [h for h in self._held if h[0] > index]
            for _, resolve, _ in acknowledged:
                resolve(True)
        if self._window is None or index < self._catch_up_to:
            return None
        closed = WindowClosed(self.vpn, self._window, self._catch_up_to)
        self._window = self._unrecorded = None  # nothing is held any more
        log.info("VPN %s: standby caught up at index %d; sync-eligible again", self.vpn, index)
        return closed

    def window_recorded(self, first: int) -> None:
        """The opening of the window from ``first`` is durable: its held
        confirms go out. (An opening recorded after its window closed, or
        another window's, releases nothing.)"""
        if self._unrecorded != first:
            return
        self._unrecorded = None
        held, self._held = self._held, []
        for _, resolve, _ in held:
            resolve(True)

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

    def expire(self, now: float) -> WindowOpened | None:
        """Apply the timeout policy to every waiter whose own deadline passed;
        the window this opened, if any.

        Deadlines of waiters the standby acknowledged in time are skipped: only
        a publish still waiting at its deadline is a timeout.
        """
        self._nack_held_past(now - HOLD_BOUND)
        timed_out: list[int] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, index = heapq.heappop(self._deadlines)
            if index in self._waiting:
                timed_out.append(index)
        if not timed_out:
            return None
        if self.policy is SyncTimeoutPolicy.REJECT:
            for index in timed_out:
                self._waiting.pop(index).resolve(False)
                self.rejections += 1
            return None
        # degrade: everything waiting is confirmed now, the VPN goes ineligible
        opened = None
        if self._window is None:
            self.degradations += 1
            log.warning(
                "VPN %s: standby did not acknowledge index %d within %.0f ms; "
                "confirming without it (sync-ineligible until it catches up)",
                self.vpn,
                min(timed_out),
                self.timeout * 1000,
            )
            lowest = min(waiter.first for waiter in self._waiting.values())
            self._window = max(self.acked_index + 1, lowest)
            if self.recording:
                self._unrecorded = self._window
            opened = WindowOpened(self.vpn, self._window)
        self._catch_up_to = max(self._catch_up_to, max(self._waiting))
        waiting, self._waiting, self._by_index, self._deadlines = self._waiting, {}, [], []
        for index in sorted(waiting):
            self._confirm(index, waiting[index].resolve, now)
        return opened

    def _nack_held_past(self, since: float) -> None:
        """Nack each confirm held since before ``since``: the opening of
        its window was not recorded in time, and without that record it
        may not be confirmed. Its entry stays in the ledger (a client that
        publishes it again may make a duplicate, as after any nack)."""
        if not self._held or self._held[0][2] >= since:  # held in time order
            return
        late = [h for h in self._held if h[2] < since]
        self._held = [h for h in self._held if h[2] >= since]
        self.nacked_held += len(late)
        log.warning(
            "VPN %s: %d confirms waited %.0f s for the record of the sync-ineligible window "
            "from index %s: nacked",
            self.vpn,
            len(late),
            HOLD_BOUND,
            self._unrecorded,
        )
        for _, resolve, _ in late:
            resolve(False)

    def release(self) -> WindowClosed | None:
        """The VPN left sync mode: what waits for the standby is confirmed
        now, as the async mode it is in would (each entry is durable here);
        an open window closes at its catch-up index. Confirms held for a
        window's opening still wait for :meth:`window_recorded`: they were
        given under the sync promise."""
        waiting, self._waiting, self._by_index, self._deadlines = self._waiting, {}, [], []
        for waiter in waiting.values():
            waiter.resolve(True)
        if self._window is None:
            return None
        closed = WindowClosed(self.vpn, self._window, self._catch_up_to)
        self._window = None
        return closed

    def next_deadline(self) -> float | None:
        """When :meth:`expire` has something to do next: a waiter's
        deadline, or the oldest held confirm's bound."""
        times = [self._deadlines[0][0]] if self._deadlines else []
        if self._held:
            times.append(self._held[0][2] + HOLD_BOUND)  # held in time order
        return min(times, default=None)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def held(self) -> int:
        """Confirms held until their window's opening is recorded."""
        return len(self._held)
