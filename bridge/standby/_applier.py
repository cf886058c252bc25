"""The standby applier: ledger entries in, exactly-once state out.

Invariant: every ledger entry of a VPN changes the standby's state exactly
once and in index order, across crashes, reconnects and replays.
:meth:`StandbyApplier.apply_batch` runs in one transaction that locks the
VPN's ``vpn_state`` row, drops the entries at or below its
``applied_index`` (a replay after a lost acknowledgement), applies the rest
with the shared :func:`~bridge.ledger.apply_entries` and stores the new
``applied_index`` with them: effects and progress commit together or not at
all. The rest must start at ``applied_index + 1`` and be dense, else
:class:`~bridge.Gap` (the bridge resyncs from the applied index); an entry
older than the newest epoch applied comes from a fenced active
(:class:`~bridge.StaleEpoch`). Transactions committed early:
:mod:`bridge.standby._early`; prepared rows: :mod:`bridge.standby._prepared`.
Blocking (psycopg's synchronous API): an asyncio caller uses ``to_thread``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool

from bridge._entry import LedgerEntry, decode_event
from bridge._errors import BridgeError, Gap, StaleEpoch, UnknownVpn
from bridge._events import Event
from bridge._ids import ReplicationId
from bridge._settings import Role
from bridge.ledger import GuardedApply, apply_entries, run_guarded
from bridge.store import applied_position, lock_applied, set_applied
from bridge.wire import CheckpointRow

from ._early import (
    EarlyCommits,
    ReadyEarlyCommit,
    ready_early_commit,
    settle_ahead,
    settle_applied,
    take_prepared,
)
from ._prepared import PreparedRows

__all__ = ["LiveRow", "NotStandby", "StandbyApplier", "StandbyError", "StandbyUnavailable"]

#: ``(queue, repl_id, publish_index, exchange, routing_key, properties, body)``
LiveRow = tuple[str, bytes, int, str, str, bytes, bytes]

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


class StandbyApplier:
    """Applies shipped ledger entries to this site's ``live_message``.

    Give it a DSN (it keeps one connection, reconnecting after a failure) or a
    :class:`psycopg_pool.ConnectionPool` it borrows from. Thread-safe.
    """

    def __init__(self, store: str | ConnectionPool[Any]) -> None:
        self._store = store
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()
        self._early = EarlyCommits()
        self._prepared = PreparedRows()

    def expect(self, vpn: str, txid: str, voted: Sequence[tuple[bytes, Event]]) -> None:
        """The participant votes yes on ``txid`` (its events, encoding and
        event): its row settles when the stream brings the group's last
        publish (:mod:`bridge.standby._prepared`)."""
        self._prepared.expect(vpn, txid, voted)

    def forget_prepared(self, txid: str) -> None:
        """``txid``'s group will not come through the stream unannounced:
        aborted, voted no, or committed early (its row settled already)."""
        self._prepared.forget(txid)

    def arrived_before_its_row(self, txid: str) -> int | None:
        """Where ``txid``'s group was applied when its row was not written
        yet (a late prepare: the active went on without the vote); the
        participant settles the row with it (None: not so)."""
        return self._prepared.arrived_before_its_row(txid)

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
            early = self._early.loaded(conn, vpn)
            rest, passed, settled = self._early.split(conn, vpn, fresh, early)
            apply_entries(conn, vpn, rest, keep_topology=True)
            if settled:
                settle_applied(conn, settled)
            arrived, rowless = self._prepared.settle_groups(conn, vpn, rest)
            set_applied(vpn, fresh[-1].index, epoch).run(conn)
        self._prepared.ended(arrived, rowless)
        self._early.passed(early, passed, settled)
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
        return self._early.skip_statement(vpn, entries)

    def skipped_early(self, vpn: str, entries: Sequence[LedgerEntry]) -> None:
        """Record that :meth:`skip_early_statement`'s statement settled
        ``entries``: they are not awaited any more."""
        self._early.skipped(vpn, entries)

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
        if it is left to the stream (:mod:`bridge.standby._early`).

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
            early = self._early.loaded(conn, vpn)
            encoded = take_prepared(conn, vpn, txid, first - 1)
            if not encoded:
                return None  # not prepared here (aborted, or settled already)
            entries = [
                LedgerEntry(vpn, epoch, first + i, decode_event(data, vpn), data)
                for i, data in enumerate(encoded)
            ]
            apply_entries(conn, vpn, entries)
        self._early.register(early, txid, first, encoded)
        self.forget_prepared(txid)  # settled with the stream's copy of the early group
        return first + len(encoded) - 1

    def ready_early_commit(
        self, vpn: str, txid: str, voted: Sequence[tuple[bytes, Event]]
    ) -> ReadyEarlyCommit:
        """``txid``'s events as the participant voted on them (encoding and
        event), made ready to commit early: the one statement's costly part
        is built now, before the index its group lands at is known — the
        bridge does it right after the vote, off the client's path."""
        return ready_early_commit(vpn, txid, voted)

    def early_commit_statement(
        self, vpn: str, ready: ReadyEarlyCommit, first: int, after: int
    ) -> GuardedApply | None:
        """:meth:`apply_prepared`'s one statement (gate, row move, apply) for
        the group at ``first``, to run on any connection to this database —
        the bridge runs it on its event loop — then :meth:`committed_early` if
        it applied. None when the transaction needs the checked path of
        :meth:`apply_prepared`: the VPN's early-committed events not loaded
        yet (after a start), or a group one statement cannot hold."""
        return self._early.statement(vpn, ready, first, after)

    def committed_early(self, vpn: str, ready: ReadyEarlyCommit, first: int) -> int:
        """Record that :meth:`early_commit_statement`'s statement applied the
        transaction (its group's copy in the stream is then recognised);
        returns the group's last index."""
        last = self._early.committed(vpn, ready, first)
        self.forget_prepared(ready.txid)  # settled with the stream's copy of the early group
        return last

    def forget_early(self, vpn: str) -> None:
        """An early commit's outcome is unknown (its connection failed): read
        the VPN's early-committed events from the database again before the
        next batch, so a group that did commit is not applied twice."""
        self._early.forget(vpn)

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
            settle_ahead(conn, vpn)
            held: set[bytes] = set()  # the checkpoint's replication ids
            with conn.cursor() as cur, cur.copy(_COPY_CHECKPOINT) as copy:
                copy.set_types(_CHECKPOINT_TYPES)
                for row in rows:
                    live = _live_row(row)
                    held.add(live[1])
                    copy.write_row((vpn, *live))
            covered = self._prepared.covered(conn, vpn, held, index)
            set_applied(vpn, index, epoch).run(conn)
        self._early.forget(vpn)
        self._prepared.ended(covered)

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
