"""The lag history behind the status page's chart
(plugin/admin/_lag_history.py): a window of samples per VPN, a disabled VPN
dropped."""

from __future__ import annotations

from plugin.admin import LagHistory
from tests.unit.plugin.admin.test_endpoint import _doc


def test_the_history_keeps_the_window_and_drops_disabled_vpns() -> None:
    h = LagHistory(window=10, every=2)
    for i in range(8):
        h.add(_doc(i, 100 + i), at=1000.0 + 2 * i)
    samples = h.as_json()["vpns"]["orders"]
    assert len(samples) == 5  # 10 s of samples every 2 s
    assert samples[-1] == [1014.0, 7, 0.07, 107]
    h.add({"site": "a", "vpns": []})
    assert h.as_json()["vpns"] == {}
