"""The fixtures every kind of test may use, and the ``servers`` marker: a
test outside ``tests/unit`` needs the harness's servers (``-m "not
servers"`` runs the rest)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = [
    "tests.fix_sites",
    "tests.fix_cli",
    "tests.fix_endpoints",
    "tests.fix_listener",
    "tests.fix_node",
    "tests.fix_tls",
    "tests.fix_two_sites",
]

_UNIT = Path(__file__).resolve().parent / "unit"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _UNIT not in Path(item.path).parents:
            item.add_marker(pytest.mark.servers)
