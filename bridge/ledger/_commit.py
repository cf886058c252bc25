"""One group-commit batch into the ledger, exactly once, however long the
store is away.

Invariant: a batch is committed whole and once, and :meth:`BatchCommitter.commit`
returns only after its COMMIT did. The batch is one statement (autocommit,
one round trip): it advances ``vpn_state.ledger_index`` only where it is
still the index the writer continues from, and inserts the rows of those
VPNs. Anything else (a commit whose reply was lost: the connection died
after COMMIT was sent) goes to a second transaction that locks the VPNs'
``vpn_state`` rows and skips the entries at or below their
``ledger_index``, after checking the stored events are byte for byte the
ones pending; anything else unexpected there is a second writer
(:class:`~bridge.ledger._errors.LedgerConflict`), and the writer stops
rather than guess. A transient failure is retried for as long as it
takes: dropping an entry would lose a confirmed message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from bridge._entry import LedgerEntry, entries_by_vpn
from bridge._events import DeadLettered, Event, Published, TopologyChanged
from bridge.store import FENCE, Fence, advance_ledger_indexes, holds_term, lock_ledger_indexes

from ._arrays import bytea_array, int8_array, text_array
from ._errors import LedgerConflict, LedgerFenced, UnstorableEvent, describe_error as _describe
from ._retry import retry_log_level, retry_store

__all__ = ["BatchCommitter", "check_storable"]

log = logging.getLogger(__name__)

#: Errors after which the same transaction may succeed: connection loss,
#: server shutdown or crash, resource exhaustion, serialisation conflicts
#: (psycopg maps SQLSTATE classes 08, 40, 53, 57 to ``OperationalError``), and
#: our own per-attempt timeout. Anything else is a bug or a second writer.
_TRANSIENT = (psycopg.OperationalError, OSError, TimeoutError)

# The batch in one statement: the rows of each VPN whose ledger_index is the
# one this writer continues from, and the advanced ledger_index. Rows go in
# as binary array parameters of one INSERT ... SELECT FROM unnest(...): as
# fast as binary COPY, in one round trip instead of about six.
_ADVANCE = """advanced AS (
    UPDATE vpn_state s SET ledger_index = v.last, updated_at = now()
    FROM unnest(%b::text[], %b::int8[], %b::int8[]) AS v(vpn, after, last)
    WHERE s.vpn = v.vpn AND s.ledger_index = v.after"""
_ADVANCED = "\nWITH " + _ADVANCE + "\n    RETURNING s.vpn\n)"
# The same under a leader's lease: nothing advances unless the lease is
# still held at the writer's term (FENCE's three parameters come first).
_ADVANCED_FENCED = (
    "WITH "  # noqa: S608 - constant SQL pieces; every value is a parameter
    + FENCE
    + ", "
    + _ADVANCE
    + " AND EXISTS (SELECT FROM fence)\n    RETURNING s.vpn\n)"
)
_INSERT_ADVANCED = """
INSERT INTO ledger (vpn, idx, epoch, kind, event)
SELECT r.vpn, r.idx, r.epoch, r.kind, r.event
FROM unnest(%b::text[], %b::int8[], %b::int8[], %b::text[], %b::bytea[])
     AS r(vpn, idx, epoch, kind, event)
WHERE r.vpn IN (SELECT vpn FROM advanced)
"""
_APPEND = _ADVANCED + _INSERT_ADVANCED
_APPEND_FENCED = _ADVANCED_FENCED + _INSERT_ADVANCED
# The same, for a batch that holds local transactions' commit groups
# (append_group with a decision): their coordinator rows in ``txn_log`` move
# prepared -> committed in the same statement, only where the VPN's entries
# went in, so a row is committed exactly when its group is in the ledger.
_DECIDED = """, decided AS (
    UPDATE txn_log t SET state = 'committed', ledger_last = d.last, updated_at = now()
    FROM unnest(%b::text[], %b::int8[]) AS d(txid, last)
    WHERE t.txid = d.txid AND t.state = 'prepared' AND t.vpn IN (SELECT vpn FROM advanced)
)"""
_APPEND_DECIDING = _ADVANCED + _DECIDED + _INSERT_ADVANCED
_APPEND_DECIDING_FENCED = _ADVANCED_FENCED + _DECIDED + _INSERT_ADVANCED
# The decisions alone, inside _write_checked's transaction.
_DECIDE = """
UPDATE txn_log t SET state = 'committed', ledger_last = d.last, updated_at = now()
FROM unnest(%b::text[], %b::int8[]) AS d(txid, last)
WHERE t.txid = d.txid AND t.state = 'prepared'
"""
_STORED = """
SELECT idx, epoch, event FROM ledger WHERE vpn = %s AND idx BETWEEN %s AND %s ORDER BY idx
"""
_INSERT = """
INSERT INTO ledger (vpn, idx, epoch, kind, event)
SELECT * FROM unnest(%b::text[], %b::int8[], %b::int8[], %b::text[], %b::bytea[])
"""

#: (vpn, the last index of a group) -> the transaction it decides (append_group)
Decisions = Mapping[tuple[str, int], str]


def check_storable(event: Event) -> None:
    """Raise :class:`UnstorableEvent` for an event PostgreSQL would refuse
    (a NUL in a name), before it takes an index."""
    if isinstance(event, Published):
        bad = "\x00" in event.exchange or "\x00" in event.routing_key
        bad = bad or any("\x00" in q for q in event.queues)
    elif isinstance(event, TopologyChanged):
        bad = False  # its names are inside JSON, which escapes a NUL
    else:
        bad = "\x00" in event.queue
        if isinstance(event, DeadLettered):  # the queues it is moved to, too
            bad = bad or any("\x00" in q for q in event.to)
    if bad:
        raise UnstorableEvent("a name contains NUL, which PostgreSQL refuses", event.vpn)


def _columns(entries: Sequence[LedgerEntry]) -> tuple[bytes, ...]:
    """The ledger rows of ``entries`` as the columns ``_APPEND``/``_INSERT`` take."""
    return (
        text_array([e.vpn for e in entries]),
        int8_array([e.index for e in entries]),
        int8_array([e.epoch for e in entries]),
        text_array([e.kind for e in entries]),
        bytea_array([e.encoded for e in entries]),
    )


def _decided_in(entries: Sequence[LedgerEntry], decisions: Decisions) -> tuple[bytes, bytes] | None:
    """The ``(txids, last indexes)`` columns of the decisions whose groups
    end in ``entries``; None when there are none."""
    if not decisions:
        return None
    txids, lasts = [], []
    for e in entries:
        txid = decisions.get((e.vpn, e.index))
        if txid is not None:
            txids.append(txid)
            lasts.append(e.index)
    return (text_array(txids), int8_array(lasts)) if txids else None


class BatchCommitter:
    """The ledger writer's connection to the store: commits a batch,
    retrying transient failures; counts and logs them (``pending()``: the
    entries waiting, for the log lines; ``failed()``: one attempt failed)."""

    def __init__(
        self,
        dsn: str,
        *,
        pending: Callable[[], int],
        failed: Callable[[], None],
        min_backoff: float,
        max_backoff: float,
        attempt_timeout: float,
    ) -> None:
        self._dsn = dsn
        self._pending = pending
        self._failed = failed
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._attempt_timeout = attempt_timeout
        self._conn: psycopg.AsyncConnection[Any] | None = None
        #: The last error of an attempt while the store is failing, else None.
        self.store_error: BaseException | None = None
        #: the lease every batch is committed under (None: no lease, one
        #: writer by other means: a tool, a test)
        self.fence: Fence | None = None

    async def connection(self) -> psycopg.AsyncConnection[Any]:
        """The commit connection (made anew when there is none or it broke)."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            await self.disconnect()
            self._conn = await psycopg.AsyncConnection.connect(
                self._dsn, autocommit=True, connect_timeout=10
            )
        return self._conn

    async def disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            await conn.close()

    async def commit(self, entries: list[LedgerEntry], decisions: Decisions) -> None:
        """Commit ``entries`` (and the decisions of the groups ending among
        them), retrying until it is done."""

        async def once(batch: list[LedgerEntry]) -> None:
            await self._commit_once(batch, decisions)

        await self.retrying(once, entries, "ledger commit")

    async def retrying(
        self,
        attempt_once: Callable[[list[LedgerEntry]], Awaitable[None]],
        entries: list[LedgerEntry],
        what: str,
    ) -> None:
        """Run ``attempt_once(entries)`` until it succeeds, retrying transient
        failures for as long as it takes (the live-state applier's too, so
        outages are counted and reported in one place)."""
        if self.store_error is None:
            try:  # the usual case, without building a retry loop per batch
                await attempt_once(entries)
                return
            except _TRANSIENT as e:
                self.store_error = e
                self._failed()
                log.warning(
                    "%s attempt failed (%s); %d entries pending, retrying",
                    what,
                    _describe(e),
                    self._pending(),
                )

        def failed(error: BaseException | None, n: int) -> None:
            self._failed()
            self.store_error = error
            if (level := retry_log_level(n)) is not None:
                log.log(
                    level,
                    "%s attempt %d failed (%s); %d entries pending, retrying",
                    what,
                    n,
                    _describe(error) if error is not None else "?",
                    self._pending(),
                )

        await retry_store(
            lambda: attempt_once(entries),
            retried=_TRANSIENT,
            min_backoff=self._min_backoff,
            max_backoff=self._max_backoff,
            failed=failed,
        )
        if self.store_error is not None:
            log.warning("ledger store is back; %d entries pending", self._pending())
            self.store_error = None

    async def _commit_once(self, entries: list[LedgerEntry], decisions: Decisions) -> None:
        try:
            async with asyncio.timeout(self._attempt_timeout):
                await self._write(await self.connection(), entries, decisions)
        except BaseException:
            # The outcome may be unknown (a lost COMMIT reply, a cancelled
            # statement): start the next attempt on a fresh session, whose
            # lock-and-check in _write_checked sorts out what did commit.
            await self.disconnect()
            raise

    async def _write(
        self, conn: psycopg.AsyncConnection[Any], entries: list[LedgerEntry], decisions: Decisions
    ) -> None:
        by_vpn = entries_by_vpn(entries)
        after = [items[0].index - 1 for items in by_vpn.values()]
        last = [items[-1].index for items in by_vpn.values()]
        decided = _decided_in(entries, decisions)
        fence = self.fence
        params = (list(by_vpn), after, last, *(decided or ()), *_columns(entries))
        if decided is None:
            sql = _APPEND if fence is None else _APPEND_FENCED
        else:
            sql = _APPEND_DECIDING if fence is None else _APPEND_DECIDING_FENCED
        async with conn.cursor() as cur:
            # autocommit: one statement, one transaction, one round trip
            await cur.execute(sql, params if fence is None else (*fence.params(), *params))
            if cur.rowcount == len(entries):
                return
        await self._write_checked(conn, by_vpn, decided)

    async def _write_checked(
        self,
        conn: psycopg.AsyncConnection[Any],
        by_vpn: dict[str, list[LedgerEntry]],
        decided: tuple[bytes, bytes] | None = None,
    ) -> None:
        """The batch where the stored ``ledger_index`` is not where this writer
        continues from: what is stored must be ours, the rest goes in (and
        the decisions it holds are recorded, unless a lost-reply attempt
        recorded them already)."""
        async with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
            fence = self.fence
            if fence is not None and not await holds_term(*fence.params()).run_async(conn):
                raise LedgerFenced(
                    f"the site's lease is no longer {fence.holder}'s at term {fence.term}: "
                    "another node took over"
                )
            stored = await lock_ledger_indexes(by_vpn).run_async(conn)
            todo: dict[str, list[LedgerEntry]] = {}
            for vpn, items in by_vpn.items():
                if vpn not in stored:
                    raise LedgerConflict("the VPN has no vpn_state row any more", vpn)
                todo[vpn] = await self._not_yet_stored(cur, vpn, items, stored[vpn])
            rows = [e for items in todo.values() for e in items]
            if rows:
                await cur.execute(_INSERT, _columns(rows))
                advanced = {vpn: items[-1].index for vpn, items in todo.items() if items}
                await advance_ledger_indexes(advanced).run_async(conn)
            if decided is not None:
                await cur.execute(_DECIDE, decided)

    async def _not_yet_stored(
        self, cur: psycopg.AsyncCursor[Any], vpn: str, items: list[LedgerEntry], stored: int
    ) -> list[LedgerEntry]:
        """The entries of ``items`` above the stored ``ledger_index``.

        Entries at or below it were committed by an attempt whose reply was
        lost; they must be exactly ours, else another writer is at work.
        """
        first, last = items[0].index, items[-1].index
        if stored == first - 1:
            return items
        if not first <= stored <= last:
            raise LedgerConflict(
                f"stored ledger_index is {stored}, this writer is at {first - 1}", vpn
            )
        await cur.execute(_STORED, (vpn, first, stored))
        found = await cur.fetchall()
        mine = [(e.index, e.epoch, e.encoded) for e in items[: stored - first + 1]]
        if [(int(i), int(ep), bytes(d)) for i, ep, d in found] != mine:
            raise LedgerConflict(f"ledger entries {first}..{stored} are not ours", vpn)
        log.warning("VPN %r: entries %d..%d had committed already (reply lost)", vpn, first, stored)
        return items[stored - first + 1 :]
