"""The standby's apply loop: ledger entries in, exactly-once state out.

Invariant: every ledger entry of a VPN changes the standby's state exactly
once and in index order, across crashes, reconnects and replays. Why:

* :meth:`StandbyApplier.apply_batch` runs in one database transaction that
  locks the VPN's ``vpn_state`` row, drops the entries at or below its
  ``applied_index`` (a replay after a lost acknowledgement), applies the rest
  with the shared :func:`~bridge.ledger._apply.apply_entries`, and stores the new
  ``applied_index`` in the same transaction. Effects and progress commit
  together or not at all, so a crash at any point leaves a state that the
  next replay continues without applying anything twice.
* The rest must start at ``applied_index + 1`` and be dense, else
  :class:`~bridge._errors.Gap` is raised before anything is written: the
  bridge then asks the active to resend from the last applied index instead
  of skipping events.
* An entry whose epoch is older than the newest epoch already applied comes
  from a fenced (superseded) active and is refused with :class:`StaleEpoch`.
  Both are the bridge's own errors, so the standby's bridge can answer the active
  with the matching ``Error`` frame.

:meth:`StandbyApplier.install_checkpoint` replaces the VPN's live messages
and its ``applied_index`` in one transaction, for a standby behind the
active's retained ledger.

**Transactions committed early.** A sync-mode transaction's
group reaches the standby twice: first as ``TxnCommit`` (the broker
committed; the active's ledger write of the group is under way), then as
ledger entries. :meth:`StandbyApplier.apply_prepared` applies the first,
from the participant's prepared row, so the client's ``tx.commit-ok`` waits
for the two sites' commits at once instead of one after the other. It does
so only when the standby's state is exactly what the active's ledger holds
before the group (``applied_index`` is the index before it, or an earlier
group committed early in this same connection ends there); else it declines,
and the stream brings the group as usual. In the same database
transaction the row moves ``prepared`` → ``applied``; ``applied_index``
does *not* move, because the indexes are the active's promise only once
its ledger commit is durable. The group's entries, when the stream brings
them, are recognised by their encoding (a group's events are unique: a
fresh replication id, or the one consumption of a message), skipped, and
the row moves to ``committed`` with the entry that ends the group. So the
skip does not depend on the indexes the active assigned at first: an
active that crashed before its ledger commit re-appends the group at start
(its marker says the broker committed) at whatever index its ledger is at,
and the standby still applies it exactly once.

**Prepared rows settle with their groups.** A participant's row still
``prepared`` when the stream brings its group (the early commit declined,
or not asked) moves to ``committed`` in the transaction that applies the
group's last entry, keeping that entry's index (``ledger_last``). The
applier knows each row's events: :meth:`StandbyApplier.expect` records
them at the participant's yes vote, and a VPN's first batch reads the rows
prepared before. Nothing else settles a row committed (the participant's
outcome does not: ``txn/local/_participant.py``), so a ``prepared`` row is a
transaction whose group is not here, and a promotion commits exactly those.
A checkpoint settles the prepared rows whose published messages it holds;
one whose group it covers with every message consumed before it stays
prepared and is applied again by a promotion (at-least-once: its
messages come back rather than go missing).

The applier is blocking (psycopg's synchronous API, one statement stream per
VPN batch); an asyncio caller runs it with ``asyncio.to_thread``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool

from bridge._entry import LedgerEntry, decode_event, split_events
from bridge._errors import BridgeError, Gap, StaleEpoch, UnknownVpn
from bridge._events import Event, Published
from bridge._ids import ReplicationId
from bridge._settings import Role
from bridge.ledger import (
    GuardedApply,
    GuardedTemplate,
    apply_entries,
    guarded_template,
    run_guarded,
)
from bridge.store import applied_position, lock_applied, set_applied
from bridge.wire import CheckpointRow

__all__ = ["LiveRow", "NotStandby", "StandbyApplier", "StandbyError", "StandbyUnavailable"]

#: ``(queue, repl_id, publish_index, exchange, routing_key, properties, body)``
LiveRow = tuple[str, bytes, int, str, str, bytes, bytes]

_TAKE_PREPARED = """
UPDATE txn_log SET state = 'applied', ledger_floor = %s, updated_at = now()
WHERE txid = %s AND vpn = %s AND side = 'participant' AND state = 'prepared'
RETURNING events
"""
# apply_prepared's gate and row move as the leading part of one statement
# (bridge.ledger._apply.guarded_apply): the same checks as lock_applied and the
# gate after it, a VPN that is not (or no longer) standby here declines.
# Each gate locks the config row too, first (a promotion's order: the
# clauses lock in the order they are written): one that waited for a
# promotion re-reads the role it left, not its first snapshot's 'standby'
_TAKE_GUARD = """
WITH gate AS (
    SELECT s.vpn FROM vpn_state s JOIN vpn_config c ON c.name = s.vpn
    WHERE s.vpn = %s AND c.role = 'standby'
      AND (s.applied_index = %s OR (%s >= s.applied_index AND %s = %s))
    FOR SHARE OF c FOR UPDATE OF s)
, go AS (
    UPDATE txn_log SET state = 'applied', ledger_floor = %s, updated_at = now()
    WHERE txid = %s AND vpn = %s AND side = 'participant' AND state = 'prepared'
      AND EXISTS (SELECT FROM gate)
    RETURNING 1)
"""
# _skips_early: the stream's copy of groups committed early, at the indexes
# they were applied at, right after the applied index
_SKIP_EARLY_BATCH = """
WITH gate AS (
    SELECT s.vpn FROM vpn_state s JOIN vpn_config c ON c.name = s.vpn
    WHERE s.vpn = %s AND c.role = 'standby' AND s.applied_index = %s
      AND s.applied_epoch <= %s
    FOR SHARE OF c FOR UPDATE OF s)
, settled AS (
    UPDATE txn_log SET state = 'committed', updated_at = now()
    WHERE txid = ANY(%s) AND state = 'applied' AND EXISTS (SELECT FROM gate))
UPDATE vpn_state
SET applied_index = %s, applied_epoch = %s, applied_at = now(), updated_at = now()
WHERE vpn = %s AND EXISTS (SELECT FROM gate)
RETURNING 1
"""
_APPLIED_ROWS = """
SELECT txid, ledger_floor, events FROM txn_log
WHERE vpn = %s AND side = 'participant' AND state = 'applied'
"""
_APPLIED_DONE = """
UPDATE txn_log SET state = 'committed', updated_at = now()
WHERE txid = ANY(%s) AND state = 'applied'
"""
_PREPARED_ROWS = """
SELECT txid, events FROM txn_log
WHERE vpn = %s AND side = 'participant' AND state = 'prepared'
ORDER BY created_at, txid
"""
# the rows whose groups end in the batch being applied (or a checkpoint holds)
_SETTLE_WITH_GROUP = """
UPDATE txn_log t SET state = 'committed', ledger_last = s.last, updated_at = now()
FROM unnest(%s::text[], %s::bigint[]) AS s(txid, last)
WHERE t.txid = s.txid AND t.side = 'participant' AND t.state = 'prepared'
RETURNING t.txid
"""
_SETTLE_AHEAD = """
UPDATE txn_log SET state = 'committed', updated_at = now()
WHERE vpn = %s AND side = 'participant' AND state = 'applied'
"""
_REINDEX = """
UPDATE live_message SET publish_index = %s
WHERE vpn = %s AND queue = ANY(%s) AND repl_id = %s AND publish_index = %s
"""
_REPAIR_DELETE = """
DELETE FROM live_message m USING unnest(%s::text[], %s::bytea[]) AS k(queue, repl_id)
WHERE m.vpn = %s AND m.queue = k.queue AND m.repl_id = k.repl_id
"""

_COPY_CHECKPOINT = (
    "COPY live_message (vpn, queue, repl_id, publish_index, exchange, routing_key,"
    " properties, body) FROM STDIN (FORMAT BINARY)"
)
_CHECKPOINT_TYPES = ["text", "text", "bytea", "int8", "text", "text", "bytea", "bytea"]


class StandbyError(BridgeError):
    """Root of the standby applier's own errors (a gap or a stale epoch in what
    the active sent raises the bridge's :class:`Gap` / :class:`StaleEpoch`)."""


class StandbyUnavailable(StandbyError):
    """The standby's database could not be reached or failed mid-transaction."""


class NotStandby(StandbyError):
    """The VPN is enabled on this site, but not in the standby role."""

    closes_connection = False


@dataclass(frozen=True, slots=True)
class _Early:
    """One event of a transaction committed early."""

    txid: str
    index: int  # the index its row was applied at (the active's first assignment)
    last: bool  # the group's last event: the row is settled when it passes


#: groups applied before their rows were written, remembered for the rows
ROWLESS_KEPT = 10_000


def _settling(events: Sequence[Event]) -> int:
    """The position of the event whose arrival settles a prepared row: its
    last publish (a branch committed from its log after its channel closed
    records its publishes alone, ``txn.local._log.TxnRow.recorded_events``), or
    its last event when it publishes nothing. Acks after the last publish
    that a lost active never streamed bring their messages back, as any ack
    not in the ledger does."""
    for i in range(len(events) - 1, -1, -1):
        if isinstance(events[i], Published):
            return i
    return len(events) - 1


def _register(early: dict[bytes, _Early], txid: str, first: int, encoded: list[bytes]) -> None:
    """Record ``txid``'s events (its group applied at ``first`` onwards)."""
    last = first + len(encoded) - 1
    for i, data in enumerate(encoded):
        early[data] = _Early(txid, first + i, first + i == last)


@dataclass(frozen=True, slots=True)
class ReadyEarlyCommit:
    """A voted transaction made ready to commit early, ahead of the stream
    (:meth:`StandbyApplier.ready_early_commit`)."""

    txid: str
    encoded: tuple[bytes, ...]  # its events' encodings, in order
    template: GuardedTemplate | None  # None: one statement cannot hold it


class StandbyApplier:
    """Applies shipped ledger entries to this site's ``live_message``.

    Give it a DSN (it keeps one connection, reconnecting after a failure) or a
    :class:`psycopg_pool.ConnectionPool` it borrows from. Thread-safe.
    """

    def __init__(self, store: str | ConnectionPool[Any]) -> None:
        self._store = store
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()
        #: vpn -> encoded event -> where it was committed early
        #: (loaded from the ``applied`` rows at a VPN's first batch)
        self._early: dict[str, dict[bytes, _Early]] = {}
        #: the prepared rows' events: vpn -> encoded event -> (txid, does
        #: it settle the row? :func:`_settling`); :meth:`expect` adds from the event loop
        #: while a batch may run in a worker thread, hence the lock
        self._prepared: dict[str, dict[bytes, tuple[str, bool]]] = {}
        self._prepared_events: dict[str, tuple[str, tuple[bytes, ...]]] = {}
        self._prepared_loaded: set[str] = set()
        #: txid -> the index its group ended at, applied before its row was
        #: written (:meth:`arrived_before_its_row`)
        self._rowless: OrderedDict[str, int] = OrderedDict()
        self._prepared_lock = threading.Lock()

    def expect(self, vpn: str, txid: str, voted: Sequence[tuple[bytes, Event]]) -> None:
        """The participant votes yes on ``txid`` (its events, encoding and
        event): its row settles when the stream brings the group's last
        publish (:func:`_settling`)."""
        if not voted:
            return
        at = _settling([event for _, event in voted])
        with self._prepared_lock:
            self._prepared_events[txid] = (vpn, tuple(data for data, _ in voted))
            events = self._prepared.setdefault(vpn, {})
            for i, (data, _) in enumerate(voted):
                events[data] = (txid, i == at)

    def forget_prepared(self, txid: str) -> None:
        """``txid``'s group will not come through the stream unannounced:
        aborted, voted no, or committed early (its row settled already)."""
        with self._prepared_lock:
            found = self._prepared_events.pop(txid, None)
            if found is None:
                return
            events = self._prepared.get(found[0], {})
            for data in found[1]:
                if events.get(data, ("",))[0] == txid:
                    del events[data]

    def arrived_before_its_row(self, txid: str) -> int | None:
        """Where ``txid``'s group was applied when its row was not written
        yet (a late prepare: the active went on without the vote); the
        participant settles the row with it (None: not so)."""
        with self._prepared_lock:
            return self._rowless.pop(txid, None)

    def _expected(self, conn: psycopg.Connection[Any], vpn: str) -> dict[bytes, tuple[str, bool]]:
        """The VPN's prepared rows' events (the rows read at first use)."""
        if vpn not in self._prepared_loaded:
            for txid, events in conn.execute(_PREPARED_ROWS, (vpn,)).fetchall():
                encoded = split_events(bytes(events))
                voted = [(data, decode_event(data, vpn)) for data in encoded]
                with self._prepared_lock:
                    known = str(txid) in self._prepared_events
                if not known:
                    self.expect(vpn, str(txid), voted)
            self._prepared_loaded.add(vpn)
        with self._prepared_lock:
            return self._prepared.setdefault(vpn, {})

    def _settle_groups(
        self, conn: psycopg.Connection[Any], vpn: str, entries: Sequence[LedgerEntry]
    ) -> tuple[list[str], dict[str, int]]:
        """Settle the prepared rows whose groups end among ``entries`` (in
        the caller's transaction); returns their ids, and the groups that
        ended with no row prepared (txid -> index: its row comes late)."""
        expected = self._expected(conn, vpn)
        if not expected:
            return [], {}
        ended = {
            found[0]: entry.index
            for entry in entries
            if (found := expected.get(entry.encoded)) is not None and found[1]
        }
        if not ended:
            return [], {}
        settled = _settle(conn, list(ended), list(ended.values()))
        moved = set(settled)
        rowless = {t: i for t, i in ended.items() if t not in moved}
        return settled, rowless

    def _ended(self, settled: Iterable[str], rowless: Mapping[str, int] | None = None) -> None:
        """After the commit: forget the settled rows; remember where the
        groups without a row went (a bounded few)."""
        for txid in settled:
            self.forget_prepared(txid)
        if rowless:
            with self._prepared_lock:
                self._rowless.update(rowless)
                while len(self._rowless) > ROWLESS_KEPT:
                    self._rowless.popitem(last=False)
            for txid in rowless:
                self.forget_prepared(txid)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> StandbyApplier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _session(self) -> Iterator[psycopg.Connection[Any]]:
        """The standby database (autocommit, unless the pool's connections
        are not); foreign errors translated here."""
        try:
            if isinstance(self._store, ConnectionPool):
                with self._store.connection() as conn:
                    yield conn
                return
            with self._lock:
                if self._conn is None or self._conn.closed or self._conn.broken:
                    self._conn = psycopg.connect(
                        self._store, autocommit=True, connect_timeout=10, row_factory=tuple_row
                    )
                try:
                    yield self._conn
                except psycopg.OperationalError:
                    self._conn.close()
                    self._conn = None
                    raise
        except psycopg.OperationalError as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise StandbyUnavailable(f"standby database: {reason}") from e

    @contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection[Any]]:
        """A transaction on the standby database (:meth:`_session`)."""
        with self._session() as conn, conn.transaction():
            yield conn

    def _lock_state(self, conn: psycopg.Connection[Any], vpn: str) -> tuple[int, int]:
        found = lock_applied(vpn).run(conn)
        if found is None:
            raise UnknownVpn("not enabled on this site", vpn)
        if found.role is not Role.STANDBY:
            raise NotStandby(f"{found.role.value} on this site, not standby", vpn)
        return found.applied_index, found.applied_epoch

    def apply_batch(self, vpn: str, entries: Sequence[LedgerEntry]) -> int:
        """Apply the entries above the applied index; return the new applied index.

        ``entries`` are in index order. Raises :class:`Gap` when the first new
        entry is not ``applied_index + 1`` or the batch skips an index, and
        :class:`StaleEpoch` for an entry older than the newest applied epoch.
        """
        if self._skips_early(vpn, entries):
            return entries[-1].index
        with self._transaction() as conn:
            applied, applied_epoch = self._lock_state(conn, vpn)
            fresh = [e for e in entries if e.index > applied]
            if not fresh:
                return applied
            expected, epoch = applied + 1, applied_epoch
            for entry in fresh:
                if entry.index != expected:
                    raise Gap(
                        f"gap in the ledger: expected index {expected}, got {entry.index}",
                        vpn,
                        expected=expected,
                        got=entry.index,
                    )
                if entry.epoch < epoch:
                    raise StaleEpoch(
                        f"entry {entry.index} has epoch {entry.epoch}, older than epoch "
                        f"{epoch} already applied (the sender is fenced)",
                        vpn,
                        known=epoch,
                        got=entry.epoch,
                    )
                expected, epoch = expected + 1, entry.epoch
            early = self._committed_early_rows(conn, vpn)
            rest, passed, settled = _skip_early(conn, vpn, fresh, early)
            apply_entries(conn, vpn, rest, keep_topology=True)
            if settled:
                conn.execute(_APPLIED_DONE, (settled,))
            arrived, rowless = self._settle_groups(conn, vpn, rest)
            set_applied(vpn, fresh[-1].index, epoch).run(conn)
        self._ended(arrived, rowless)
        for key in passed:
            early.pop(key, None)
        if settled:
            done = set(settled)
            for key in [k for k, a in early.items() if a.txid in done]:
                del early[key]
        return fresh[-1].index

    def _skips_early(self, vpn: str, entries: Sequence[LedgerEntry]) -> bool:
        """The common batch of a sync-mode transaction's group, committed early
        already at these same indexes, right after the applied index: the
        applied index moves and the rows of the groups it ends settle, in
        one statement (:meth:`skip_early_statement`). False (nothing
        written) when it is anything else: :meth:`apply_batch` then checks
        and applies it as usual."""
        statement = self.skip_early_statement(vpn, entries)
        if statement is None:
            return False
        with self._session() as conn:
            if conn.execute(*statement).fetchone() is None:
                return False
        self.skipped_early(vpn, entries)
        return True

    def skip_early_statement(
        self, vpn: str, entries: Sequence[LedgerEntry]
    ) -> tuple[str, tuple[Any, ...]] | None:
        """The one statement (SQL, parameters) that settles ``entries`` when
        they are the stream's copy of groups committed early at these same
        indexes; None when they are anything else. It returns a row only if
        its gate held (the applied index right before them, this site still
        standby), and it may run on any connection to this database — the
        bridge runs it on its event loop; :meth:`skipped_early` then."""
        early = self._early.get(vpn)
        if not early or not entries:
            return None
        settled: list[str] = []
        epoch = entries[0].epoch
        for i, entry in enumerate(entries):
            found = early.get(entry.encoded)
            if found is None or found.index != entry.index:
                return None
            if entry.index != entries[0].index + i or entry.epoch < epoch:
                return None
            epoch = entry.epoch
            if found.last:
                settled.append(found.txid)
        first, last = entries[0], entries[-1]
        params = (vpn, first.index - 1, first.epoch, settled, last.index, last.epoch, vpn)
        return _SKIP_EARLY_BATCH, params

    def skipped_early(self, vpn: str, entries: Sequence[LedgerEntry]) -> None:
        """Record that :meth:`skip_early_statement`'s statement settled
        ``entries``: they are not awaited any more."""
        early = self._early.get(vpn, {})
        for entry in entries:
            early.pop(entry.encoded, None)

    def apply_prepared(
        self,
        vpn: str,
        txid: str,
        epoch: int,
        first: int,
        after: int,
        voted: Sequence[tuple[bytes, Event]] | None = None,
    ) -> int | None:
        """Commit the prepared transaction ``txid`` early, from its row, its
        group at ``first`` onwards; returns the group's last index, or None
        if it is left to the stream (see the module docstring).

        ``after`` is the last index of the group this connection committed
        early before (0: none); the group may follow it directly. ``voted``
        is the row's events (encoding, event) as the participant voted on
        them, when it still has them: the common group then goes in one
        statement that checks, takes the row and applies (:meth:`ready_early_commit`,
        :meth:`early_commit_statement` and :meth:`committed_early` on this applier's
        own connection — the steps the bridge runs on its event loop, with
        the statement built at the vote), instead of a transaction that
        reads the events back. Without ``voted`` (how the bridge calls it,
        when it has no statement ready) it takes that checked path.
        """
        if voted:
            ready = self.ready_early_commit(vpn, txid, voted)
            statement = self.early_commit_statement(vpn, ready, first, after)
            if statement is not None:
                with self._session() as conn:
                    if run_guarded(conn, statement) is None:
                        return None  # out of order, or not prepared here
                return self.committed_early(vpn, ready, first)
        with self._transaction() as conn:
            applied, _ = self._lock_state(conn, vpn)
            if first - 1 != applied and not (after >= applied and first - 1 == after):
                return None  # the stream has not brought what precedes it, or brought it
            early = self._committed_early_rows(conn, vpn)
            row = conn.execute(_TAKE_PREPARED, (first - 1, txid, vpn)).fetchone()
            if row is None:
                return None  # not prepared here (aborted, or settled already)
            encoded = split_events(bytes(row[0]))
            if not encoded:
                return None
            entries = [
                LedgerEntry(vpn, epoch, first + i, decode_event(data, vpn), data)
                for i, data in enumerate(encoded)
            ]
            apply_entries(conn, vpn, entries)
        _register(early, txid, first, encoded)
        self.forget_prepared(txid)  # settled with the stream's copy of the early group
        return first + len(encoded) - 1

    def ready_early_commit(
        self, vpn: str, txid: str, voted: Sequence[tuple[bytes, Event]]
    ) -> ReadyEarlyCommit:
        """``txid``'s events as the participant voted on them (encoding and
        event), made ready to commit early: the one statement's costly part
        is built now, before the index its group lands at is known — the
        bridge does it right after the vote, off the client's path."""
        entries = [
            # relative indexes (the statement adds the base); the apply stores no epoch
            LedgerEntry(vpn, 1, 1 + i, event, data)
            for i, (data, event) in enumerate(voted)
        ]
        template = guarded_template(vpn, entries, _TAKE_GUARD) if entries else None
        return ReadyEarlyCommit(txid, tuple(data for data, _ in voted), template)

    def early_commit_statement(
        self, vpn: str, ready: ReadyEarlyCommit, first: int, after: int
    ) -> GuardedApply | None:
        """:meth:`apply_prepared`'s one statement (gate, row move, apply) for
        the group at ``first``, to run on any connection to this database —
        the bridge runs it on its event loop — then :meth:`committed_early` if
        it applied. None when the transaction needs the checked path of
        :meth:`apply_prepared`: the VPN's early-committed events not loaded
        yet (after a start), or a group one statement cannot hold."""
        if ready.template is None or vpn not in self._early:
            return None
        params = (vpn, first - 1, after, first - 1, after, first - 1, ready.txid, vpn)
        return ready.template.bind(params, first - 1)

    def committed_early(self, vpn: str, ready: ReadyEarlyCommit, first: int) -> int:
        """Record that :meth:`early_commit_statement`'s statement applied the
        transaction (its group's copy in the stream is then recognised);
        returns the group's last index."""
        _register(self._early[vpn], ready.txid, first, list(ready.encoded))
        self.forget_prepared(ready.txid)  # settled with the stream's copy of the early group
        return first + len(ready.encoded) - 1

    def forget_early(self, vpn: str) -> None:
        """An early commit's outcome is unknown (its connection failed): read
        the VPN's early-committed events from the database again before the
        next batch, so a group that did commit is not applied twice."""
        self._early.pop(vpn, None)

    def _committed_early_rows(self, conn: psycopg.Connection[Any], vpn: str) -> dict[bytes, _Early]:
        """The VPN's events committed early (read at first use)."""
        early = self._early.get(vpn)
        if early is None:
            early = {}
            for txid, floor, events in conn.execute(_APPLIED_ROWS, (vpn,)).fetchall():
                _register(early, str(txid), int(floor) + 1, split_events(bytes(events)))
            self._early[vpn] = early
        return early

    def install_checkpoint(
        self, vpn: str, epoch: int, index: int, rows: Iterable[LiveRow | CheckpointRow]
    ) -> None:
        """Make ``rows`` the VPN's whole live state as of ledger ``index``.

        Rows are tuples in ``live_message`` column order or the bridge's
        :class:`~bridge.CheckpointRow` frames' rows.
        """
        if index < 0 or epoch < 1:
            raise ValueError(f"checkpoint at index {index}, epoch {epoch}")
        with self._transaction() as conn:
            self._lock_state(conn, vpn)
            conn.execute("DELETE FROM live_message WHERE vpn = %s", (vpn,))
            # the checkpoint, and the replay after it, supersede whatever was
            # committed early: those groups come as usual
            conn.execute(_SETTLE_AHEAD, (vpn,))
            held: set[bytes] = set()  # the checkpoint's replication ids
            with conn.cursor() as cur, cur.copy(_COPY_CHECKPOINT) as copy:
                copy.set_types(_CHECKPOINT_TYPES)
                for row in rows:
                    live = _live_row(row)
                    held.add(live[1])
                    copy.write_row((vpn, *live))
            covered = self._covered(conn, vpn, held, index)
            set_applied(vpn, index, epoch).run(conn)
        self._early.pop(vpn, None)
        self._ended(covered)

    def _covered(
        self, conn: psycopg.Connection[Any], vpn: str, held: set[bytes], index: int
    ) -> list[str]:
        """Settle the prepared rows a checkpoint at ``index`` shows came:
        one of their published messages is in it (see the module docstring)."""
        self._expected(conn, vpn)
        with self._prepared_lock:
            rows = [(t, enc) for t, (v, enc) in self._prepared_events.items() if v == vpn]
        covered = [
            txid
            for txid, encoded in rows
            if any(
                isinstance(event := decode_event(data, vpn), Published)
                and event.repl_id.value in held
                for data in encoded
            )
        ]
        return _settle(conn, covered, [index] * len(covered)) if covered else []

    def apply_repair(
        self,
        vpn: str,
        rows: Sequence[CheckpointRow],
        absent: Sequence[tuple[str, ReplicationId]],
    ) -> None:
        """A reconcile repair, in one transaction: ``rows`` become the
        VPN's rows of their keys (inserted or replaced), the ``absent`` keys
        lose theirs. The applied index does not move: a repair is not a
        ledger entry, and applying it twice changes nothing."""
        with self._transaction() as conn:
            self._lock_state(conn, vpn)
            if absent:
                conn.execute(
                    _REPAIR_DELETE,
                    ([q for q, _ in absent], [rid.value for _, rid in absent], vpn),
                )
            if rows:
                conn.execute(
                    _REPAIR_DELETE,
                    ([r.queue for r in rows], [r.repl_id.value for r in rows], vpn),
                )
                with conn.cursor() as cur, cur.copy(_COPY_CHECKPOINT) as copy:
                    copy.set_types(_CHECKPOINT_TYPES)
                    for row in rows:
                        copy.write_row((vpn, *_live_row(row)))

    def applied_index(self, vpn: str) -> int:
        with self._transaction() as conn:
            found = applied_position(vpn).run(conn)
        if found is None:
            raise UnknownVpn("not enabled on this site", vpn)
        return found[0]


def _skip_early(
    conn: psycopg.Connection[Any],
    vpn: str,
    fresh: Sequence[LedgerEntry],
    early: dict[bytes, _Early],
) -> tuple[Sequence[LedgerEntry], list[bytes], list[str]]:
    """Split ``fresh`` into the entries to apply and those committed early
    already; returns them, the latter's encodings, and the
    transactions whose group ends in this batch."""
    if not early:
        return fresh, [], []
    rest: list[LedgerEntry] = []
    passed: list[bytes] = []
    settled: list[str] = []
    for entry in fresh:
        found = early.get(entry.encoded)
        if found is None:
            rest.append(entry)
            continue
        passed.append(entry.encoded)
        if found.last:
            settled.append(found.txid)
        event = entry.event
        if found.index != entry.index and isinstance(event, Published):
            # re-appended elsewhere after the active restarted: the row takes
            # the index the active's own row has
            queues = list(event.queues)
            params = (entry.index, vpn, queues, event.repl_id.value, found.index)
            conn.execute(_REINDEX, params)
    return rest, passed, settled


def _settle(conn: psycopg.Connection[Any], txids: list[str], lasts: list[int]) -> list[str]:
    """Move the prepared rows of ``txids`` to committed at ``lasts``; the
    ids of the rows that moved (a row not written yet does not)."""
    moved = conn.execute(_SETTLE_WITH_GROUP, (txids, lasts)).fetchall()
    return [str(row[0]) for row in moved]


def _live_row(row: LiveRow | CheckpointRow) -> LiveRow:
    if isinstance(row, CheckpointRow):
        return (
            row.queue,
            row.repl_id.value,
            row.publish_index,
            row.exchange,
            row.routing_key,
            row.properties,
            row.body,
        )
    return row
