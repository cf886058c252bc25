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

    def __len__(self) -> int:
        """How many have not ended yet."""
        return len(self._tasks)

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def wait(self) -> None:
        """Until every task held now has ended, whatever its end."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
