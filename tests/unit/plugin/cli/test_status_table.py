"""``vpnrepl status`` as a table (plugin/cli/_status_table.py): a row per
VPN an operator reads at a glance, its queues below, and what needs
attention flagged. ``--watch`` is run in ``tests/site/test_cli.py``."""

from __future__ import annotations

import re
from typing import Any

from plugin.cli import render


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
