"""Fire-and-forget tasks, kept referenced until they end (asyncio keeps only
a weak reference to a running task)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


class BackgroundTasks:
    """Tasks spawned and forgotten by their caller, held until they end."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[None]] = set()

    def spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
