"""``txn_log``: the persistent half of the coordinator and the participant.

One row per transaction and side (``coordinator`` on the active site,
``participant`` on the standby), in that site's own database. States move
``prepared`` → ``committed`` → ``ended``, or ``prepared`` → ``aborted``; a
row is never moved back (every update names the states it may leave), so a
late or repeated message cannot undo an outcome.

A prepared row holds the transaction's events (each event's ledger encoding,
u32-length-prefixed): the participant's vote is worth something only if what
it voted on is durable. Parameterised SQL only.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool

from bridge import Event, Published, decode_event, encode_event, split_events

__all__ = ["TxnLog", "TxnRow", "decode_events", "encode_events"]

_U32 = struct.Struct(">I")

COORDINATOR, PARTICIPANT = "coordinator", "participant"


def encode_events(events: Iterable[Event]) -> bytes:
    parts = []
    for event in events:
        data = encode_event(event)
        parts.append(_U32.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def decode_events(data: bytes, vpn: str) -> tuple[Event, ...]:
    return tuple(decode_event(part, vpn) for part in split_events(data))


@dataclass(frozen=True, slots=True)
class TxnRow:
    txid: str
    vpn: str
    side: str
    state: str
    degraded: bool
    ledger_floor: int
    events: tuple[Event, ...]
    #: a client's XA branch: its id, how it ended heuristically, what
    #: happened (see ``sql/versions/0010_xa.py``)
    xid: str | None = None
    heuristic: str | None = None
    hazard: str | None = None
    acks_held: bool = False
    #: the broker user that started the XA branch (None: anyone's, a row
    #: from before schema 0014)
    xa_owner: str | None = None
    #: when the row was made (seconds since the epoch, PostgreSQL's clock):
    #: its commit marker, if any, is newer
    created_at: float = 0.0
    #: seconds since then, by the same clock
    age: float = 0.0

    def recorded_events(self) -> tuple[Event, ...]:
        """The events its commit decision records: all of them, or — a
        branch committed from its log after its channel closed (``hazard``)
        — its publishes alone: the broker had requeued what it acked."""
        if self.hazard is None or self.acks_held:
            return self.events
        return tuple(e for e in self.events if isinstance(e, Published))


#: the VPN's XA branches a transaction manager must still hear of: prepared,
#: or ended heuristically and not forgotten (parameters: vpn)
XA_PENDING = (
    " WHERE vpn = %s AND side = 'coordinator' AND xid IS NOT NULL"
    " AND (state = 'prepared' OR heuristic IS NOT NULL) ORDER BY created_at"
)

#: rows one prune deletes at most (the rest wait for the next)
PRUNE_LIMIT = 10_000
# Rows whose transaction is over on both sites: a coordinator's ended (the
# standby acknowledged its group) or aborted, a participant's committed
# (applied from the stream) or aborted; never an XA branch the transaction
# manager must still hear of (heuristic). The index txn_log_prunable (schema
# 0015) is partial on this very condition on the state: change both together.
_PRUNE = """
DELETE FROM txn_log WHERE txid IN (
    SELECT txid FROM txn_log
    WHERE heuristic IS NULL AND updated_at < now() - make_interval(secs => %s)
      AND (state IN ('ended', 'aborted') OR (side = 'participant' AND state = 'committed'))
    LIMIT %s)
"""

# The gate share-locks the VPN's config row, which a promotion locks first
# (bridge.roles._roles.begin_promotion): a prepare that waited for a promotion
# re-reads the role it left and writes nothing; one that went first is
# committed before the promotion reads the prepared rows, and resolved by it.
_PREPARE_AS_STANDBY = """
WITH gate AS (
    SELECT name FROM vpn_config WHERE name = %s AND role = 'standby' FOR SHARE)
, written AS (
    INSERT INTO txn_log (txid, vpn, side, state, events, xid, xa_owner)
    SELECT %s, name, 'participant', 'prepared', %s, %s, %s FROM gate
    ON CONFLICT (txid) DO NOTHING
    RETURNING 1)
SELECT EXISTS (SELECT FROM gate), EXISTS (SELECT FROM written)
"""

_SELECT = """
SELECT txid, vpn, side, state, degraded, ledger_floor, events, xid, heuristic, hazard, acks_held,
    xa_owner, extract(epoch FROM created_at), extract(epoch FROM now() - created_at)
FROM txn_log
"""


class TxnLog:
    """``txn_log`` of one site, through a small psycopg pool of its own (so
    a prepare never queues behind the ledger writer's batches)."""

    def __init__(self, dsn: str) -> None:
        self.pool: AsyncConnectionPool[AsyncConnection[Any]] = AsyncConnectionPool(
            dsn, min_size=1, max_size=4, open=False, kwargs={"autocommit": True}
        )

    async def open(self) -> None:
        await self.pool.open(wait=True, timeout=30)

    async def close(self) -> None:
        await self.pool.close()

    async def prepare(
        self,
        txid: str,
        vpn: str,
        side: str,
        events: Sequence[Event] | bytes,
        *,
        ledger_floor: int = 0,
        xid: str | None = None,
        xa_owner: str | None = None,
    ) -> bool:
        """Persist a prepared row; False if ``txid`` already has a row (a
        repeated prepare: the first one stands). ``events`` may come
        encoded already (:func:`encode_events`, as the bridge carries them);
        ``xa_owner``: an XA branch's broker user."""
        data = events if isinstance(events, bytes) else encode_events(events)
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "INSERT INTO txn_log (txid, vpn, side, state, events, ledger_floor, xid, xa_owner)"
                " VALUES (%s, %s, %s, 'prepared', %s, %s, %s, %s) ON CONFLICT (txid) DO NOTHING",
                (txid, vpn, side, data, ledger_floor, xid, xa_owner),
            )
            return cur.rowcount == 1

    async def prepare_as_standby(
        self,
        txid: str,
        vpn: str,
        events: bytes,
        *,
        xid: str | None = None,
        xa_owner: str | None = None,
    ) -> bool | None:
        """Persist a participant's prepared row while ``vpn`` is a standby
        here; None (nothing written) when it is not — promoted, or a former
        active: its stream is not applied here, so a yes vote would let the
        old active commit what this site never gets. True if written now,
        False if ``txid`` had a row (a repeated prepare: the first stands)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(_PREPARE_AS_STANDBY, (vpn, txid, events, xid, xa_owner))
            row = await cur.fetchone()
        if row is None or not row[0]:
            return None
        return bool(row[1])

    async def move(
        self,
        txid: str,
        to: str,
        *,
        leaving: Sequence[str],
        degraded: bool | None = None,
        ledger_last: int | None = None,
    ) -> bool:
        """Move ``txid`` to state ``to`` if it is in one of ``leaving``;
        True if it moved."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "UPDATE txn_log SET state = %s, degraded = COALESCE(%s, degraded),"
                " ledger_last = COALESCE(%s, ledger_last), updated_at = now()"
                " WHERE txid = %s AND state = ANY(%s)",
                (to, degraded, ledger_last, txid, list(leaving)),
            )
            return cur.rowcount == 1

    async def move_many(self, txids: Sequence[str], to: str, *, leaving: Sequence[str]) -> int:
        """:meth:`move` for many rows in one statement; returns how many moved."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "UPDATE txn_log SET state = %s, updated_at = now()"
                " WHERE txid = ANY(%s) AND state = ANY(%s)",
                (to, list(txids), list(leaving)),
            )
            return cur.rowcount

    async def end_acknowledged(self) -> int:
        """End committed coordinator rows whose group the standby has
        acknowledged (degraded ones, and any a restart left committed)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "UPDATE txn_log t SET state = 'ended', updated_at = now() FROM vpn_state s"
                " WHERE t.vpn = s.vpn AND t.side = 'coordinator' AND t.state = 'committed'"
                " AND t.ledger_last > 0 AND t.ledger_last <= s.applied_index"
            )
            return cur.rowcount

    async def prune(self, retain_seconds: float, limit: int = PRUNE_LIMIT) -> int:
        """Delete up to ``limit`` rows that ended ``retain_seconds`` ago or
        more; returns how many."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(_PRUNE, (retain_seconds, limit))
            return cur.rowcount

    async def prepared_rows(self, side: str, vpn: str | None = None) -> list[TxnRow]:
        """Rows of ``side`` (of ``vpn``, or of every VPN) still prepared.

        Only those: a standby's participant rows stay ``committed`` once
        applied, one per transaction the VPN ever had, and a reader of
        every row not ended held them all (with their events) at each
        resync and start."""
        return await self._select(
            " WHERE side = %s AND state = 'prepared' AND (%s::text IS NULL OR vpn = %s)"
            " ORDER BY created_at",
            (side, vpn, vpn),
        )

    async def xa_branches(self, vpn: str) -> list[TxnRow]:
        """The VPN's XA branches a transaction manager must still hear of:
        prepared, or ended heuristically and not forgotten."""
        return await self._select(XA_PENDING, (vpn,))

    async def xa_branch(self, vpn: str, xid: str) -> TxnRow | None:
        """The newest coordinator row of XA branch ``xid`` (a prepared one
        first)."""
        rows = await self._select(
            " WHERE vpn = %s AND side = %s AND xid = %s"
            " ORDER BY state = 'prepared' DESC, created_at DESC LIMIT 1",
            (vpn, COORDINATOR, xid),
        )
        return rows[0] if rows else None

    async def _select(self, where: str, params: tuple[object, ...]) -> list[TxnRow]:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            await cur.execute(_SELECT + where, params)
            return [_row(r) for r in await cur.fetchall()]

    async def mark_xa(self, txid: str, *, heuristic: str | None, hazard: str | None = None) -> None:
        """Record how an XA branch ended heuristically (None: forgotten)."""
        async with self.pool.connection() as conn:
            await conn.execute(
                "UPDATE txn_log SET heuristic = %s, hazard = COALESCE(%s, hazard),"
                " updated_at = now() WHERE txid = %s",
                (heuristic, hazard, txid),
            )

    async def release_held(self, txid: str) -> None:
        """A promoted site's branch is resolved: the messages it acked are
        held for it no more."""
        async with self.pool.connection() as conn:
            await conn.execute("DELETE FROM xa_held WHERE txid = %s", (txid,))

    async def created_at(self, txid: str) -> float | None:
        """When ``txid``'s row was made (seconds since the epoch, by the
        database's clock), or None without one."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "SELECT extract(epoch FROM created_at) FROM txn_log WHERE txid = %s", (txid,)
            )
            row = await cur.fetchone()
        return None if row is None else float(row[0])

    async def states(self, txids: Sequence[str]) -> dict[str, str]:
        async with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            await cur.execute(
                "SELECT txid, state FROM txn_log WHERE txid = ANY(%s)", (list(txids),)
            )
            return {str(t): str(s) for t, s in await cur.fetchall()}

    async def decision_index(self, row: TxnRow) -> int | None:
        """The ledger index of the coordinator's decision — the transaction's
        events as one group after ``ledger_floor`` — or None if it was never
        made. The group's first event is unique (a fresh id, or the one
        consumption of a message), so finding it finds the group; the group
        is all or nothing (``LedgerWriter.append_group``)."""
        events = row.recorded_events()
        if not events:
            return None
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "SELECT idx FROM ledger WHERE vpn = %s AND idx > %s AND event = %s"
                " ORDER BY idx LIMIT 1",
                (row.vpn, row.ledger_floor, encode_event(events[0])),
            )
            found = await cur.fetchone()
        return None if found is None else int(found[0])


def _row(r: tuple[object, ...]) -> TxnRow:
    (
        txid,
        vpn,
        side,
        state,
        degraded,
        floor,
        events,
        xid,
        heuristic,
        hazard,
        held,
        owner,
        at,
        age,
    ) = r
    assert isinstance(events, bytes | memoryview)  # noqa: S101 - bytea column
    return TxnRow(
        str(txid),
        str(vpn),
        str(side),
        str(state),
        bool(degraded),
        int(floor),  # type: ignore[call-overload]
        decode_events(bytes(events), str(vpn)),
        None if xid is None else str(xid),
        None if heuristic is None else str(heuristic),
        None if hazard is None else str(hazard),
        bool(held),
        None if owner is None else str(owner),
        float(at),  # type: ignore[arg-type]
        float(age),  # type: ignore[arg-type]
    )
