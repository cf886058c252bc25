"""The README's first command: the demo runs two sites through a disaster and
a failback, and says what happened at each step."""

from __future__ import annotations

import re
from pathlib import Path

from tests.fix_cli import Vpnrepl


def _row(out: str, *cells: str) -> bool:
    """A line of a ``status`` table with these cells in a row."""
    return re.search(r"^" + r"\s+".join(map(re.escape, cells)) + r"\b", out, re.M) is not None


def test_demo_fails_over_and_back_without_losing_what_was_confirmed(tmp_path: Path) -> None:
    result = Vpnrepl(tmp_path / "unused.toml")("demo", config=False)
    out = result.stdout
    assert result.returncode == 0, result.stderr[-3000:]
    assert "published 2000 persistent messages through site a's listener, all confirmed" in out
    assert _row(out, "orders", "active", "1", "sync", "eligible", "connected", "2800", "2800")
    assert _row(out, "orders", "standby", "1", "sync", "eligible", "connected", "0", "2800")
    # the disaster: b takes over with everything a confirmed and b applied
    assert "VPN 'orders' promoted to active at epoch 2: 3200 messages into 2 queues" in out
    assert "orders.created holds 1200 messages; consumed and acked 200 of them" in out
    assert _row(out, "orders", "active FENCED", "1", "sync")
    assert "0 messages this site confirmed after index 2800, where epoch 2 took over" in out
    assert _row(out, "orders", "standby", "2", "sync", "eligible", "connected", "0", "3000")
    # the failback
    assert "VPN 'orders' promoted to active at epoch 3: 3000 messages into 2 queues" in out
    assert _row(out, "orders", "active", "3", "sync", "eligible", "connected", "3000", "3000")
    assert _row(out, "orders", "standby", "3", "sync", "eligible", "connected", "0", "3000")
    assert out.count("orders.created: 1000 replicated live") >= 4
    # the story, not the AMQP client's connection chatter
    assert " INFO pika" not in result.stderr
