"""Retrying a write to the site's own store (no servers)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from bridge.ledger import retry_log_level, retry_store


def test_a_failing_write_is_tried_again_until_it_succeeds_and_each_failure_reported() -> None:
    calls: list[int] = []
    failures: list[tuple[str, int]] = []

    async def attempt() -> None:
        calls.append(1)
        if len(calls) < 3:
            raise OSError(f"down {len(calls)}")

    asyncio.run(
        retry_store(
            attempt,
            retried=(OSError,),
            min_backoff=0.001,
            max_backoff=0.002,
            failed=lambda e, n: failures.append((str(e), n)),
        )
    )
    assert len(calls) == 3
    assert failures == [("down 1", 1), ("down 2", 2)]


def test_an_error_that_is_not_retried_is_raised_at_once() -> None:
    async def attempt() -> None:
        raise ValueError("a bug, not an outage")

    with pytest.raises(ValueError, match="a bug"):
        asyncio.run(
            retry_store(attempt, retried=(OSError,), min_backoff=0, max_backoff=0, failed=print)
        )


def test_a_long_outage_logs_the_first_failure_and_every_twentieth() -> None:
    levels = {n: retry_log_level(n) for n in range(1, 61)}
    assert levels[1] == logging.WARNING
    assert [n for n, level in levels.items() if level == logging.ERROR] == [20, 40, 60]
    assert sum(level is None for level in levels.values()) == 56
