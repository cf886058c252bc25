"""Which of a publish's queues a VPN replicates.

The listener asks :meth:`ReplicationScope.in_scope` for every persistent
publish with the queues :meth:`~plugin.topology._topology.Topology.route`
found: a queue is in scope when a ``--queues`` pattern matches its name or
a topic filter of the publish's exchange matches its routing key. The
answer depends on nothing else, so it is memoised per queue and per
(exchange, routing key), with bounded memos.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from bridge import TopicFilter, VpnSettings
from plugin._errors import UsageError

from ._routing import pattern_words, topic_matches

__all__ = ["ReplicationScope"]

_EMPTY: frozenset[str] = frozenset()
_SCOPE_MEMO_LIMIT = 65_536


@dataclass(frozen=True, slots=True)
class ReplicationScope:
    """Which routed queues of a publish the VPN replicates (its settings'
    ``queue_patterns`` and ``topic_filters``, :class:`~bridge.VpnSettings`).

    Regexes are compiled once; per-queue and per-(exchange, key) answers are
    memoised (bounded), so a publish costs a few dict lookups.
    """

    queue_patterns: tuple[str, ...] = ()
    topic_filters: tuple[TopicFilter, ...] = ()
    _regexes: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)
    _filters: dict[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)
    _queue_memo: dict[str, bool] = field(init=False, repr=False, compare=False)
    _topic_memo: dict[tuple[str, str], bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        regexes = []
        for pattern in self.queue_patterns:
            try:
                regexes.append(re.compile(pattern))
            except re.error as e:
                raise UsageError(f"--queues {pattern!r}: not a valid regex: {e}") from e
        filters: dict[str, tuple[str, ...]] = {}
        for f in self.topic_filters:
            filters[f.exchange] = (*filters.get(f.exchange, ()), f.pattern)
            pattern_words(f.pattern)
        object.__setattr__(self, "_regexes", tuple(regexes))
        object.__setattr__(self, "_filters", filters)
        object.__setattr__(self, "_queue_memo", {})
        object.__setattr__(self, "_topic_memo", {})

    @classmethod
    def of(cls, settings: VpnSettings) -> ReplicationScope:
        return cls(settings.queue_patterns, settings.topic_filters)

    @property
    def everything(self) -> bool:
        """No filter at all: every queue of the VPN is in scope."""
        return not self.queue_patterns and not self.topic_filters

    def in_scope(self, exchange: str, routing_key: str, queues: frozenset[str]) -> frozenset[str]:
        if not queues or self.everything:
            return queues
        if self._filters and self._topic_hit(exchange, routing_key):
            return queues
        if not self._regexes:
            return _EMPTY
        memo = self._queue_memo
        hits = []
        for q in queues:
            hit = memo.get(q)
            if hit is None:
                hit = self._learn_queue(q)
            if hit:
                hits.append(q)
        return queues if len(hits) == len(queues) else frozenset(hits)

    def names_queue(self, queue: str) -> bool:
        """``queue`` is in scope by its name alone (no filter at all, or a
        ``--queues`` pattern matches it); a queue in scope only through a
        topic filter is not (that depends on each publish)."""
        if self.everything:
            return True
        hit = self._queue_memo.get(queue)
        return self._learn_queue(queue) if hit is None else hit

    def _learn_queue(self, queue: str) -> bool:
        hit = any(r.search(queue) for r in self._regexes)
        if len(self._queue_memo) >= _SCOPE_MEMO_LIMIT:
            self._queue_memo.clear()
        self._queue_memo[queue] = hit
        return hit

    def _topic_hit(self, exchange: str, routing_key: str) -> bool:
        patterns = self._filters.get(exchange)
        if patterns is None:
            return False
        key = (exchange, routing_key)
        hit = self._topic_memo.get(key)
        if hit is None:
            hit = any(topic_matches(p, routing_key) for p in patterns)
            if len(self._topic_memo) >= _SCOPE_MEMO_LIMIT:
                self._topic_memo.clear()
            self._topic_memo[key] = hit
        return hit
