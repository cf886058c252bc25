"""Internals, tested beside their module."""

from __future__ import annotations

import asyncio

import pytest


def test_a_transaction_settling_that_fails_is_logged_not_left_unretrieved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An abort or resolve whose database went away: one warning line, no
    "Task exception was never retrieved" traceback; recovery settles it."""
    from types import SimpleNamespace

    from plugin.listener._server import _ClientSide

    async def failing() -> None:
        raise OSError("the site database went away")

    async def scenario() -> None:
        side = SimpleNamespace(_tasks=set())
        side._settled = lambda task: _ClientSide._settled(side, task)  # type: ignore[arg-type]
        _ClientSide._spawn(side, failing())  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert side._tasks == set()

    asyncio.run(scenario())
    assert "settling a transaction failed (OSError: the site database went away)" in caplog.text
    assert "never retrieved" not in caplog.text
