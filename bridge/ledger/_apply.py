"""Apply ledger entries to ``live_message``: the one apply step of both sites.

Invariant: applying a batch in one call leaves ``live_message`` and
``vpn_state.unknown_acks`` exactly as applying its entries one by one in
index order would, whatever the batch holds (a publish and its consumption,
a replay of applied entries, a consumption of a message never seen). The
active applier (:mod:`bridge.ledger._live`) and the standby applier both go
through :func:`_apply_steps`, so their states compare row for row. Why
batching keeps it: :func:`_plan` folds the entries per ``(queue, repl_id)``,
and only a key's first operation depends on the database, so two phases
commute across keys: delete every key whose row must not survive the batch,
then insert every row present at its end ``ON CONFLICT DO NOTHING``. A
consumption is an unknown ACK when it is its key's first operation and its
delete found no row, or the walk knows the key absent. Each phase is one
statement over ``unnest()`` of binary arrays (:mod:`bridge.ledger._arrays`;
cheaper than ``COPY`` into temp tables, ``bench/RESULTS.md``). The steps are
a generator of statements, driven by :func:`apply_entries` (blocking) and
:func:`apply_entries_async`. Parameterised SQL only; bodies are never logged.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from psycopg.types.numeric import Int8

from bridge._entry import LedgerEntry
from bridge._events import Consumed, DeadLettered, Published, Purged, TopologyChanged
from bridge._ids import ReplicationId
from bridge.store import COUNT_UNKNOWN_ACKS

from ._arrays import bytea_array, int8_array, text_array

__all__ = [
    "ApplyResult",
    "GuardedApply",
    "GuardedTemplate",
    "apply_entries",
    "apply_entries_async",
    "guarded_apply",
    "guarded_template",
    "run_guarded",
    "run_guarded_async",
]

log = logging.getLogger(__name__)

#: Unknown ACKs logged one by one per batch; the rest are summarised in one line
#: (enabling replication on a VPN with a backlog must not flood the log).
UNKNOWN_ACKS_LOGGED_PER_BATCH = 20

_Key = tuple[str, bytes]  # (queue, repl_id)
_Row = tuple[str, bytes, int, str, str, bytes, bytes]

# Each key is looked up on its own (a correlated subquery: one primary-key
# probe per key, whatever the planner believes about the table's size), and
# the rows found are deleted by their tuple ids. A plain join of the keys
# with live_message is planned from statistics, and live_message swings from
# empty to many thousand rows between two autovacuum analyses: with stale
# statistics PostgreSQL hashed every live row of the VPN for each batch
# (measured: 450 us of database CPU per acknowledged message, against 4-7 ms
# per 500-key batch this way).
_DELETE_KEYS = """
DELETE FROM live_message
WHERE ctid = ANY(ARRAY(
    SELECT (SELECT m.ctid FROM live_message m
            WHERE m.vpn = %b AND m.queue = k.queue AND m.repl_id = k.repl_id)
    FROM unnest(%b::text[], %b::bytea[]) AS k(queue, repl_id))){guard}
RETURNING queue, repl_id
"""
_INSERT_ROWS = """
INSERT INTO live_message (vpn, queue, repl_id, publish_index, exchange, routing_key,
                          properties, body)
SELECT %b, r.queue, r.repl_id, r.publish_index{base}, r.exchange, r.routing_key,
       r.properties, r.body
FROM unnest(%b::text[], %b::bytea[], %b::int8[], %b::text[], %b::text[], %b::bytea[],
            %b::bytea[])
     AS r(queue, repl_id, publish_index, exchange, routing_key, properties, body){guard}
ON CONFLICT DO NOTHING{returning}
"""
_DELETE = _DELETE_KEYS.format(guard="")
#: the apply step's removal of acknowledged rows, on its own (the write-floor
#: benchmark times it)
DELETE_ACKED = _DELETE
_INSERT = _INSERT_ROWS.format(base="", guard="", returning="")
# A purge removes the queue's rows published before it (a replay of the purge
# must not remove rows published after it), or before its request went to the
# broker when it says (Purged.sent_at), except the ids it spared.
_PURGE = """
DELETE FROM live_message
WHERE vpn = %b AND queue = %b AND publish_index < %b AND repl_id <> ALL(%b::bytea[])
"""
# A dead-lettered message's row is copied to each queue it went to (arriving
# there at the event's index), then leaves its queue, as a consumption does.
_DEAD_LETTER_COPY = """
INSERT INTO live_message (vpn, queue, repl_id, publish_index, exchange, routing_key,
                          properties, body)
SELECT m.vpn, t.queue, m.repl_id, %b::int8, m.exchange, m.routing_key, m.properties, m.body
FROM live_message m, unnest(%b::text[]) AS t(queue)
WHERE m.vpn = %b AND m.queue = %b AND m.repl_id = %b
ON CONFLICT DO NOTHING
"""
_DEAD_LETTER_REMOVE = """
DELETE FROM live_message WHERE vpn = %b AND queue = %b AND repl_id = %b
"""
# A standby keeps each topology change until a listing taken after it
# (bridge._definitions); a replayed one is kept once.
_KEEP_TOPOLOGY = """
INSERT INTO topology_change (vpn, ledger_index, event) VALUES (%b, %b, %b)
ON CONFLICT DO NOTHING
"""


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What one :func:`apply_entries` call changed."""

    inserted: int = 0
    deleted: int = 0
    unknown_acks: int = 0


@dataclass(slots=True)
class _KeyPlan:
    """The fold of one key's operations in a batch."""

    present: bool  # the key's row exists after the operations walked so far
    delete_first: bool  # the database row must go before the insert phase
    counted: bool  # the first operation was a consumption: a missing row is unknown
    row: _Row | None  # the row to insert at the end, if present by this batch


@dataclass(slots=True)
class _Plan:
    keys: dict[_Key, _KeyPlan] = field(default_factory=dict)
    unknown: list[_Key] = field(default_factory=list)  # known absent when consumed

    @property
    def deletes(self) -> list[_Key]:
        return [k for k, p in self.keys.items() if p.delete_first]

    @property
    def rows(self) -> list[_Row]:
        return [p.row for p in self.keys.values() if p.present and p.row is not None]


def _plan(vpn: str, entries: Sequence[LedgerEntry]) -> _Plan:
    """Fold a run of publishes and consumptions (no purge: see
    :func:`_apply_steps`), already in index order."""
    plan = _Plan()
    for entry in entries:
        event = entry.event
        if isinstance(event, Published):
            for queue in event.queues:
                row: _Row = (
                    queue,
                    event.repl_id.value,
                    entry.index,
                    event.exchange,
                    event.routing_key,
                    event.properties,
                    event.body,
                )
                _publish(plan, (queue, event.repl_id.value), row)
        elif isinstance(event, Consumed):
            _consume(plan, event)
    return plan


def _runs(vpn: str, entries: Sequence[LedgerEntry]) -> list[list[LedgerEntry]]:
    """``entries`` in index order, cut before and after every purge,
    dead-lettering and topology change: each is a run of its own, so each
    run's plan starts from the state the runs before it left (a purge
    empties a whole queue, and a dead-lettering copies a row the fold does
    not hold: neither is a per-key fold)."""
    runs: list[list[LedgerEntry]] = [[]]
    for entry in sorted(entries, key=lambda e: e.index):
        if entry.event.vpn != vpn or entry.vpn != vpn:
            raise ValueError(f"entry {entry.index} belongs to VPN {entry.vpn!r}, not {vpn!r}")
        if isinstance(entry.event, Purged | DeadLettered | TopologyChanged):
            runs += [[entry], []]
        else:
            runs[-1].append(entry)
    return [run for run in runs if run]


def _publish(plan: _Plan, key: _Key, row: _Row) -> None:
    p = plan.keys.get(key)
    if p is None:
        plan.keys[key] = _KeyPlan(present=True, delete_first=False, counted=False, row=row)
    elif not p.present:  # consumed earlier in this batch: the row comes back
        p.present, p.row = True, row
    # else: present already, and one-by-one ``ON CONFLICT DO NOTHING`` keeps it


def _consume(plan: _Plan, event: Consumed) -> None:
    key = (event.queue, event.repl_id.value)
    p = plan.keys.get(key)
    if p is None:
        plan.keys[key] = _KeyPlan(present=False, delete_first=True, counted=True, row=None)
    elif p.present:
        p.present, p.row, p.delete_first = False, None, True
    else:
        plan.unknown.append(key)


@dataclass(frozen=True, slots=True)
class _Execute:
    """Answered with the returned rows when ``returning``, else the row count."""

    sql: str
    params: tuple[Any, ...]
    returning: bool = False


_Step = _Execute


def _apply_steps(
    vpn: str, entries: Sequence[LedgerEntry], keep_topology: bool
) -> Generator[_Step, Any, ApplyResult]:
    """The statements of one apply, in order; each ``yield`` is answered by
    the driver (rows for a ``RETURNING`` statement, a row count otherwise).
    ``keep_topology``: store topology changes (a standby; the active's
    topology is its broker's)."""
    inserted = deleted = unknown = 0
    for run in _runs(vpn, entries):
        event = run[0].event
        if isinstance(event, TopologyChanged):
            if keep_topology:
                yield _Execute(_KEEP_TOPOLOGY, (vpn, run[0].index, run[0].encoded))
            continue
        if isinstance(event, Purged):
            spared = bytea_array([r.value for r in event.spared])
            below = min(run[0].index, event.sent_at) if event.sent_at else run[0].index
            count = yield _Execute(_PURGE, (vpn, event.queue, below, spared))
            deleted += int(count)
            continue
        if isinstance(event, DeadLettered):
            moved = yield from _dead_letter_steps(vpn, run[0].index, event)
            inserted += moved.inserted
            deleted += moved.deleted
            unknown += moved.unknown_acks
            continue
        result = yield from _run_steps(vpn, _plan(vpn, run))
        inserted += result.inserted
        deleted += result.deleted
        unknown += result.unknown_acks
    return ApplyResult(inserted=inserted, deleted=deleted, unknown_acks=unknown)


def _dead_letter_steps(
    vpn: str, index: int, event: DeadLettered
) -> Generator[_Step, Any, ApplyResult]:
    rid = event.repl_id.value
    copied = 0
    if event.to:
        to = text_array(list(event.to))
        copied = yield _Execute(_DEAD_LETTER_COPY, (index, to, vpn, event.queue, rid))
    removed = yield _Execute(_DEAD_LETTER_REMOVE, (vpn, event.queue, rid))
    if removed:
        return ApplyResult(inserted=int(copied), deleted=int(removed))
    yield _Execute(COUNT_UNKNOWN_ACKS, (1, vpn))
    _log_unknown(vpn, [(event.queue, rid)])
    return ApplyResult(unknown_acks=1)


def _run_steps(vpn: str, plan: _Plan) -> Generator[_Step, Any, ApplyResult]:
    """The statements of one run of publishes and consumptions."""
    deletes, rows = plan.deletes, plan.rows
    if not deletes and not rows and not plan.unknown:
        return ApplyResult()
    deleted_keys: set[_Key] = set()
    inserted = 0
    if deletes:
        returned = yield _Execute(_DELETE, (vpn, *_key_columns(deletes)), returning=True)
        deleted_keys = {(str(q), bytes(i)) for q, i in returned}
    if rows:
        inserted = yield _Execute(_INSERT, (vpn, *_row_columns(rows)))
    unknown = _unknown(plan, deleted_keys)
    if unknown:
        yield _Execute(COUNT_UNKNOWN_ACKS, (len(unknown), vpn))
        _log_unknown(vpn, unknown)
    return ApplyResult(inserted=int(inserted), deleted=len(deleted_keys), unknown_acks=len(unknown))


def _key_columns(keys: Sequence[_Key]) -> tuple[bytes, bytes]:
    return text_array([q for q, _ in keys]), bytea_array([i for _, i in keys])


def _row_columns(rows: list[_Row]) -> tuple[bytes, ...]:
    rows.sort(key=_publish_index)  # the order one-by-one inserts would have
    queue, repl_id, index, exchange, routing_key, properties, body = zip(*rows, strict=True)
    return (
        text_array(queue),
        bytea_array(repl_id),
        int8_array(index),
        text_array(exchange),
        text_array(routing_key),
        bytea_array(properties),
        bytea_array(body),
    )


def _unknown(plan: _Plan, deleted: set[_Key]) -> list[_Key]:
    """The run's unknown ACKs: consumptions whose key the delete did not
    find as its first operation, and those of keys known absent."""
    found = [k for k in plan.deletes if plan.keys[k].counted and k not in deleted]
    return found + plan.unknown


def _publish_index(row: _Row) -> int:
    return row[2]


# -- one guarded statement ---------------------------------------------------

_GUARDED_RESULT = """
SELECT (SELECT count(*) FROM go), {inserted},
       ARRAY(SELECT queue FROM del), ARRAY(SELECT repl_id FROM del)
"""
# The unknown ACKs, counted where the statement can see what ``del`` found:
# the counted keys it did not find, plus those known absent.
_GUARDED_UNKNOWN = """
, unknown AS (
    SELECT %s::int8 - count(*) AS n FROM del
    WHERE (queue, repl_id) IN (SELECT * FROM unnest(%b::text[], %b::bytea[])))
, counted AS (
    UPDATE vpn_state SET unknown_acks = unknown_acks + unknown.n, updated_at = now()
    FROM unknown WHERE vpn = %b AND unknown.n > 0 AND EXISTS (SELECT FROM go))
"""
_GUARD_AND = "\n  AND EXISTS (SELECT FROM go)"
_GUARD_WHERE = "\nWHERE EXISTS (SELECT FROM go)"
_NO_DELETE = ", del AS (SELECT NULL::text AS queue, NULL::bytea AS repl_id WHERE false)"
_BASE = ", base AS (SELECT %b::int8 AS n)"
_PLUS_BASE = " + (SELECT n FROM base)"


@dataclass(frozen=True, slots=True)
class GuardedApply:
    """A run of entries as one statement that applies it only when the
    caller's guard holds (:func:`guarded_apply`)."""

    vpn: str
    sql: str
    params: tuple[Any, ...]
    plan: _Plan


@dataclass(frozen=True, slots=True)
class GuardedTemplate:
    """:func:`guarded_template`'s statement, waiting for its guard's
    parameters and its index base."""

    vpn: str
    sql: str
    params: tuple[Any, ...]  # the apply's own, after the guard's and the base
    plan: _Plan

    def bind(self, guard_params: tuple[Any, ...], base: int = 0) -> GuardedApply:
        """The statement to run: the rows' ``publish_index`` is ``base``
        plus their entry's index."""
        params = (*guard_params, Int8(base), *self.params)
        return GuardedApply(self.vpn, self.sql, params, self.plan)


def guarded_apply(
    vpn: str, entries: Sequence[LedgerEntry], guard: str, guard_params: tuple[Any, ...]
) -> GuardedApply | None:
    """:func:`apply_entries`'s effect on ``entries`` as one statement, or
    None when they need more than one (a purge, a dead-lettering, or a key
    both removed and inserted: the statement's parts see one snapshot) or
    are none.

    ``guard`` is the statement's leading ``WITH`` list, whose last query is
    ``go``: the entries are applied, in the same statement and so the same
    transaction as whatever ``guard`` itself writes, only when ``go``
    returns a row. One round trip instead of a transaction's five, for a
    caller on the client's path (the standby committing a transaction
    ahead of the stream, :mod:`bridge.standby._early`).
    """
    template = guarded_template(vpn, entries, guard)
    return None if template is None else template.bind(guard_params)


def guarded_template(
    vpn: str, entries: Sequence[LedgerEntry], guard: str
) -> GuardedTemplate | None:
    """:func:`guarded_apply` in two steps: the statement built now (the
    costly part: the plan and the packed columns), its guard's parameters
    and an index base given when it runs (:meth:`GuardedTemplate.bind`).
    The entries' indexes are then relative to that base, so a transaction's
    events can be made ready before the index its group lands at is known."""
    runs = _runs(vpn, entries)
    if len(runs) != 1 or isinstance(runs[0][0].event, Purged | DeadLettered | TopologyChanged):
        return None
    plan = _plan(vpn, runs[0])
    if any(plan.keys[k].present for k in plan.deletes):
        return None  # removed, then inserted again: two statements
    sql = [guard, _BASE]
    params: list[Any] = []
    if plan.deletes:
        delete = _DELETE_KEYS.format(guard=_GUARD_AND)
        sql.append(f", del AS ({delete})")
        params += (vpn, *_key_columns(plan.deletes))
    else:
        sql.append(_NO_DELETE)
    rows = plan.rows
    if rows:
        insert = _INSERT_ROWS.format(base=_PLUS_BASE, guard=_GUARD_WHERE, returning="\nRETURNING 1")
        sql.append(f", ins AS ({insert})")
        params += (vpn, *_row_columns(rows))
    counted = [k for k in plan.deletes if plan.keys[k].counted]
    if counted or plan.unknown:
        sql.append(_GUARDED_UNKNOWN)
        params += (len(counted) + len(plan.unknown), *_key_columns(counted), vpn)
    sql.append(_GUARDED_RESULT.format(inserted="(SELECT count(*) FROM ins)" if rows else "0"))
    return GuardedTemplate(vpn, "".join(sql), tuple(params), plan)


def run_guarded(conn: psycopg.Connection[Any], apply: GuardedApply) -> ApplyResult | None:
    """Execute ``apply``; None when its guard did not let it apply anything."""
    with conn.cursor(row_factory=tuple_row) as cur:
        row = cur.execute(apply.sql, apply.params).fetchone()
    return _guarded_result(apply, row)


async def run_guarded_async(
    conn: psycopg.AsyncConnection[Any], apply: GuardedApply
) -> ApplyResult | None:
    """:func:`run_guarded` on an asyncio connection (the bridge's loop)."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(apply.sql, apply.params)
        row = await cur.fetchone()
    return _guarded_result(apply, row)


def _guarded_result(apply: GuardedApply, row: tuple[Any, ...] | None) -> ApplyResult | None:
    if row is None or not row[0]:
        return None
    deleted = {(str(q), bytes(i)) for q, i in zip(row[2], row[3], strict=True)}
    unknown = _unknown(apply.plan, deleted)
    if unknown:
        _log_unknown(apply.vpn, unknown)
    return ApplyResult(inserted=int(row[1]), deleted=len(deleted), unknown_acks=len(unknown))


def _log_unknown(vpn: str, unknown: list[_Key]) -> None:
    for queue, repl_id in unknown[:UNKNOWN_ACKS_LOGGED_PER_BATCH]:
        log.warning(
            "VPN %r: ACK for unknown message %s on queue %r "
            "(published before replication was enabled, or not through the listener)",
            vpn,
            ReplicationId(repl_id),
            queue,
        )
    if len(unknown) > UNKNOWN_ACKS_LOGGED_PER_BATCH:
        log.warning(
            "VPN %r: %d more ACKs for unknown messages in this batch",
            vpn,
            len(unknown) - UNKNOWN_ACKS_LOGGED_PER_BATCH,
        )


def apply_entries(
    conn: psycopg.Connection[Any],
    vpn: str,
    entries: Sequence[LedgerEntry],
    *,
    keep_topology: bool = False,
) -> ApplyResult:
    """Apply ``entries`` of ``vpn`` in index order inside the caller's
    transaction; ``keep_topology``: a standby's apply, which keeps the
    topology changes too (:mod:`bridge._definitions`)."""
    steps = _apply_steps(vpn, entries, keep_topology)
    answer: Any = None
    with conn.cursor(row_factory=tuple_row) as cur:
        try:
            while True:
                step = steps.send(answer)
                cur.execute(step.sql, step.params)
                answer = cur.fetchall() if step.returning else cur.rowcount
        except StopIteration as done:
            result: ApplyResult = done.value
            return result


async def apply_entries_async(
    conn: psycopg.AsyncConnection[Any], vpn: str, entries: Sequence[LedgerEntry]
) -> ApplyResult:
    """:func:`apply_entries` on an asyncio connection: the same statements
    (the active's: topology changes are not kept)."""
    steps = _apply_steps(vpn, entries, False)
    answer: Any = None
    async with conn.cursor(row_factory=tuple_row) as cur:
        try:
            while True:
                step = steps.send(answer)
                await cur.execute(step.sql, step.params)
                answer = await cur.fetchall() if step.returning else cur.rowcount
        except StopIteration as done:
            result: ApplyResult = done.value
            return result
