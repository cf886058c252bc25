"""``lease``: one leader among a site's nodes, and its term.

A node takes a scope's lease (``site``: the site's whole work) when nobody
holds it or its holder let it expire (by this database's clock), and the
term rises whenever the lease changes hands; the holder renews it under the
term it took. A write the leader makes carries the term and is refused once
the term is not the lease's any more (:func:`holds_term`, a predicate for
the same transaction, and :data:`FENCE`, the same as a statement's CTE), so
a leader paused past its lease and woken cannot write after another node
took over. The holder judges its own lease by :class:`HeldLease`, on its
monotonic clock from before the renewal it sent: the database may only have
extended the lease later than that, never earlier, so the holder never
believes in a lease a taker already judges expired. Each function here
returns its statement (see :mod:`bridge.store._statement`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ._statement import Statement, fetch_one

__all__ = [
    "FENCE",
    "SITE",
    "Fence",
    "HeldLease",
    "beat",
    "end_sessions",
    "holds_term",
    "session_name",
    "sessions_of",
    "take_lease_from",
    "heartbeats",
    "lease_of",
    "release_lease",
    "renew_lease",
    "take_lease",
]

# take the lease if free, expired or already ours; the term rises when it
# changes hands (a new holder, or a lease that had expired)
_TAKE = """
INSERT INTO lease AS l (scope, holder, term, expires_at)
VALUES (%(scope)s, %(holder)s, 1, now() + make_interval(secs => %(seconds)s))
ON CONFLICT (scope) DO UPDATE SET
    holder = EXCLUDED.holder,
    term = l.term + CASE WHEN l.holder = EXCLUDED.holder AND l.expires_at > now() THEN 0 ELSE 1 END,
    expires_at = EXCLUDED.expires_at,
    taken_at = CASE WHEN l.holder = EXCLUDED.holder AND l.expires_at > now()
        THEN l.taken_at ELSE now() END,
    renewed_at = now()
WHERE l.holder = EXCLUDED.holder OR l.expires_at <= now()
RETURNING term
"""
# extend the lease still held under the term taken (even if it expired,
# as long as nobody took it meanwhile)
_RENEW = """
UPDATE lease SET expires_at = now() + make_interval(secs => %s), renewed_at = now()
WHERE scope = %s AND holder = %s AND term = %s
RETURNING term
"""
# let the lease go at once (a node stopping, or handing over)
_RELEASE = """
UPDATE lease SET expires_at = now()
WHERE scope = %s AND holder = %s AND term = %s
RETURNING term
"""
_LEASE_OF = """
SELECT holder, term, extract(epoch FROM expires_at - now()) FROM lease WHERE scope = %s
"""
#: the scope of the lease on a site's whole work
SITE = "site"

#: the fence as a statement's first CTE, ``fence``, whose three positional
#: parameters are the scope, the holder and the term (:meth:`Fence.params`):
#: a write goes on only ``WHERE EXISTS (SELECT FROM fence)``, and the lease
#: row stays share-locked until the statement's transaction ends
FENCE = """fence AS (
    SELECT FROM lease WHERE scope = %s AND holder = %s AND term = %s FOR SHARE
)"""
# the sessions of a holder that lost the lease, but this one
_SESSIONS_OF = """
SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND pid <> pg_backend_pid()
"""
_TAKE_FROM = """
UPDATE lease SET holder = %s, term = term + 1, expires_at = now() + make_interval(secs => %s),
    taken_at = now(), renewed_at = now()
WHERE scope = %s AND holder = %s
RETURNING term
"""
_END_SESSIONS = """
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE application_name = %s AND pid <> pg_backend_pid()
"""
# FOR SHARE: a taker's update of the row waits until the write that checked
# the term commits, so no new term can begin between the check and the commit
_HOLDS = """
SELECT EXISTS (SELECT FROM lease WHERE scope = %s AND term = %s AND holder = %s FOR SHARE)
"""


@dataclass(frozen=True, slots=True)
class Fence:
    """What a leader's writes are fenced by: the lease of ``scope`` held by
    ``holder`` at ``term``."""

    scope: str
    holder: str
    term: int

    def params(self) -> tuple[str, str, int]:
        """:data:`FENCE`'s parameters, in order."""
        return (self.scope, self.holder, self.term)


@dataclass(frozen=True, slots=True)
class HeldLease:
    """A lease as its holder judges it: valid until ``until`` on the
    monotonic clock, which the holder read before it sent the renewal."""

    scope: str
    holder: str
    term: int
    until: float

    @classmethod
    def asked_at(
        cls, scope: str, holder: str, term: int, asked: float, seconds: float
    ) -> HeldLease:
        """The lease taken or renewed for ``seconds`` by a request sent at
        ``asked`` (``time.monotonic()`` before sending it)."""
        return cls(scope, holder, term, asked + seconds)

    def valid(self, now: float | None = None) -> bool:
        """Whether the holder may still act on it (``now``: the monotonic clock)."""
        return (time.monotonic() if now is None else now) < self.until


def _term(row: tuple[Any, ...]) -> int:
    return int(row[0])


def take_lease(scope: str, holder: str, seconds: float) -> Statement[int | None]:
    """Take ``scope``'s lease for ``holder`` for ``seconds``; its term, or
    None while another holder's lease runs."""
    params = {"scope": scope, "holder": holder, "seconds": seconds}
    return fetch_one(_TAKE, params, _term)


def renew_lease(scope: str, holder: str, term: int, seconds: float) -> Statement[int | None]:
    """Extend the lease ``holder`` took at ``term`` by ``seconds`` from now;
    None when another node took it since (the holder must stop at once)."""
    return fetch_one(_RENEW, (seconds, scope, holder, term), _term)


def release_lease(scope: str, holder: str, term: int) -> Statement[int | None]:
    """End the lease ``holder`` holds at ``term`` now; None if it did not."""
    return fetch_one(_RELEASE, (scope, holder, term), _term)


def lease_of(scope: str) -> Statement[tuple[str, int, float] | None]:
    """``scope``'s lease: its holder, term and seconds left (negative: expired
    that long ago), by this database's clock; None if never taken."""
    return fetch_one(
        _LEASE_OF,
        (scope,),
        lambda row: (str(row[0]), int(row[1]), float(row[2])),
    )


def holds_term(scope: str, holder: str, term: int) -> Statement[bool]:
    """Whether ``holder`` still holds ``scope``'s lease at ``term`` (the
    fencing check a leader's write makes in its own transaction: the row
    stays share-locked until that transaction ends)."""
    return Statement(_HOLDS, (scope, term, holder), lambda result: bool(result.rows[0][0]))


def session_name(holder: str) -> str:
    """The ``application_name`` of the database sessions of the process
    that holds (or held) a lease as ``holder`` (``<node>.<process>-<n>``:
    every generation of one process shares it), so a taker can tell
    whether that process still has sessions, and end them."""
    return f"vpnrepl:{holder.rsplit('-', 1)[0]}"[:63]


def sessions_of(holder: str) -> Statement[int]:
    """How many database sessions the process of ``holder`` has now."""
    return Statement(_SESSIONS_OF, (session_name(holder),), lambda r: int(r.rows[0][0] or 0))


def take_lease_from(
    scope: str, holder: str, previous: str, seconds: float
) -> Statement[int | None]:
    """Take ``scope``'s lease from ``previous`` before it ran out (its
    process is gone: see :func:`sessions_of`); the new term, or None when
    ``previous`` no longer holds it."""
    return fetch_one(_TAKE_FROM, (holder, seconds, scope, previous), _term)


def end_sessions(holder: str) -> Statement[int]:
    """End every database session of ``holder``, which lost the lease: a
    leader paused inside a transaction holds its row locks until its session
    ends, and the taker's first writes would wait on them. How many ended."""
    return Statement(_END_SESSIONS, (session_name(holder),), lambda r: int(r.rows[0][0] or 0))


_BEAT = """
INSERT INTO node_heartbeat AS h (node, holder, leads, seen_at) VALUES (%s, %s, %s, now())
ON CONFLICT (node) DO UPDATE SET holder = EXCLUDED.holder, leads = EXCLUDED.leads, seen_at = now()
"""
_HEARTBEATS = """
SELECT node, holder, leads, extract(epoch FROM now() - seen_at) FROM node_heartbeat ORDER BY node
"""


def beat(node: str, holder: str, leads: bool) -> Statement[None]:
    """Record that ``node`` (as ``holder``) is alive now, leading or not."""
    return Statement(_BEAT, (node, holder, leads), lambda result: None)


def heartbeats() -> Statement[list[tuple[str, str, bool, float]]]:
    """Each node's last heartbeat: name, holder, whether it led, seconds ago."""
    return Statement(
        _HEARTBEATS,
        None,
        lambda result: [(str(r[0]), str(r[1]), bool(r[2]), float(r[3])) for r in result.rows],
    )
