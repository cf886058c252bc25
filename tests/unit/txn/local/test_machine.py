"""The coordinator's step table (sans-IO) and the failpoint switch.

The machine decides every step of a local transaction; these tests feed it
inputs as the coordinator would and check the actions it answers, every
transition of the table, every input it must refuse, and, over random
input orders, the guarantees the client relies on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from bridge import FAILPOINTS
from txn.local import (
    TXN_TRANSITIONS,
    Answer,
    AwaitStandbyAck,
    CommitEarly,
    Forget,
    Input,
    MarkDegraded,
    OpenStandbyPhase,
    RecordDecision,
    Refuse,
    RetireMarker,
    SendBrokerCommit,
    SendOutcome,
    StandbySettled,
    TxnMachine,
    TxnPhase,
    TxnProtocolError,
    WithdrawStandbyWait,
)

I = Input  # noqa: E741 - the table's own shorthand
FIRST, LAST = 41, 50


def machine(needs_standby: bool = True, reject: bool = True) -> TxnMachine:
    return TxnMachine("t", needs_standby=needs_standby, reject=reject)


def committed(m: TxnMachine) -> None:
    """Prepared on both sites, broker committed, the group appended."""
    m.feed(I.LOCAL_PREPARED)
    if m.needs_standby:
        m.feed(I.REMOTE_PREPARED)
    m.feed(I.BROKER_COMMIT_SENT)
    assert m.feed(I.BROKER_COMMITTED) == [RecordDecision()]
    m.appended(FIRST, LAST)


SETTLED_FROM_STREAM = [
    StandbySettled(acked=True, early=False),
    RetireMarker(),
    Answer(True),
    SendOutcome(),
]
SETTLED_EARLY = [StandbySettled(acked=True, early=True), RetireMarker(), Answer(True)]


# -- whole transactions ---------------------------------------------------------


def test_a_sync_transaction_committed_early_before_the_decision_is_durable() -> None:
    m = machine()
    assert m.feed(I.LOCAL_PREPARED) == []  # the standby has not voted
    assert m.feed(I.REMOTE_PREPARED) == [SendBrokerCommit()]
    assert m.feed(I.BROKER_COMMIT_SENT) == []
    assert m.feed(I.BROKER_COMMITTED) == [RecordDecision()]
    assert m.appended(FIRST, LAST) == [CommitEarly(FIRST)]
    assert m.feed(I.BROKER_COMMITTED) == []  # commit-ok after a delivery proved it
    assert m.feed(I.STANDBY_COMMITTED_EARLY) == []
    assert m.phase is TxnPhase.EARLY
    assert m.feed(I.DECISION_DURABLE) == [OpenStandbyPhase(), *SETTLED_EARLY]
    assert m.phase is TxnPhase.DONE and not m.degraded and m.committed_early


def test_a_sync_transaction_committed_early_after_the_decision_is_durable() -> None:
    m = machine()
    committed(m)
    assert m.feed(I.DECISION_DURABLE) == [OpenStandbyPhase(), AwaitStandbyAck(LAST)]
    assert m.feed(I.STANDBY_COMMITTED_EARLY) == [WithdrawStandbyWait(LAST), *SETTLED_EARLY]
    assert m.phase is TxnPhase.DONE
    assert m.feed(I.STANDBY_ACKED) == []  # a late answer of the gate changes nothing


def test_a_sync_transaction_the_standby_left_to_the_stream() -> None:
    m = machine()
    committed(m)
    assert m.feed(I.DECISION_DURABLE) == [OpenStandbyPhase(), AwaitStandbyAck(LAST)]
    assert m.feed(I.STANDBY_ACKED) == SETTLED_FROM_STREAM
    assert m.phase is TxnPhase.DONE and not m.committed_early
    assert m.feed(I.STANDBY_COMMITTED_EARLY) == []  # its answer after the stream's ack


def test_a_sync_transaction_whose_stream_ack_times_out_is_degraded() -> None:
    m = machine(reject=False)
    committed(m)
    m.feed(I.DECISION_DURABLE)
    assert m.feed(I.STANDBY_TIMEOUT) == [
        StandbySettled(acked=False, early=False),
        MarkDegraded(LAST),
        RetireMarker(),
        Answer(True),
        SendOutcome(),
    ]
    assert m.degraded


def test_an_async_transaction_waits_for_the_stream_only_where_a_gate_exists() -> None:
    m = machine(needs_standby=False)
    assert m.feed(I.LOCAL_PREPARED) == [SendBrokerCommit()]
    m.feed(I.BROKER_COMMIT_SENT)
    m.feed(I.BROKER_COMMITTED)
    assert m.appended(FIRST, LAST) == []  # no early commit without a prepared standby
    assert m.feed(I.DECISION_DURABLE) == [AwaitStandbyAck(LAST)]
    assert m.feed(I.STANDBY_ACKED) == SETTLED_FROM_STREAM


def test_votes_in_either_order() -> None:
    m = machine(reject=False)
    assert m.feed(I.REMOTE_PREPARED) == []
    assert m.feed(I.LOCAL_PREPARED) == [SendBrokerCommit()]


def test_a_late_standby_under_reject_refuses_and_forgets() -> None:
    m = machine(reject=True)
    m.feed(I.LOCAL_PREPARED)
    assert m.feed(I.REMOTE_TIMEOUT) == [Forget(), Refuse("the standby did not prepare in time")]
    assert m.phase is TxnPhase.ABORTED
    with pytest.raises(TxnProtocolError):
        m.feed(I.BROKER_COMMIT_SENT)  # nothing may reach the broker now


def test_a_late_standby_under_degrade_goes_on_degraded_without_an_early_commit() -> None:
    m = machine(reject=False)
    m.feed(I.LOCAL_PREPARED)
    assert m.feed(I.REMOTE_TIMEOUT) == [MarkDegraded(), SendBrokerCommit()]
    assert m.degraded
    m.feed(I.BROKER_COMMIT_SENT)
    m.feed(I.BROKER_COMMITTED)
    assert m.appended(FIRST, LAST) == []
    assert m.feed(I.DECISION_DURABLE) == SETTLED_FROM_STREAM  # the stream brings it later


def test_a_vote_that_beat_its_timer_counts() -> None:
    m = machine(reject=True)
    m.feed(I.REMOTE_PREPARED)
    m.feed(I.LOCAL_PREPARED)
    with pytest.raises(TxnProtocolError):
        m.feed(I.REMOTE_TIMEOUT)  # prepared already: the timer is for nothing
    m = machine(reject=True)
    m.feed(I.REMOTE_PREPARED)
    assert m.feed(I.REMOTE_TIMEOUT) == []  # still waiting for the local row
    assert m.feed(I.LOCAL_PREPARED) == [SendBrokerCommit()]


@pytest.mark.parametrize("prepared", [False, True])
def test_abort_before_the_broker_commit_forgets(prepared: bool) -> None:
    m = machine()
    m.feed(I.LOCAL_PREPARED)
    if prepared:
        m.feed(I.REMOTE_PREPARED)
    assert m.feed(I.ABORT) == [Forget()]
    assert m.phase is TxnPhase.ABORTED


@pytest.mark.parametrize("when", ["appending", "durable", "early"])
def test_a_decision_that_cannot_be_recorded_answers_no(when: str) -> None:
    m = machine()
    m.feed(I.LOCAL_PREPARED)
    m.feed(I.REMOTE_PREPARED)
    m.feed(I.BROKER_COMMIT_SENT)
    m.feed(I.BROKER_COMMITTED)
    if when == "appending":
        assert m.feed(I.APPEND_FAILED) == [Answer(False)]
    else:
        m.appended(FIRST, LAST)
        if when == "early":
            m.feed(I.STANDBY_COMMITTED_EARLY)
        assert m.feed(I.DECISION_LOST) == [Answer(False)]
    assert m.phase is TxnPhase.UNRECORDED
    assert m.feed(I.STANDBY_COMMITTED_EARLY) == []


# -- the table ------------------------------------------------------------------

#: how to reach each phase, for a sync VPN under degrade
ROUTES: dict[TxnPhase, list[Input]] = {
    TxnPhase.PREPARING: [],
    TxnPhase.PREPARED: [I.LOCAL_PREPARED, I.REMOTE_PREPARED],
    TxnPhase.COMMITTING: [I.LOCAL_PREPARED, I.REMOTE_PREPARED, I.BROKER_COMMIT_SENT],
    TxnPhase.DECIDING: [
        I.LOCAL_PREPARED,
        I.REMOTE_PREPARED,
        I.BROKER_COMMIT_SENT,
        I.BROKER_COMMITTED,
    ],
    TxnPhase.EARLY: [
        I.LOCAL_PREPARED,
        I.REMOTE_PREPARED,
        I.BROKER_COMMIT_SENT,
        I.BROKER_COMMITTED,
        I.STANDBY_COMMITTED_EARLY,
    ],
    TxnPhase.AWAITING_STANDBY: [
        I.LOCAL_PREPARED,
        I.REMOTE_PREPARED,
        I.BROKER_COMMIT_SENT,
        I.BROKER_COMMITTED,
        I.DECISION_DURABLE,
    ],
    TxnPhase.DONE: [
        I.LOCAL_PREPARED,
        I.REMOTE_PREPARED,
        I.BROKER_COMMIT_SENT,
        I.BROKER_COMMITTED,
        I.DECISION_DURABLE,
        I.STANDBY_ACKED,
    ],
    TxnPhase.ABORTED: [I.ABORT],
    TxnPhase.UNRECORDED: [
        I.LOCAL_PREPARED,
        I.REMOTE_PREPARED,
        I.BROKER_COMMIT_SENT,
        I.BROKER_COMMITTED,
        I.APPEND_FAILED,
    ],
}


def reach(phase: TxnPhase) -> TxnMachine:
    m = machine(reject=False)
    for what in ROUTES[phase]:
        m.feed(what)
    assert m.phase is phase
    return m


def test_every_phase_can_be_reached() -> None:
    assert set(ROUTES) == set(TxnPhase)
    assert {phase for phase, _ in TXN_TRANSITIONS} | {TxnPhase.ABORTED} == set(TxnPhase)


@pytest.mark.parametrize(("phase", "what"), sorted(TXN_TRANSITIONS, key=str))
def test_every_transition_is_taken_from_its_phase(phase: TxnPhase, what: Input) -> None:
    m = reach(phase)
    m.feed(what)
    assert m.history[-1] is what


@pytest.mark.parametrize(
    ("phase", "what"),
    sorted(
        ((p, i) for p in TxnPhase for i in Input if (p, i) not in TXN_TRANSITIONS),
        key=str,
    ),
)
def test_every_other_input_is_refused_and_changes_nothing(phase: TxnPhase, what: Input) -> None:
    m = reach(phase)
    before = (m.phase, len(m.history), m.degraded, m.committed_early)
    with pytest.raises(TxnProtocolError):
        m.feed(what)
    assert (m.phase, len(m.history), m.degraded, m.committed_early) == before


def test_the_end_phases_accept_nothing_that_acts() -> None:
    for phase in (TxnPhase.DONE, TxnPhase.ABORTED, TxnPhase.UNRECORDED):
        for what in Input:
            if (phase, what) in TXN_TRANSITIONS:
                assert reach(phase).feed(what) == [], (phase, what)


# -- any order ------------------------------------------------------------------


@given(
    needs_standby=st.booleans(),
    reject=st.booleans(),
    inputs=st.lists(st.sampled_from(list(Input)), max_size=30),
)
def test_the_guarantees_hold_in_any_input_order(
    needs_standby: bool, reject: bool, inputs: list[Input]
) -> None:
    """Whatever arrives in whatever order (what the table refuses is
    skipped): commit-ok only once the decision is durable and the standby
    holds the transaction or it was degraded; nothing reaches the broker
    after a refusal; no action after the end; one answer at most."""
    m = machine(needs_standby, reject)
    seen: list[object] = []
    durable = standby = refused = False
    answers = 0
    for what in inputs:
        before = m.phase
        try:
            actions = m.appended(FIRST, LAST) if what is I.GROUP_APPENDED else m.feed(what)
        except TxnProtocolError:
            continue
        if before in (TxnPhase.DONE, TxnPhase.ABORTED, TxnPhase.UNRECORDED):
            assert actions == [], (before, what)
        if what is I.DECISION_DURABLE:
            durable = True
        if what in (I.STANDBY_ACKED, I.STANDBY_COMMITTED_EARLY):
            standby = True
        for action in actions:
            if isinstance(action, Refuse):
                refused = True
                assert not any(isinstance(a, SendBrokerCommit | RecordDecision) for a in seen)
            if isinstance(action, SendBrokerCommit | RecordDecision):
                assert not refused
            if isinstance(action, CommitEarly):
                assert m.needs_standby and not m.degraded
            if isinstance(action, Answer):
                answers += 1
                if action.ok:
                    assert durable and (standby or m.degraded), m.history
            seen.append(action)
    assert answers <= 1


def test_an_unknown_failpoint_name_stops_the_node_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "site.toml"
    config.write_text(
        '[site]\nname = "x"\n'
        '[broker]\namqp_url = "amqp://guest:guest@127.0.0.1:1/"\n'
        'management_url = "http://guest:guest@127.0.0.1:1/"\n'
        '[listen]\namqp = "127.0.0.1:0"\nbridge = "127.0.0.1:0"\n'
        '[store]\ndsn = "postgresql://x@127.0.0.1:1/x"\n'
        "[insecure]\nplaintext_bridge = true\n"
    )
    exe = shutil.which("vpnrepl") or str(Path(sys.executable).with_name("vpnrepl"))
    env = {**os.environ, "VPNREPL_FAILPOINT": "coordinator.after-lunch"}
    done = subprocess.run(
        [exe, "--config", str(config), "node"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    [line] = [x for x in done.stderr.splitlines() if "error" in x]
    assert "is not a failpoint" in line and "coordinator.after-prepare" in line
    assert "coordinator.after-prepare" in FAILPOINTS
