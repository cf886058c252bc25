"""Which of a VPN's queues its replication scope takes, told to the operator.

A scope pattern that matches nothing replicates nothing, silently: ``vpn
enable`` prints, for the VPN's queues at the broker now, which are in scope
and which are not, and warns about every ``--queues`` pattern that matches
none of them; ``status`` lists the queues that hold persistent messages at
the broker but are out of scope (:func:`out_of_scope`).

A queue reached only through a ``--topics`` filter is in scope publish by
publish (by routing key), not by its name: the report names such queues as
"by topic filter" rather than guessing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ._scope import ReplicationScope

__all__ = ["ScopeReport", "out_of_scope", "scope_report"]


@dataclass(frozen=True, slots=True)
class ScopeReport:
    """The VPN's current queues split by scope."""

    #: named by a ``--queues`` pattern (or no filter at all)
    in_scope: tuple[str, ...]
    #: in scope only for publishes a ``--topics`` filter takes
    by_topic: tuple[str, ...]
    #: never replicated
    out_of_scope: tuple[str, ...]
    #: ``--queues`` patterns that match none of the queues
    unmatched: tuple[str, ...]

    def lines(self) -> list[str]:
        """What ``vpn enable`` prints."""
        out = []
        if self.in_scope:
            out.append(f"  in scope: {', '.join(self.in_scope)}")
        if self.by_topic:
            out.append(
                f"  in scope for publishes a --topics filter takes: {', '.join(self.by_topic)}"
            )
        if self.out_of_scope:
            out.append(f"  NOT in scope (not replicated): {', '.join(self.out_of_scope)}")
        if not (self.in_scope or self.by_topic or self.out_of_scope):
            out.append("  the VPN has no queues yet")
        for pattern in self.unmatched:
            out.append(
                f"warning: --queues '{pattern}' matches none of the VPN's queues now "
                "(patterns are searched in the name, as RabbitMQ policy patterns are: "
                "'^orders\\.' is a prefix)"
            )
        return out


def scope_report(scope: ReplicationScope, queues: Iterable[str]) -> ScopeReport:
    names = sorted(set(queues))
    named = [q for q in names if scope.names_queue(q)]
    rest = [q for q in names if q not in set(named)]
    by_topic = rest if scope.topic_filters else []
    unmatched = tuple(p for p in scope.queue_patterns if not any(re.search(p, q) for q in names))
    return ScopeReport(
        in_scope=tuple(named),
        by_topic=tuple(by_topic),
        out_of_scope=tuple(q for q in rest if q not in by_topic),
        unmatched=unmatched,
    )


#: the management API's columns :func:`replicable_depth` reads
DEPTH_COLUMNS = "name,type,messages,messages_persistent"


def replicable_depth(listed: Mapping[str, object]) -> int:
    """How many of a queue's messages (one item of the management API's
    queue listing, with :data:`DEPTH_COLUMNS`) replication would hold: a
    classic queue's persistent ones (transient messages never replicate); a
    quorum queue's or a stream's all of them, since they keep every message
    durably and report no persistent count of their own."""
    key = "messages" if listed.get("type") in ("quorum", "stream") else "messages_persistent"
    value = listed.get(key)
    return value if isinstance(value, int) else 0


def out_of_scope(
    scope: ReplicationScope, persistent: Mapping[str, int], replicated: Mapping[str, int]
) -> dict[str, int]:
    """Queues holding persistent messages at the broker (``persistent``: name
    to count) that the scope does not take: not named by a pattern, and with
    no replicated live message (which a topic filter would have brought)."""
    return {
        q: n
        for q, n in sorted(persistent.items())
        if n > 0 and not scope.names_queue(q) and not replicated.get(q)
    }
