"""The README's first command: the demo runs its sites and says what is missing."""

from __future__ import annotations

from pathlib import Path

from tests.fix_cli import Vpnrepl


def test_demo_replicates_a_workload_and_is_honest_about_promotion(tmp_path: Path) -> None:
    result = Vpnrepl(tmp_path / "unused.toml")("demo", config=False)
    out = result.stdout
    assert "published 2000 persistent messages through site a's listener, all confirmed" in out
    assert "orders: active epoch 1 sync, bridge connected, ledger 2800 applied 2800" in out
    assert "orders: standby epoch 1 sync, bridge connected, ledger 0 applied 2800" in out
    assert out.count("orders.created: 1200 replicated live") == 2
    # promotion has not landed: no fake success
    assert "`vpnrepl promote` is not implemented yet" in out
    assert result.returncode == 1
    # the story, not the AMQP client's connection chatter
    assert " INFO pika" not in result.stderr
