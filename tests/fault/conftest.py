"""The fault suite's options: ``--seeds`` picks the random schedules."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--seeds",
        default="1-6",
        help="random fault schedules to run (-m fault): a seed, a range A-B, or a comma list",
    )


def seeds(spec: str) -> list[int]:
    """``"7"``, ``"1-50"`` or ``"3,9,12"``."""
    out: list[int] = []
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "seed" in metafunc.fixturenames:
        metafunc.parametrize("seed", seeds(metafunc.config.getoption("--seeds")))
