"""A VPN's role changes in the site database: promotion, fencing, demotion.

Invariant: a VPN's epoch only rises, and on a site only the promotion's
first transaction raises it, before anything else of the promotion.
:func:`begin_promotion` locks the VPN's rows and in one transaction raises
the epoch, makes the role ``active``, records the promotion ``running`` and
resolves the standby's in-doubt transactions (:func:`_resolve_in_doubt`);
every standby apply locks ``vpn_state`` and refuses a VPN not ``standby``
(``NotStandby``), so no event of the old epoch is applied once the new one
exists. A re-run after a crash resumes at the same epoch. A former active
that learns of a higher epoch records itself fenced (:func:`record_fenced`).
Why each step: docs/behaviour.md, "Disaster recovery". Blocking (psycopg's
synchronous API); asyncio callers use a thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from bridge._entry import LedgerEntry, decode_event, split_events
from bridge._errors import BridgeError
from bridge._events import Consumed, DeadLettered, Published
from bridge._settings import Role
from bridge.ledger import apply_entries
from bridge.store import (
    become_active,
    become_standby,
    close_left_open,
    fence_vpn,
    lock_for_demotion,
    lock_for_promotion,
    record_epoch,
    stored_ledger_index,
)

__all__ = [
    "PromotionStart",
    "RoleError",
    "Tail",
    "TailMessage",
    "TakeoverUnknown",
    "begin_promotion",
    "demote_to_standby",
    "ensure_fenced",
    "fail_promotion",
    "finish_promotion",
    "read_tail",
    "record_fenced",
]


class RoleError(BridgeError):
    """A role change that the VPN's state does not allow (not enabled, not a
    standby, fenced); the text says what to do instead."""


class TakeoverUnknown(RoleError):
    """A fenced former active that does not know yet where the newer epoch
    took over (its fence came from a standby's report): its tail cannot be
    told from what the new active holds. The node learns it from the new
    active's listing; asking again then succeeds."""


@dataclass(frozen=True, slots=True)
class PromotionStart:
    """What the promotion's first step found and did."""

    vpn: str
    epoch: int
    #: a promotion interrupted earlier is resumed (the epoch was raised then)
    resumed: bool
    #: in-doubt transactions committed / prepared rows already committed early
    txns_committed: int
    txns_committed_early: int
    #: the standby's applied index: the new active's ledger continues after it
    ledger_index: int


_PREPARED = """
SELECT txid, state, events, ledger_floor FROM txn_log
WHERE vpn = %s AND side = 'participant' AND state IN ('prepared', 'applied')
    AND (xid IS NULL OR state = 'applied')
ORDER BY created_at, txid
FOR UPDATE
"""
# A client's XA branch prepared here waits for its transaction manager: the
# new active's row now, and the messages it acked stay out of the broker
# (xa_held) until it is committed (they are gone) or rolled back (published).
_XA_PREPARED = """
SELECT txid, events FROM txn_log
WHERE vpn = %s AND side = 'participant' AND state = 'prepared' AND xid IS NOT NULL
ORDER BY created_at, txid
"""
_XA_TAKEN = """
UPDATE txn_log SET side = 'coordinator', acks_held = true, updated_at = now()
WHERE txid = ANY(%s)
"""
_LIVE_OF = """
SELECT count(*) FROM live_message WHERE vpn = %s AND (repl_id, queue) IN
    (SELECT * FROM unnest(%s::bytea[], %s::text[]))
"""
_XA_HOLD = """
INSERT INTO xa_held (vpn, repl_id, queue, txid)
SELECT %s, r, q, t FROM unnest(%s::bytea[], %s::text[], %s::text[]) AS h(r, q, t)
ON CONFLICT DO NOTHING
"""
#: the highest index a live row holds (groups committed early lie past the applied index)
_LIVE_TOP = "SELECT coalesce(max(publish_index), 0) FROM live_message WHERE vpn = %s"
_SETTLE = "UPDATE txn_log SET state = 'committed', updated_at = now() WHERE txid = ANY(%s)"
# the rows the promotion commits keep the last index their group holds in the
# live state: `republish` skips a tail message such a row published (it was
# here, maybe consumed since), and no other (a row settled committed by an
# outcome only learned how the transaction ended: its group may never have
# come)
_SETTLE_HELD = """
UPDATE txn_log t SET state = 'committed', ledger_last = s.last, updated_at = now()
FROM unnest(%s::text[], %s::bigint[]) AS s(txid, last) WHERE t.txid = s.txid
"""
_LIVE_INDEX = """
INSERT INTO vpn_live_state (vpn, live_index) VALUES (%s, %s)
ON CONFLICT (vpn) DO UPDATE SET live_index = EXCLUDED.live_index
"""
# Replication ids are (incarnation, counter); each site numbers its own
# incarnations, so the new active must hand out only incarnations above every
# one in the state it took over, or it could repeat an id the old active made.
_INCARNATIONS_PAST = """
SELECT setval(pg_get_serial_sequence('node_incarnation', 'incarnation'), GREATEST(
    nextval(pg_get_serial_sequence('node_incarnation', 'incarnation')),
    (SELECT COALESCE(max(('x' || encode(substring(repl_id FROM 1 FOR 8), 'hex'))::bit(64)::bigint),
                     0) FROM live_message)))
"""
_RUNNING = """
INSERT INTO promotion (vpn, epoch, state, txns_committed) VALUES (%s, %s, 'running', %s)
ON CONFLICT (vpn) DO UPDATE SET epoch = EXCLUDED.epoch, state = 'running', materialised = 0,
    total = 0, txns_committed = EXCLUDED.txns_committed, txns_aborted = 0, error = NULL,
    started_at = now(), finished_at = NULL
"""


def begin_promotion(conn: psycopg.Connection[Any], vpn: str, site: str) -> PromotionStart:
    """Make ``vpn`` active here with its epoch raised by one (or find the
    promotion an interrupted run began), in one transaction."""
    with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
        found = lock_for_promotion(vpn).run(conn)
        if found is None:
            raise RoleError(f"VPN {vpn!r} is not known on this site", vpn)
        epoch = found.epoch
        if not found.enabled:
            raise RoleError(f"replication of VPN {vpn!r} is disabled on this site", vpn)
        if found.role is Role.ACTIVE:
            if found.promotion in ("running", "failed") and found.promotion_epoch == epoch:
                ledger_index = stored_ledger_index(vpn).run(conn)
                return PromotionStart(vpn, epoch, True, 0, 0, ledger_index)
            if found.fenced:
                raise RoleError(
                    f"VPN {vpn!r} is a fenced former active here: `vpnrepl demote {vpn}` "
                    "makes it a standby of the new active",
                    vpn,
                )
            raise RoleError(f"VPN {vpn!r} is already active on this site", vpn)
        new_epoch = epoch + 1
        applied = found.applied_index
        committed, early, ledger_index = _resolve_in_doubt(conn, vpn, new_epoch, applied)
        become_active(vpn, new_epoch, ledger_index).run(conn)
        cur.execute(_LIVE_INDEX, (vpn, ledger_index))
        # a standby keeps no ledger; rows left from an earlier time as active
        # would collide with the indexes the new ledger hands out
        cur.execute("DELETE FROM ledger WHERE vpn = %s", (vpn,))
        record_epoch(vpn, new_epoch, site, applied).run(conn)
        cur.execute(_INCARNATIONS_PAST)
        cur.execute(_RUNNING, (vpn, new_epoch, committed + early))
        cur.execute("DELETE FROM promotion_queue WHERE vpn = %s", (vpn,))
    return PromotionStart(vpn, new_epoch, False, committed, early, ledger_index)


def _resolve_in_doubt(
    conn: psycopg.Connection[Any], vpn: str, epoch: int, applied: int
) -> tuple[int, int, int]:
    """Commit every local transaction the standby voted yes on and holds
    without a decision; returns (committed now, committed early before, the
    index the applied state reaches).

    Why commit (presumed commit), not abort: the standby voted yes, so the
    active was free to commit, and a client can have been told committed
    without the standby learning it — a sync-mode ``tx.commit`` whose
    standby stopped answering after the broker committed gets
    ``tx.commit-ok`` once the sync timeout passes, under either policy.
    Aborting such a transaction would lose what a client was told is
    committed. The price: a transaction whose client was *not* told
    committed (its connection dropped during the commit, or its vote came
    after the timeout under ``reject``) is applied too; its client never saw
    ``tx.commit-ok`` and must treat the outcome as unknown anyway. Rows
    ``applied`` (committed early) are in the live state already. Each row
    settled keeps the last index of its group here (``ledger_last``): the
    mark by which ``republish`` knows this site had its messages.

    A prepared row's group never reached this standby (else the stream
    would have settled the row), so its events go right after the applied
    index, as the group would have come next — after the groups committed
    early, whose live rows already hold the indexes right after it (the new
    ledger, and a checkpoint of the live state, must start past them)."""
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(_PREPARED, (vpn,))
        rows = cur.fetchall()
        _take_xa_branches(cur, vpn)
        cur.execute(_LIVE_TOP, (vpn,))
        top = cur.fetchone()
    committed: list[str] = []
    early: list[str] = []
    lasts: list[int] = []  # per row settled, in committed + early order
    early_lasts: list[int] = []
    index = max(applied, int(top[0]) if top else 0)
    for txid, state, events, floor in rows:
        encoded = split_events(bytes(events))
        if state == "applied":  # its group holds the indexes from its floor on
            early.append(txid)
            early_lasts.append(max(int(floor) + len(encoded) - 1, 0))
            continue
        entries = [
            LedgerEntry(vpn, epoch, index + 1 + i, decode_event(data, vpn), data)
            for i, data in enumerate(encoded)
        ]
        if entries:
            apply_entries(conn, vpn, entries)
            index += len(entries)
        committed.append(txid)
        lasts.append(index)
    if committed or early:
        conn.execute(_SETTLE_HELD, (committed + early, lasts + early_lasts))
    return len(committed), len(early), index


def _take_xa_branches(cur: psycopg.Cursor[Any], vpn: str) -> None:
    """XA branches prepared here become the new active's, their acked
    messages held (see ``_XA_TAKEN``) — except a branch the old active
    committed whose outcome did not arrive: its group came with the stream
    (its publishes are live here, or every message it acked is gone), so
    it is settled committed instead of being committed twice."""
    cur.execute(_XA_PREPARED, (vpn,))
    taken: list[str] = []
    settled: list[str] = []
    held: list[tuple[bytes, str, str]] = []
    for txid, data in cur.fetchall():
        events = [decode_event(d, vpn) for d in split_events(bytes(data))]
        published = [(e.repl_id.value, q) for e in events if isinstance(e, Published)
                     for q in e.queues]  # fmt: skip
        acked = [(e.repl_id.value, e.queue) for e in events
                 if isinstance(e, Consumed | DeadLettered)]  # fmt: skip
        if _committed_by_stream(cur, vpn, published, acked):
            settled.append(str(txid))
            continue
        taken.append(str(txid))
        held += [(r, q, str(txid)) for r, q in acked]
    if settled:
        cur.execute(_SETTLE, (settled,))
    if taken:
        cur.execute(_XA_TAKEN, (taken,))
    if held:
        ids, queues, txids = (list(c) for c in zip(*held, strict=True))
        cur.execute(_XA_HOLD, (vpn, ids, queues, txids))


def _committed_by_stream(
    cur: psycopg.Cursor[Any],
    vpn: str,
    published: list[tuple[bytes, str]],
    acked: list[tuple[bytes, str]],
) -> bool:
    def live(keys: list[tuple[bytes, str]]) -> int:
        cur.execute(_LIVE_OF, (vpn, [k[0] for k in keys], [k[1] for k in keys]))
        row = cur.fetchone()
        return int(row[0]) if row else 0

    if published:
        return live(published) > 0
    return bool(acked) and live(acked) == 0


def finish_promotion(conn: psycopg.Connection[Any], vpn: str, epoch: int) -> None:
    """The live messages are in the broker (the materialiser kept the
    counts): the promotion is done."""
    with conn.transaction():
        conn.execute(
            "UPDATE promotion SET state = 'done', finished_at = now()"
            " WHERE vpn = %s AND epoch = %s",
            (vpn, epoch),
        )


def fail_promotion(conn: psycopg.Connection[Any], vpn: str, error: str) -> None:
    """Record why the promotion stopped; a re-run resumes it."""
    with conn.transaction():
        conn.execute(
            "UPDATE promotion SET state = 'failed', error = %s WHERE vpn = %s AND state <> 'done'",
            (error, vpn),
        )


def record_fenced(
    conn: psycopg.Connection[Any], vpn: str, epoch: int, site: str, taken_over_at: int = 0
) -> bool:
    """The peer ``site`` holds ``vpn`` active at the higher ``epoch`` (taken
    over at ``taken_over_at`` of this site's ledger): this site's active VPN
    is fenced. True when it was not fenced before."""
    with conn.transaction():
        return fence_vpn(vpn, epoch, site, taken_over_at).run(conn)


@dataclass(frozen=True, slots=True)
class TailMessage:
    """A message this site confirmed that the new active never had: published
    after the index the new active took over at, still live here."""

    repl_id: bytes
    exchange: str
    routing_key: str
    queues: tuple[str, ...]
    properties: bytes
    body: bytes


@dataclass(frozen=True, slots=True)
class Tail:
    """A fenced former active's unreplicated tail."""

    vpn: str
    #: the epoch that took the VPN over, and the index of this site's ledger
    #: up to which the new active had applied it
    epoch: int
    taken_over_at: int
    messages: tuple[TailMessage, ...]
    #: consumptions (and purges, dead-letterings) after that index: their
    #: messages are still live on the new active
    other_events: int
    #: topology changes made through this site's listener after that index
    #: (declares, binds, deletes): the new active does not have them
    topology_changes: int = 0


_TAIL = """
SELECT repl_id, min(publish_index), exchange, routing_key, properties, body,
       array_agg(queue ORDER BY queue)
FROM live_message WHERE vpn = %s AND publish_index > %s
GROUP BY repl_id, exchange, routing_key, properties, body
ORDER BY 2
"""


def _fenced_here(conn: psycopg.Connection[Any], vpn: str) -> tuple[int, int, int, int]:
    """(ledger index, live index, newest epoch, its takeover index) of a
    fenced former active, its rows locked; RoleError for anything else."""
    found = lock_for_demotion(vpn).run(conn)
    if found is None:
        raise RoleError(f"VPN {vpn!r} is not known on this site", vpn)
    if not found.enabled:
        raise RoleError(f"replication of VPN {vpn!r} is disabled on this site", vpn)
    if found.role is not Role.ACTIVE or not found.fenced:
        raise RoleError(
            f"VPN {vpn!r} is {found.role.value}{'' if found.fenced else ' and not fenced'} here: "
            "demote turns a fenced former active into a standby (for a controlled swap of two "
            "live sites, run `vpnrepl switchover` on the standby)",
            vpn,
        )
    if found.epoch is None or found.taken_over_at is None:
        raise RoleError(f"VPN {vpn!r} has no epoch history on this site", vpn)
    if found.epoch <= found.own_epoch:
        # the newest epoch recorded is this site's own: the tail would start
        # where this site took the VPN over, and take in what the new active
        # holds already
        raise TakeoverUnknown(
            f"VPN {vpn!r} is fenced, but where the newer epoch took it over is not known here "
            "yet (the fence came from a standby's report); the node learns it from the new "
            "active's listing once its bridge reaches that site: retry then",
            vpn,
        )
    return found.ledger_index, found.live_index, found.epoch, found.taken_over_at


def ensure_fenced(conn: psycopg.Connection[Any], vpn: str) -> None:
    """RoleError unless ``vpn`` is a fenced former active here."""
    with conn.transaction():
        _fenced_here(conn, vpn)


def read_tail(conn: psycopg.Connection[Any], vpn: str) -> Tail:
    """The unreplicated tail of a fenced former active: what it confirmed
    after the index the new active took over at and still holds live (its
    live state is brought up to its whole ledger first)."""
    with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
        ledger_index, live_index, epoch, taken_over_at = _fenced_here(conn, vpn)
        if live_index < ledger_index:
            _catch_up_live(conn, vpn, live_index, ledger_index)
        cur.execute(_TAIL, (vpn, taken_over_at))
        messages = tuple(
            TailMessage(bytes(rid), exchange, key, tuple(queues), bytes(props), bytes(body))
            for rid, _, exchange, key, props, body, queues in cur.fetchall()
        )
        cur.execute(
            "SELECT count(*) FILTER (WHERE kind NOT IN ('published', 'topology')),"
            " count(*) FILTER (WHERE kind = 'topology')"
            " FROM ledger WHERE vpn = %s AND idx > %s",
            (vpn, taken_over_at),
        )
        others, topology = cur.fetchone() or (0, 0)
    return Tail(vpn, epoch, taken_over_at, messages, int(others), int(topology))


def _catch_up_live(conn: psycopg.Connection[Any], vpn: str, live: int, ledger_index: int) -> None:
    """Apply the ledger entries above ``live`` to this site's live state (a
    node stopped between a ledger commit and its apply), as the ledger
    writer does at start."""
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(
            "SELECT idx, epoch, event FROM ledger WHERE vpn = %s AND idx > %s ORDER BY idx",
            (vpn, live),
        )
        entries = [
            LedgerEntry(vpn, int(epoch), int(idx), decode_event(bytes(data), vpn), bytes(data))
            for idx, epoch, data in cur.fetchall()
        ]
    if entries:
        apply_entries(conn, vpn, entries)
    conn.execute("UPDATE vpn_live_state SET live_index = %s WHERE vpn = %s", (ledger_index, vpn))


_RETIRE_PREPARED = """
UPDATE txn_log SET state = 'ended', updated_at = now()
WHERE vpn = %s AND side = 'coordinator' AND state = 'prepared'
"""


def demote_to_standby(conn: psycopg.Connection[Any], vpn: str) -> int:
    """Make a fenced former active a standby of the epoch that took it over,
    with nothing applied (the new active sends it a checkpoint); returns
    that epoch. Its ledger and live state go: they are the old epoch's. So
    do its transactions still prepared: the new active decided them (a
    client's XA branch is its row now), and a stale row here would list a
    branch the transaction manager has settled, and commit it a second
    time, once this site is active again. A sync-ineligible window still
    open (its node stopped before the standby caught up) is closed at the
    ledger index first, as a node's start would: the index goes to 0."""
    with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
        _, _, epoch, _ = _fenced_here(conn, vpn)
        close_left_open(vpn).run(conn)
        become_standby(vpn, epoch).run(conn)
        cur.execute(_RETIRE_PREPARED, (vpn,))
        cur.execute("DELETE FROM xa_held WHERE vpn = %s", (vpn,))
        cur.execute("DELETE FROM ledger WHERE vpn = %s", (vpn,))
        cur.execute("DELETE FROM live_message WHERE vpn = %s", (vpn,))
        cur.execute("UPDATE vpn_live_state SET live_index = 0 WHERE vpn = %s", (vpn,))
        cur.execute("DELETE FROM promotion WHERE vpn = %s", (vpn,))
        cur.execute("DELETE FROM promotion_queue WHERE vpn = %s", (vpn,))
    return epoch
