"""Which clocks the product reads: every timeout, deadline and retry in
the node runs on the monotonic clock, which a clock step (NTP, an operator,
a VM resumed) does not move; the wall clock is read only where a time is
shown. The site's PostgreSQL ``now()`` is the clock that decides (ledger
retention, lag, sync windows, the ``txn_log`` prune): README, "Clocks";
the fault suite's ``clock-*`` nemeses step it."""

from __future__ import annotations

import ast

from tests import REPO

ROOT = REPO

#: wall-clock reads and why each only shows a time
ALLOWED = {
    ("plugin/admin/_metrics.py", "time.time"): "a certificate's seconds to expiry, as a gauge",
    ("plugin/admin/_lag_history.py", "time.time"): "the time axis of the status page's lag chart",
    (
        "plugin/reconcile/_reconcile.py",
        "datetime.now",
    ): "when a reconciliation run finished, in its report",
    ("plugin/cli/_commands.py", "datetime.now"): "when a reconciliation run started, in its report",
    (
        "plugin/tls/_certificates.py",
        "datetime.datetime.now",
    ): "the validity of a certificate it makes",
}

WALL_CLOCK = {"time", "time_ns", "now", "utcnow", "today", "localtime", "gmtime", "ctime"}


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return "?"


def wall_clock_reads(source: str) -> list[str]:
    """Calls such as ``time.time()`` or ``datetime.now(UTC)`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = _dotted(node.func)
            if node.func.attr in WALL_CLOCK and name.split(".")[0] in {"time", "datetime", "date"}:
                found.append(name)
    return found


def test_the_scan_finds_a_wall_clock_read() -> None:
    source = "import time\nfrom datetime import datetime\ndeadline = time.time() + datetime.now().x"
    assert sorted(wall_clock_reads(source)) == ["datetime.now", "time.time"]
    assert wall_clock_reads("import time\nt = time.monotonic()\n") == []


def test_no_decision_reads_the_wall_clock() -> None:
    reads = {
        (str(path.relative_to(ROOT)), name)
        for package in ("plugin", "txn", "bridge", "sql")
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in wall_clock_reads(path.read_text())
    }
    unexplained = reads - set(ALLOWED)
    assert not unexplained, f"wall-clock reads a clock step would move: {sorted(unexplained)}"
    assert reads == set(ALLOWED), f"reads no longer there: {sorted(set(ALLOWED) - reads)}"
