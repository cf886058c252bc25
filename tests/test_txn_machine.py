"""The coordinator's step table (sans-IO) and the failpoint switch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bridge import FAILPOINTS
from txn._machine import Action, Input, Phase, TxnMachine, TxnProtocolError


def test_sync_commit_waits_for_both_votes_then_runs_to_done() -> None:
    m = TxnMachine("t", needs_standby=True, reject=True)
    assert m.feed(Input.LOCAL_PREPARED) == []  # the standby has not voted
    assert m.feed(Input.REMOTE_PREPARED) == [Action.SEND_BROKER_COMMIT]
    assert m.feed(Input.BROKER_COMMIT_SENT) == []
    assert m.feed(Input.BROKER_COMMITTED) == [Action.RECORD_DECISION]
    assert m.feed(Input.BROKER_COMMITTED) == []  # commit-ok after a delivery proved it
    assert m.feed(Input.DECISION_DURABLE) == [Action.RELEASE_COMMIT_OK]
    assert m.phase is Phase.DONE and not m.degraded


def test_votes_in_either_order() -> None:
    m = TxnMachine("t", needs_standby=True, reject=False)
    assert m.feed(Input.REMOTE_PREPARED) == []
    assert m.feed(Input.LOCAL_PREPARED) == [Action.SEND_BROKER_COMMIT]


def test_a_late_standby_under_reject_refuses_and_forgets() -> None:
    m = TxnMachine("t", needs_standby=True, reject=True)
    m.feed(Input.LOCAL_PREPARED)
    assert m.feed(Input.REMOTE_TIMEOUT) == [Action.FORGET, Action.REFUSE]
    assert m.phase is Phase.ABORTED and "did not prepare in time" in m.refusal
    with pytest.raises(TxnProtocolError):
        m.feed(Input.BROKER_COMMIT_SENT)  # nothing may reach the broker now


def test_a_late_standby_under_degrade_goes_on_degraded() -> None:
    m = TxnMachine("t", needs_standby=True, reject=False)
    m.feed(Input.LOCAL_PREPARED)
    assert m.feed(Input.REMOTE_TIMEOUT) == [Action.SEND_BROKER_COMMIT]
    assert m.degraded


def test_async_vpn_needs_only_the_local_prepare() -> None:
    m = TxnMachine("t", needs_standby=False, reject=True)
    assert m.feed(Input.LOCAL_PREPARED) == [Action.SEND_BROKER_COMMIT]


@pytest.mark.parametrize(
    ("steps", "bad"),
    [
        ([], Input.BROKER_COMMITTED),  # no broker commit before prepare
        ([Input.LOCAL_PREPARED], Input.DECISION_DURABLE),
        ([Input.LOCAL_PREPARED, Input.BROKER_COMMIT_SENT], Input.ABORT),  # too late to abort
    ],
)
def test_inputs_out_of_order_are_errors(steps: list[Input], bad: Input) -> None:
    m = TxnMachine("t", needs_standby=False, reject=True)
    for step in steps:
        m.feed(step)
    with pytest.raises(TxnProtocolError):
        m.feed(bad)


def test_abort_before_the_broker_commit_forgets() -> None:
    m = TxnMachine("t", needs_standby=True, reject=True)
    m.feed(Input.LOCAL_PREPARED)
    assert m.feed(Input.ABORT) == [Action.FORGET]
    assert m.phase is Phase.ABORTED


def test_an_unknown_failpoint_name_stops_the_node_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "site.toml"
    config.write_text(
        '[site]\nname = "x"\n'
        '[broker]\namqp_url = "amqp://guest:guest@127.0.0.1:1/"\n'
        'management_url = "http://guest:guest@127.0.0.1:1/"\n'
        '[listen]\namqp = "127.0.0.1:0"\nbridge = "127.0.0.1:0"\n'
        '[store]\ndsn = "postgresql://x@127.0.0.1:1/x"\n'
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
