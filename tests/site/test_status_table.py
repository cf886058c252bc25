"""``vpnrepl status``: a table an operator reads at a glance, ``--json``
unchanged, ``--watch N`` refreshing it until interrupted."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plugin.cli import render
from tests.fix_cli import Vpnrepl
from tests.support.two_sites import until


def _vpn(**over: Any) -> dict[str, Any]:
    v = {
        "name": "orders",
        "role": "active",
        "epoch": 2,
        "mode": "sync",
        "sync_eligible": True,
        "fenced": False,
        "bridge": "connected",
        "ledger_index": 1200,
        "applied_index": 1150,
        "lag_events": 50,
        "lag_seconds": 0.25,
        "in_doubt_txns": 1,
        "unknown_acks": 0,
        "queues": {"orders.q1": 7},
        "broker_queues": {"orders.q1": 7, "audit.q3": 5},
        "out_of_scope": {"audit.q3": 5},
        "promotion": {"state": "none", "materialised": 0, "total": 0},
    }
    v.update(over)
    return v


def test_the_table_has_a_row_per_vpn_and_its_queues_below() -> None:
    text = render({"site": "a", "vpns": [_vpn(), _vpn(name="audit", role="standby", mode="async")]})
    lines = text.splitlines()
    assert lines[0] == "site a"
    assert lines[1].split() == [
        "VPN", "ROLE", "EPOCH", "MODE", "SYNC", "BRIDGE", "LEDGER", "APPLIED", "LAG", "IN-DOUBT",
    ]  # fmt: skip
    assert lines[2].split() == [
        "orders", "active", "2", "sync", "eligible", "connected", "1200", "1150",
        "50", "ev", "/", "0.25", "s", "1",
    ]  # fmt: skip
    assert lines[3].split()[:5] == ["audit", "standby", "2", "async", "-"]
    # the columns line up
    assert lines[1].index("BRIDGE") == lines[2].index("connected") == lines[3].index("connected")
    assert "  orders.q1: 7 replicated live, 7 at the broker" in lines
    assert "  audit.q3: 5 persistent at the broker, NOT in scope (not replicated)" in lines


def test_the_table_says_when_the_bridge_is_plain_tcp() -> None:
    plain = render({"site": "a", "bridge_authenticated": False, "vpns": [_vpn()]})
    assert "bridge: PLAIN TCP, peers not authenticated" in plain
    assert "PLAIN TCP" not in render({"site": "a", "bridge_authenticated": True, "vpns": []})


def test_the_table_flags_what_needs_attention() -> None:
    text = render(
        {
            "site": "b",
            "vpns": [
                _vpn(
                    fenced=True,
                    sync_eligible=False,
                    unknown_acks=3,
                    broker_queues=None,
                    out_of_scope=None,
                    broker_error="management API unreachable",
                    promotion={"state": "running", "materialised": 10, "total": 40},
                    sync_windows=[
                        {"epoch": 2, "first_index": 1151, "last_index": None},
                        {"epoch": 2, "first_index": 900, "last_index": 960},
                    ],
                    sync_windows_total=4,
                )
            ],
        }
    )
    assert re.search(r"^orders\s+active FENCED\s+2\s+sync\s+INELIGIBLE\s", text, re.M)
    assert "  orders.q1: 7 replicated live, ? at the broker" in text
    assert "  broker depths unavailable: management API unreachable" in text
    assert "  promotion running: 10/40 materialised" in text
    assert "  3 acks the standby could not match" in text
    assert (
        "  4 sync-ineligible window(s) recorded (confirmed without the standby);"
        " newest: ledger 1151..open at epoch 2"
    ) in text
    assert "window" not in render({"site": "a", "vpns": [_vpn()]})
    assert render({"site": "a", "vpns": []}) == "site a\nno VPN is enabled for replication\n"


@pytest.mark.parametrize(
    ("value", "needle"),
    [("0", "0.5 to 86400 seconds"), ("soon", "'soon' is not a number of seconds")],
)
def test_a_bad_watch_interval_is_a_usage_error(vpnrepl_a: Vpnrepl, value: str, needle: str) -> None:
    result = vpnrepl_a("status", "--watch", value)
    assert result.returncode == 2
    assert "--watch" in result.stderr and needle in result.stderr


class _Watch:
    """``vpnrepl status --watch 0.5`` writing to a file the test can read
    while it runs (a loaded machine refreshes late, not never)."""

    def __init__(self, config: Path, out: Path, *args: str) -> None:
        exe = shutil.which("vpnrepl") or str(Path(sys.executable).with_name("vpnrepl"))
        self.out = out
        self._stdout = out.open("w")
        self.proc = subprocess.Popen(
            [exe, "--config", str(config), "status", "--watch", "0.5", *args],
            stdout=self._stdout,
            stderr=subprocess.PIPE,
            text=True,
        )

    def until(self, check: Callable[[str], bool], what: str) -> None:
        def seen() -> bool:
            assert self.proc.poll() is None, f"the watch ended before {what}"
            return check(self.out.read_text())

        until(seen, what, timeout=60.0)

    def stop(self) -> tuple[str, str]:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=30)
        self._stdout.close()
        assert self.proc.returncode == 0, err  # Ctrl-C is how a watch ends: not a failure
        return self.out.read_text(), err


def test_watch_refreshes_until_interrupted(vpnrepl_a: Vpnrepl, tmp_path: Path) -> None:
    assert vpnrepl_a("init").returncode == 0
    assert vpnrepl_a("vpn", "enable", "orders", "--role", "active").returncode == 0
    watch = _Watch(vpnrepl_a.config, tmp_path / "table.txt")
    watch.until(lambda out: out.count("site a\n") >= 2, "second refresh")
    assert vpnrepl_a("vpn", "enable", "audit", "--role", "standby").returncode == 0
    watch.until(lambda out: re.search(r"^audit\s+standby\s", out, re.M) is not None, "audit")
    out, err = watch.stop()
    assert out.count("site a\n") >= 3, out
    assert "every 0.5 s (Ctrl-C stops)" in out
    assert "Traceback" not in err

    watch = _Watch(vpnrepl_a.config, tmp_path / "json.txt", "--json")
    watch.until(lambda out: out.count("\n") >= 2, "two JSON documents")
    out, _ = watch.stop()
    docs = [json.loads(line) for line in out.splitlines()]
    assert len(docs) >= 2
    assert all([v["name"] for v in d["vpns"]] == ["audit", "orders"] for d in docs)
