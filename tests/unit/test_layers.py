"""The packages' layering: plugin -> txn -> bridge, sql alone, private
modules private, and sans-IO modules that load no I/O.

The contracts live in ``setup.cfg`` (``[importlinter:...]``) and run here,
so the test command enforces them as the lint environment does; each kind
of breach is shown to fail them on a copy of the tree.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO

ROOT = REPO
PACKAGES = ("plugin", "txn", "bridge", "sql")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
#: modules a sans-IO module must not load, directly or through a package
IO_MODULES = ("asyncio", "socket", "ssl", "psycopg")
SANS_IO = (
    "plugin.session._session",
    "plugin.session._connection",
    "plugin.session._lifecycle",
    "plugin.session._channel",
    "plugin.session._channel_state",
    "plugin.session._deliveries",
    "plugin.session._transactions",
    "plugin.session._confirms",
    "plugin.session._fused",
    "plugin.session._publish",
    "plugin.session._checks",
    "plugin.session._topology_changes",
    "plugin.session._actions",
    "plugin.session._refusal",
    "plugin.topology._topology",
    "plugin.topology._entities",
    "plugin.topology._scope",
    "plugin.topology._routing",
    "plugin.session",
    "plugin.topology",
    "bridge.wire",
    "bridge.amqp",
    "bridge._entry",
    "txn.xa",
)


#: the contracts setup.cfg declares
CONTRACTS = (ROOT / "setup.cfg").read_text().count("[importlinter:contract:")


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), str(root / "setup.cfg"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_import_contracts_hold() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert CONTRACTS >= 7 and f"{CONTRACTS} kept, 0 broken" in result.stdout


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    """The packages and their contracts, in a tree the test may break."""
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(ROOT / "setup.cfg", tmp_path / "setup.cfg")
    return tmp_path


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("bridge/standby/_adoption.py", "from txn.xa import Xid", "a lower layer never imports"),
        ("bridge/wire/_protocol.py", "from txn import MarkerKey", "a lower layer never imports"),
        (
            "txn/client/_resource.py",
            "from plugin import load_config",
            "a lower layer never imports",
        ),
        ("plugin/cli/_cli.py", "from bridge.ledger._writer import LedgerWriter", "private"),
        (
            "plugin/admin/_lag_history.py",
            "from plugin.node import run_node",
            "plugin's subpackages",
        ),
        ("txn/local/_log.py", "from txn.branches import XaCoordinator", "txn's subpackages"),
        ("sql/env.py", "import bridge", "sql stands alone"),
        (
            "plugin/node/_node.py",
            "from plugin.devtools import LocalSites",
            "reaches plugin.devtools",
        ),
        (
            "bridge/store/_vpn_state.py",
            "from bridge.ledger import LedgerWriter",
            "import downward only",
        ),
        ("bridge/active/_syncgate.py", "import asyncio", "sans-IO modules load no"),
        ("bridge/wire/_frames.py", "import psycopg", "sans-IO modules load no"),
        ("plugin/session/_session.py", "import socket", "sans-IO modules load no"),
        ("bridge/amqp/_frames.py", "import asyncio", "sans-IO modules load no"),
    ],
)
def test_a_deliberate_breach_fails_the_contracts(
    tree_copy: Path, module: str, line: str, contract: str
) -> None:
    path = tree_copy / module
    path.write_text(path.read_text() + f"\n{line}  # a deliberate breach\n")
    result = _lint_imports(tree_copy)
    assert result.returncode == 1, result.stdout + result.stderr
    broken = [row for row in result.stdout.splitlines() if row.endswith(" BROKEN")]
    assert len(broken) == 1 and contract in broken[0], result.stdout
    assert f"{CONTRACTS - 1} kept, 1 broken" in result.stdout


def _loaded_after(statement: str) -> list[str]:
    """The I/O modules a fresh interpreter has loaded after ``statement``."""
    probe = (
        f"import sys, json\n{statement}\n"
        f"print(json.dumps(sorted(m for m in {IO_MODULES!r} if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    loaded: list[str] = json.loads(out.stdout)
    return loaded


def test_the_probe_sees_an_io_import() -> None:
    assert _loaded_after("pass") == []
    assert _loaded_after("import bridge.ledger._writer") == ["asyncio", "psycopg", "socket", "ssl"]


@pytest.mark.parametrize("module", SANS_IO)
def test_a_sans_io_module_loads_no_io(module: str) -> None:
    assert _loaded_after(f"import {module}") == []


@pytest.mark.parametrize("package", ["plugin", "txn", "bridge"])
def test_a_package_exports_its_io_bound_names_lazily(package: str) -> None:
    assert _loaded_after(f"import {package}") == []


@pytest.mark.parametrize("package", ["plugin", "txn", "bridge"])
def test_every_public_name_resolves(package: str) -> None:
    """A stale entry in a package's table of lazily imported names fails here."""
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert missing == []
    assert len(set(module.__all__)) == len(module.__all__)
