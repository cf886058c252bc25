"""The README's first command: the demo runs two sites through a disaster and
a failback, and says what happened at each step."""

from __future__ import annotations

from pathlib import Path

from tests.fix_cli import Vpnrepl


def test_demo_fails_over_and_back_without_losing_what_was_confirmed(tmp_path: Path) -> None:
    result = Vpnrepl(tmp_path / "unused.toml")("demo", config=False)
    out = result.stdout
    assert result.returncode == 0, result.stderr[-3000:]
    assert "published 2000 persistent messages through site a's listener, all confirmed" in out
    assert "orders: active epoch 1 sync, bridge connected, ledger 2800 applied 2800" in out
    assert "orders: standby epoch 1 sync, bridge connected, ledger 0 applied 2800" in out
    # the disaster: b takes over with everything a confirmed and b applied
    assert "VPN 'orders' promoted to active at epoch 2: 3200 messages into 2 queues" in out
    assert "orders.created holds 1200 messages; consumed and acked 200 of them" in out
    assert "orders: active epoch 1 sync FENCED" in out
    assert "0 messages this site confirmed after index 2800, where epoch 2 took over" in out
    assert "orders: standby epoch 2 sync, bridge connected, ledger 0 applied 3000" in out
    # the failback
    assert "VPN 'orders' promoted to active at epoch 3: 3000 messages into 2 queues" in out
    assert "orders: active epoch 3 sync, bridge connected, ledger 3000 applied 3000" in out
    assert "orders: standby epoch 3 sync, bridge connected, ledger 0 applied 3000" in out
    assert out.count("orders.created: 1000 replicated live") >= 4
    # the story, not the AMQP client's connection chatter
    assert " INFO pika" not in result.stderr
