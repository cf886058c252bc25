"""Sync-mode confirm gating (no servers, time passed in)."""

from __future__ import annotations

import asyncio
from typing import cast

from bridge import SyncTimeoutPolicy, VpnSettings
from bridge._ledger import LedgerWriter
from bridge._replicator import Replicator
from bridge._syncgate import SyncGate

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
