"""The fault suite: a workload under every nemesis, checked (``tests/chaos.py``,
``tests/checker.py``).

The smoke run (one nemesis, short) is in the default suite; every nemesis
in both modes runs with ``./run test -m fault``. Each run writes its report
(``VPNREPL_FAULT_REPORTS=DIR`` keeps them).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import chaos
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess


def test_smoke_a_killed_active_node_loses_nothing_confirmed(
    node_a: NodeProcess, node_b: NodeProcess, vpnrepl_a: Vpnrepl, tmp_path: Path
) -> None:
    with chaos.run(node_a, node_b, vpnrepl_a, "sync", tmp_path) as r:
        r.setup()
        r.start_workload()
        r.wait_confirmed(300)
        r.apply(chaos.kill_node("a"))
        r.wait_confirmed(300)  # the clients found the site again
        r.stop_workload()
        broken = r.report(r.drain(), "smoke-kill-node-a")
    assert broken == {}
    assert r.recorder.errors, "the fault cut no client off: it tested nothing"
    assert any(t.outcome == "committed" for t in r.history.txns)
    assert r.history.acked


@pytest.mark.fault
@pytest.mark.parametrize("nemesis", sorted(chaos.NEMESES))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_nemesis_breaks_no_promise(
    node_a: NodeProcess,
    node_b: NodeProcess,
    vpnrepl_a: Vpnrepl,
    tmp_path: Path,
    nemesis: str,
    mode: str,
) -> None:
    with chaos.run(node_a, node_b, vpnrepl_a, mode, tmp_path) as r:
        r.setup()
        r.start_workload()
        r.wait_confirmed(500)
        r.apply(chaos.NEMESES[nemesis]())
        r.wait_confirmed(500, timeout=120)
        r.stop_workload()
        broken = r.report(r.drain(), f"{mode}-{nemesis}")
    assert broken == {}
