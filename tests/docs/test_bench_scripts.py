"""Every benchmark script starts: it imports the project's packages as they
are now and parses its options (``--help``), without servers.

The benchmarks run outside the test suite; this keeps an import that only
they make (a moved name, a module shadowed from ``bench/``) from breaking
them unnoticed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import REPO

BENCH = REPO / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def test_the_benchmarks_are_found() -> None:
    assert {"bridge.py", "listener.py", "transactions.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_script_starts(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
