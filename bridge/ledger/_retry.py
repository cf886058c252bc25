"""A write to the site's own store, tried again for as long as it takes.

The ledger's commits and the sync-window records cannot give up: what they
write is what a confirm waits for. Each failed attempt is reported to the
caller (who keeps the error for status and logs it at
:func:`retry_log_level`), and the next follows after a jittered exponential
back-off, so a store that is down is not hammered by every node at once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_random_exponential

__all__ = ["retry_log_level", "retry_store"]


async def retry_store(
    attempt: Callable[[], Awaitable[None]],
    *,
    retried: tuple[type[BaseException], ...],
    min_backoff: float,
    max_backoff: float,
    failed: Callable[[BaseException | None, int], None],
) -> None:
    """Run ``attempt()`` until it succeeds. An exception of ``retried`` is
    passed to ``failed(error, attempt number)`` and the attempt made again
    after a back-off between ``min_backoff`` and ``max_backoff`` seconds;
    any other exception is raised."""

    def before_retry(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        failed(error, state.attempt_number)

    retrying = AsyncRetrying(
        retry=retry_if_exception_type(retried),
        wait=wait_random_exponential(multiplier=min_backoff, max=max_backoff),
        before_sleep=before_retry,
        reraise=True,
    )
    async for tried in retrying:
        with tried:
            await attempt()


def retry_log_level(attempt: int) -> int | None:
    """How loud the failure of ``attempt`` is: the first a warning, every
    20th an error, the others not logged (a long outage is a few lines)."""
    if attempt == 1:
        return logging.WARNING
    return logging.ERROR if attempt % 20 == 0 else None
