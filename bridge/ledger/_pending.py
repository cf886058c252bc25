"""The ledger writer's queue: entries waiting for their commit, and the
confirms they answer.

Invariant: every callback queued is called once, on the loop, in index
order: ``True`` after its entry's batch committed, ``False`` when the writer
stops first, or when a client's confirm waited past the answer timeout (its
entry stays queued and still commits). A batch is a prefix of the queue
that never splits an all-or-nothing group (``LedgerWriter.append_group``).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from bridge._entry import LedgerEntry

__all__ = ["OnDurable", "Pending", "PendingEntries"]

log = logging.getLogger(__name__)

OnDurable = Callable[[bool], None]


@dataclass(slots=True)
class Pending:
    """One entry waiting for its commit."""

    entry: LedgerEntry
    at: float
    on_durable: OnDurable | None
    #: inside an all-or-nothing group (append_group), and not its last entry
    open_group: bool = False
    #: ``on_durable`` answers a client's confirm, which may be a nack once
    #: it waited :attr:`LedgerWriter.answer_timeout` (append, append_many)
    answers_client: bool = False


def _answer(on_durable: OnDurable, ok: bool) -> None:
    try:
        on_durable(ok)
    except Exception:
        log.exception("on_durable callback failed")


class PendingEntries:
    """The entries appended and not committed yet, oldest first."""

    def __init__(self) -> None:
        self._queue: deque[Pending] = deque()
        #: pending entries with an ``on_durable`` callback: while there are
        #: any, a batch commits without waiting for company
        self.waiters = 0
        #: (vpn, last index of a group) -> the transaction it decides (append_group)
        self.decisions: dict[tuple[str, int], str] = {}

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Pending]:
        return iter(self._queue)

    @property
    def oldest_at(self) -> float:
        """When the oldest pending entry was appended (the queue is not empty)."""
        return self._queue[0].at

    def add(self, entry: LedgerEntry, at: float, on_durable: OnDurable | None) -> int:
        """One entry answering a client's confirm (``append``); returns how
        many entries are pending now."""
        self._queue.append(Pending(entry, at, on_durable, False, True))
        if on_durable is not None:
            self.waiters += 1
        return len(self._queue)

    def add_run(
        self,
        entries: Sequence[LedgerEntry],
        at: float,
        on_durable: OnDurable | None,
        *,
        group: bool,
    ) -> None:
        """Consecutive entries with one callback, on the last: a client's
        confirm, or (``group``) an all-or-nothing group whose coordinator
        decides what the client hears."""
        queue = self._queue
        for entry in entries:
            queue.append(Pending(entry, at, None, group))
        last = queue[-1]
        last.open_group = False
        last.on_durable = on_durable
        last.answers_client = not group
        if on_durable is not None:
            self.waiters += 1

    def batch(self, size: int) -> list[Pending]:
        """The next batch to commit: up to ``size`` entries from the oldest,
        and the rest of a group it holds the start of."""
        batch = list(itertools.islice(self._queue, size))
        while batch[-1].open_group:
            batch.append(self._queue[len(batch)])
        return batch

    def committed(self, batch: list[Pending], waiters: int) -> None:
        """``batch`` (taken by :meth:`batch`, then holding ``waiters``
        callbacks) committed: drop it from the queue (:meth:`confirm` it next)."""
        self.waiters = max(0, self.waiters - waiters)
        for _ in batch:
            self._queue.popleft()
        if self.decisions:
            for p in batch:
                self.decisions.pop((p.entry.vpn, p.entry.index), None)

    @staticmethod
    def confirm(batch: list[Pending]) -> None:
        """Answer the callbacks of a committed batch."""
        for p in batch:
            if p.on_durable is not None:
                _answer(p.on_durable, True)

    def answer_late(self, now: float, timeout: float) -> int:
        """Nack each client confirm pending since before ``now`` -
        ``timeout``; its entry stays pending. Returns how many."""
        late = 0
        for p in self._queue:
            if now - p.at <= timeout:
                break
            if p.on_durable is None or not p.answers_client:
                continue
            answer, p.on_durable = p.on_durable, None
            self.waiters = max(0, self.waiters - 1)
            late += 1
            _answer(answer, False)
        return late

    def fail_all(self) -> int:
        """The writer stops: answer every pending callback ``False`` and
        empty the queue; returns how many entries were pending."""
        failed, self._queue = self._queue, deque()
        self.waiters = 0
        self.decisions.clear()  # their rows stay prepared: recovery decides them
        for p in failed:
            if p.on_durable is not None:
                _answer(p.on_durable, False)
        return len(failed)
