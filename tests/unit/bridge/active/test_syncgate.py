"""Sync-mode confirm gating (no servers, time passed in)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from bridge import SyncTimeoutPolicy, VpnSettings
from bridge.active import Replicator, SyncGate, WindowClosed, WindowOpened, WindowRecorder
from bridge.ledger import LedgerWriter

DEGRADE, REJECT = SyncTimeoutPolicy.DEGRADE, SyncTimeoutPolicy.REJECT


class Outcomes(dict[int, bool]):
    def resolver(self, index: int):
        def resolve(ok: bool) -> None:
            assert index not in self, f"index {index} resolved twice"
            self[index] = ok

        return resolve


def test_confirms_wait_for_the_standby_ack() -> None:
    gate, out = SyncGate("v", 1000, REJECT), Outcomes()
    for i in (1, 2, 3):
        gate.wait(i, 0.0, out.resolver(i))
    assert out == {}
    gate.acked(2)
    assert out == {1: True, 2: True}
    gate.acked(3)
    assert out == {1: True, 2: True, 3: True}
    gate.expire(5.0)  # nothing left to expire
    assert gate.rejections == 0


def test_already_acknowledged_index_confirms_at_once() -> None:
    gate, out = SyncGate("v", 1000, REJECT, acked_index=10), Outcomes()
    gate.wait(9, 0.0, out.resolver(9))
    assert out == {9: True}


def test_reject_nacks_each_publish_after_its_own_timeout() -> None:
    gate, out = SyncGate("v", 500, REJECT), Outcomes()
    gate.wait(1, 0.0, out.resolver(1))
    gate.wait(2, 0.4, out.resolver(2))
    gate.expire(0.45)
    assert out == {}
    gate.expire(0.5)
    assert out == {1: False}
    gate.acked(2)  # in time for the second
    assert out == {1: False, 2: True}
    assert gate.rejections == 1 and gate.eligible


def test_degrade_confirms_goes_ineligible_and_recovers_after_catch_up() -> None:
    gate, out = SyncGate("v", 500, DEGRADE), Outcomes()
    gate.wait(1, 0.0, out.resolver(1))
    gate.wait(2, 0.1, out.resolver(2))
    gate.expire(0.5)
    assert out == {1: True, 2: True}  # everything waiting is confirmed
    assert not gate.eligible and gate.degradations == 1
    gate.wait(3, 0.6, out.resolver(3))  # ineligible: confirmed without waiting
    assert out[3] is True
    gate.acked(2)
    assert not gate.eligible  # not caught up with index 3 yet
    gate.acked(3)
    assert gate.eligible
    gate.wait(4, 1.0, out.resolver(4))
    assert 4 not in out  # eligible again: waits for the standby
    gate.acked(4)
    assert out[4] is True and gate.degradations == 1


def test_next_deadline_tells_the_driver_when_to_call_expire() -> None:
    gate, out = SyncGate("v", 250, REJECT), Outcomes()
    assert gate.next_deadline() is None
    gate.wait(1, 1.0, out.resolver(1))
    assert gate.next_deadline() == 1.25


def test_a_deadline_of_an_acknowledged_index_is_not_a_timeout() -> None:
    gate, out = SyncGate("orders", 1500, DEGRADE), Outcomes()
    gate.wait(1, 0.0, out.resolver(1))
    gate.acked(1)  # the standby acknowledged index 1 in time
    gate.wait(2, 1.4, out.resolver(2))  # index 2's own deadline is 2.9
    gate.expire(1.5)  # only index 1's (answered) deadline has passed
    assert out == {1: True}
    assert gate.eligible and gate.degradations == 0
    gate.expire(2.9)
    assert out == {1: True, 2: True} and not gate.eligible  # now a real timeout


def test_no_waiter_at_all_never_degrades() -> None:
    gate, out = SyncGate("orders", 1000, DEGRADE), Outcomes()
    gate.wait(1, 0.0, out.resolver(1))
    gate.acked(1)
    gate.expire(1.6)
    assert gate.eligible and gate.degradations == 0


def test_deadlines_of_acknowledged_waiters_are_dropped_when_nothing_waits() -> None:
    gate, out = SyncGate("v", 250, REJECT), Outcomes()
    gate.wait(1, 1.0, out.resolver(1))
    gate.wait(2, 1.1, out.resolver(2))
    gate.acked(1)
    assert gate.next_deadline() == 1.25  # index 2 still waits: kept, expire skips it
    gate.acked(2)
    assert gate.next_deadline() is None  # no wake-up is due for answered publishes


def test_a_withdrawn_waiter_never_resolves_and_its_deadline_is_no_timeout() -> None:
    """A transaction the standby committed early leaves the
    gate when that answer comes: its late acknowledgement is no timeout."""
    for policy in (DEGRADE, REJECT):
        gate, out = SyncGate("v", 250, policy), Outcomes()
        gate.wait(1, 1.0, out.resolver(1))
        gate.wait(2, 1.1, out.resolver(2))
        gate.withdraw(1)
        assert gate.waiting == 1 and gate.next_deadline() is not None  # 2 still waits
        gate.expire(1.3)  # past 1's deadline, not 2's
        assert out == {} and gate.eligible
        assert gate.degradations == gate.rejections == 0
        gate.withdraw(2)
        assert gate.next_deadline() is None  # nothing to wake up for
        gate.acked(2)
        assert out == {}  # withdrawn: resolved by no one


# ---------------------------------------------------------------- windows


def test_a_recording_gate_holds_a_windows_confirms_until_its_opening_is_recorded() -> None:
    """A crash right after a confirm given without the standby must leave
    that index inside a recorded window: nothing of the window goes out
    before the owner says its opening is durable."""
    gate, out = SyncGate("v", 500, DEGRADE, recording=True), Outcomes()
    for i in (1, 2, 3):
        gate.wait(i, 0.1 * i, out.resolver(i))
    assert gate.expire(0.6) == WindowOpened("v", 1)
    assert out == {} and gate.held == 3 and not gate.eligible  # timed out, held
    gate.wait(4, 0.7, out.resolver(4))  # ineligible: confirmed without the standby, held
    assert out == {} and gate.held == 4 and gate.waiting == 0
    gate.window_recorded(1)
    assert out == {1: True, 2: True, 3: True, 4: True} and gate.held == 0
    gate.wait(5, 0.8, out.resolver(5))  # the opening is recorded: at once
    assert out[5] is True


def test_a_confirm_held_past_the_bound_for_its_windows_record_is_nacked() -> None:
    """The store does not record the window's opening (it hangs): a held
    confirm may not go out, and after HOLD_BOUND its client gets a nack,
    not silence. One the store records in time still goes out."""
    from bridge.active import HOLD_BOUND

    gate, out = SyncGate("v", 500, DEGRADE, recording=True), Outcomes()
    gate.wait(1, 0.0, out.resolver(1))
    assert gate.expire(0.5) == WindowOpened("v", 1)  # 1 held since 0.5
    gate.wait(2, 5.0, out.resolver(2))  # held since 5.0
    assert gate.next_deadline() == 0.5 + HOLD_BOUND
    assert gate.expire(0.5 + HOLD_BOUND - 0.01) is None and out == {}
    gate.expire(0.5 + HOLD_BOUND + 0.01)
    assert out == {1: False} and gate.held == 1 and gate.nacked_held == 1
    assert gate.next_deadline() == 5.0 + HOLD_BOUND
    gate.window_recorded(1)
    assert out == {1: False, 2: True} and gate.held == 0 and gate.next_deadline() is None


def test_a_gate_that_does_not_record_confirms_at_once_and_still_reports_its_window() -> None:
    gate, out = SyncGate("v", 500, DEGRADE), Outcomes()
    gate.wait(1, 0.0, out.resolver(1))
    assert gate.expire(0.5) == WindowOpened("v", 1)
    assert out == {1: True} and gate.held == 0
    assert gate.acked(1) == WindowClosed("v", 1, 1)


def test_window_bounds_are_the_lowest_index_confirmed_without_the_standby_and_the_catch_up() -> (
    None
):
    """``first``: the lowest index of the groups the timeout released, but
    not what the standby had acknowledged; ``last``: the highest index
    confirmed while ineligible (the catch-up index)."""
    gate, out = SyncGate("v", 500, DEGRADE, acked_index=10, recording=True), Outcomes()
    gate.wait(15, 0.0, out.resolver(15), first=11)  # one read's group, 11..15
    gate.wait(17, 0.1, out.resolver(17), first=16)
    assert gate.acked(12) is None  # the standby has 11 and 12, not the group's end
    opened = gate.expire(0.5)
    assert opened == WindowOpened("v", 13)  # 11 and 12 went out with the standby
    assert gate.window_first == 13
    gate.window_recorded(13)
    assert out == {15: True, 17: True}
    gate.wait(20, 0.6, out.resolver(20), first=18)  # ineligible: the catch-up moves to 20
    assert gate.acked(19) is None and not gate.eligible
    assert gate.acked(20) == WindowClosed("v", 13, 20)
    assert gate.eligible and gate.window_first is None
    gate.wait(21, 1.0, out.resolver(21))
    assert 21 not in out  # eligible: waits for the standby again
    assert gate.expire(1.5) == WindowOpened("v", 21)  # a new window, from 21


def test_a_single_publish_window_starts_at_the_oldest_waiter() -> None:
    """Entries no confirm waits for (acks, publishes without confirms)
    between the standby's index and the first waiter are not in the window."""
    gate, out = SyncGate("v", 500, DEGRADE, acked_index=4), Outcomes()
    gate.wait(7, 0.0, out.resolver(7))
    gate.wait(9, 0.1, out.resolver(9))
    assert gate.expire(0.5) == WindowOpened("v", 7)
    assert gate.acked(9) == WindowClosed("v", 7, 9)


def test_reject_records_no_window() -> None:
    gate, out = SyncGate("v", 500, REJECT, recording=True), Outcomes()
    gate.wait(1, 0.0, out.resolver(1))
    gate.wait(2, 0.1, out.resolver(2))
    assert gate.expire(0.6) is None
    assert out == {1: False, 2: False} and gate.held == 0 and gate.eligible
    assert gate.acked(2) is None and gate.window_first is None


def test_a_held_confirm_the_standby_acknowledges_goes_out_as_acknowledged() -> None:
    """The standby came back while the opening was being written: what it
    acknowledged needs no window; the window still closes at its catch-up."""
    gate, out = SyncGate("v", 500, DEGRADE, recording=True), Outcomes()
    for i in (1, 2, 3):
        gate.wait(i, 0.0, out.resolver(i))
    assert gate.expire(0.5) == WindowOpened("v", 1)
    assert gate.acked(2) is None
    assert out == {1: True, 2: True} and gate.held == 1
    assert gate.acked(3) == WindowClosed("v", 1, 3)
    assert out == {1: True, 2: True, 3: True} and gate.held == 0
    gate.window_recorded(1)  # the opening lands after the end: nothing to release
    assert gate.eligible


def test_an_opening_recorded_late_never_releases_a_newer_window() -> None:
    gate, out = SyncGate("v", 500, DEGRADE, recording=True), Outcomes()
    gate.wait(1, 0.0, out.resolver(1))
    assert gate.expire(0.5) == WindowOpened("v", 1)
    assert gate.acked(1) == WindowClosed("v", 1, 1)  # caught up before the record
    gate.wait(2, 1.0, out.resolver(2))
    assert gate.expire(1.5) == WindowOpened("v", 2)
    gate.window_recorded(1)  # the first window's opening
    assert 2 not in out and gate.held == 1
    gate.window_recorded(2)
    assert out[2] is True


def test_release_ends_the_window_and_keeps_what_waits_for_its_opening() -> None:
    """The VPN switched to async: what waited for the standby is confirmed
    now; what the timeout released under the sync promise still waits for
    its window's record."""
    gate, out = SyncGate("v", 500, DEGRADE, recording=True), Outcomes()
    gate.wait(1, 0.0, out.resolver(1))
    assert gate.expire(0.5) == WindowOpened("v", 1)
    gate.wait(2, 0.6, out.resolver(2))  # held too (ineligible)
    assert gate.release() == WindowClosed("v", 1, 2)
    assert out == {} and gate.held == 2
    gate.window_recorded(1)
    assert out == {1: True, 2: True}


def test_a_gate_switched_to_reject_while_ineligible_still_closes_its_window() -> None:
    gate, out = SyncGate("v", 500, DEGRADE), Outcomes()
    gate.wait(1, 0.0, out.resolver(1))
    assert gate.expire(0.5) == WindowOpened("v", 1)
    gate.configure(500, REJECT)
    gate.wait(2, 0.6, out.resolver(2))  # reject: waits for the standby again
    assert 2 not in out and gate.waiting == 1
    assert gate.acked(1) == WindowClosed("v", 1, 1)  # caught up with index 1
    assert 2 not in out and gate.eligible
    assert gate.acked(2) is None and out[2] is True


class Recorded:
    """A recorder that writes nothing: the test says when a write is durable."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, ...]] = []
        self.thens: list[Any] = []

    def open_window(self, vpn: str, first: int, then: Any) -> None:
        self.writes.append(("open", vpn, str(first)))
        self.thens.append(then)

    def close_window(self, vpn: str, first: int, last: int) -> None:
        self.writes.append(("close", vpn, str(first), str(last)))

    def add_window(self, vpn: str, first: int, last: int, then: Any) -> None:
        self.writes.append(("add", vpn, str(first), str(last)))
        self.thens.append(then)


def test_the_replicator_releases_a_windows_confirms_only_once_its_opening_is_durable() -> None:
    recorder = Recorded()
    out = Outcomes()

    async def scenario() -> None:
        replicator = Replicator(cast(LedgerWriter, None), cast(WindowRecorder, recorder))
        replicator.configure(
            VpnSettings.from_args("v", "active", "sync", 50, "degrade"), acked_index=0
        )
        replicator.wait_standby("v", 3, out.resolver(3), first=1)
        await asyncio.sleep(0.2)  # past the sync timeout
        assert recorder.writes == [("open", "v", "1")]
        assert out == {} and not replicator.sync_eligible("v")
        replicator.wait_standby("v", 4, out.resolver(4))
        assert out == {}
        recorder.thens.pop()()  # the opening committed
        assert out == {3: True, 4: True}
        replicator.standby_acked("v", 4)
        assert recorder.writes[-1] == ("close", "v", "1", "4")
        assert replicator.sync_eligible("v")
        assert replicator.confirmed_without_standby("v", 7, 9, lambda: None)
        assert recorder.writes[-1] == ("add", "v", "7", "9")
        await replicator.close()

    asyncio.run(scenario())


def _replicator(timeout_ms: int, policy: SyncTimeoutPolicy) -> Replicator:
    # wait_standby() never touches the ledger writer
    replicator = Replicator(cast(LedgerWriter, None))
    replicator.configure(
        VpnSettings.from_args("v", "active", "sync", timeout_ms, policy.value), acked_index=0
    )
    replicator.start()
    return replicator


def test_the_replicator_times_out_a_waiting_publish_with_its_policy() -> None:
    async def scenario() -> tuple[dict[int, bool], dict[int, bool]]:
        reject, out = _replicator(50, REJECT), Outcomes()
        assert reject.wait_standby("v", 1, out.resolver(1))
        assert reject.wait_standby("v", 2, out.resolver(2))
        reject.standby_acked("v", 1)
        await asyncio.sleep(0.2)
        await reject.close()
        degrade, later = _replicator(50, DEGRADE), Outcomes()
        degrade.wait_standby("v", 1, later.resolver(1))
        await asyncio.sleep(0.2)
        assert not degrade.sync_eligible("v")
        await degrade.close()
        return dict(out), dict(later)

    rejected, degraded = asyncio.run(scenario())
    assert rejected == {1: True, 2: False}
    assert degraded == {1: True}


def test_the_replicator_schedules_no_deadline_check_while_nothing_waits() -> None:
    out = Outcomes()

    async def scenario() -> list[bool]:
        replicator = _replicator(10_000, REJECT)
        armed = [replicator._timer is not None]
        replicator.wait_standby("v", 1, out.resolver(1))
        armed.append(replicator._timer is not None)
        replicator.standby_acked("v", 1)
        armed.append(replicator._timer is not None)
        await replicator.close()
        return armed

    assert asyncio.run(scenario()) == [False, True, False]
    assert out == {1: True}


def test_a_vpn_switched_to_async_confirms_what_waited_for_the_standby() -> None:
    """An operator serving without a standby (``vpn enable --mode async``
    after a disaster): the publishes that waited are confirmed, none hangs."""
    out = Outcomes()

    async def scenario() -> bool:
        replicator = _replicator(10_000, REJECT)
        replicator.wait_standby("v", 1, out.resolver(1))
        replicator.wait_standby("v", 2, out.resolver(2))
        replicator.configure(VpnSettings.from_args("v", "active", "async"), acked_index=0)
        armed = replicator._timer is not None
        await replicator.close()
        return armed

    assert asyncio.run(scenario()) is False
    assert out == {1: True, 2: True}
