"""The standby's apply loop: ledger entries in, exactly-once state out.

Invariant: every ledger entry of a VPN changes the standby's state exactly
once and in index order, across crashes, reconnects and replays. Why:

* :meth:`StandbyApplier.apply_batch` runs in one database transaction that
  locks the VPN's ``vpn_state`` row, drops the entries at or below its
  ``applied_index`` (a replay after a lost acknowledgement), applies the rest
  with the shared :func:`~bridge._apply.apply_entries`, and stores the new
  ``applied_index`` in the same transaction. Effects and progress commit
  together or not at all, so a crash at any point leaves a state that the
  next replay continues without applying anything twice.
* The rest must start at ``applied_index + 1`` and be dense, else
  :class:`Gap` is raised before anything is written: the bridge then asks the
  active to resend from the last applied index instead of skipping events.
* An entry whose epoch is older than the newest epoch already applied comes
  from a fenced (superseded) active and is refused with :class:`StaleEpoch`.

:meth:`StandbyApplier.install_checkpoint` replaces the VPN's live messages
and its ``applied_index`` in one transaction, for a standby behind the
active's retained ledger.

The applier is blocking (psycopg's synchronous API, one statement stream per
VPN batch); an asyncio caller runs it with ``asyncio.to_thread``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool

from ._apply import apply_entries
from ._entry import LedgerEntry

__all__ = [
    "CheckpointRow",
    "Gap",
    "NotStandby",
    "StaleEpoch",
    "StandbyApplier",
    "StandbyError",
    "StandbyUnavailable",
]

#: ``(queue, repl_id, publish_index, exchange, routing_key, properties, body)``
CheckpointRow = tuple[str, bytes, int, str, str, bytes, bytes]

_LOCK_STATE = """
SELECT s.applied_index, s.applied_epoch, c.role
FROM vpn_state s JOIN vpn_config c ON c.name = s.vpn
WHERE s.vpn = %s
FOR UPDATE OF s
"""
_SET_APPLIED = """
UPDATE vpn_state
SET applied_index = %s, applied_epoch = %s, applied_at = now(), updated_at = now()
WHERE vpn = %s
"""
_COPY_CHECKPOINT = (
    "COPY live_message (vpn, queue, repl_id, publish_index, exchange, routing_key,"
    " properties, body) FROM STDIN (FORMAT BINARY)"
)
_CHECKPOINT_TYPES = ["text", "text", "bytea", "int8", "text", "text", "bytea", "bytea"]


class StandbyError(Exception):
    """Root of the standby applier's errors."""


class StandbyUnavailable(StandbyError):
    """The standby's database could not be reached or failed mid-transaction."""


class NotStandby(StandbyError):
    """The VPN is unknown on this site or not in the standby role."""


class Gap(StandbyError):
    """The entries do not continue the applied index: resync from ``expected``."""

    def __init__(self, vpn: str, expected: int, got: int) -> None:
        self.vpn, self.expected, self.got = vpn, expected, got
        super().__init__(f"VPN {vpn!r}: gap in the ledger: expected index {expected}, got {got}")


class StaleEpoch(StandbyError):
    """An entry from an active that has been superseded (fenced)."""

    def __init__(self, vpn: str, index: int, epoch: int, newest: int) -> None:
        self.vpn, self.index, self.epoch, self.newest = vpn, index, epoch, newest
        super().__init__(
            f"VPN {vpn!r}: entry {index} has epoch {epoch}, older than epoch {newest} "
            "already applied (the sender is fenced)"
        )


class StandbyApplier:
    """Applies shipped ledger entries to this site's ``live_message``.

    Give it a DSN (it keeps one connection, reconnecting after a failure) or a
    :class:`psycopg_pool.ConnectionPool` it borrows from. Thread-safe.
    """

    def __init__(self, store: str | ConnectionPool[Any]) -> None:
        self._store = store
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()

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
    def _transaction(self) -> Iterator[psycopg.Connection[Any]]:
        """A transaction on the standby database; foreign errors translated here."""
        try:
            if isinstance(self._store, ConnectionPool):
                with self._store.connection() as conn, conn.transaction():
                    yield conn
                return
            with self._lock:
                if self._conn is None or self._conn.closed or self._conn.broken:
                    self._conn = psycopg.connect(
                        self._store, autocommit=True, connect_timeout=10, row_factory=tuple_row
                    )
                try:
                    with self._conn.transaction():
                        yield self._conn
                except psycopg.OperationalError:
                    self._conn.close()
                    self._conn = None
                    raise
        except psycopg.OperationalError as e:
            raise StandbyUnavailable(f"standby database: {e}".strip()) from e

    def _lock_state(self, conn: psycopg.Connection[Any], vpn: str) -> tuple[int, int]:
        with conn.cursor(row_factory=tuple_row) as cur:
            row = cur.execute(_LOCK_STATE, (vpn,)).fetchone()
        if row is None:
            raise NotStandby(f"VPN {vpn!r} is not enabled on this site")
        if row[2] != "standby":
            raise NotStandby(f"VPN {vpn!r} is {row[2]} on this site, not standby")
        return int(row[0]), int(row[1])

    def apply_batch(self, vpn: str, entries: Sequence[LedgerEntry]) -> int:
        """Apply the entries above the applied index; return the new applied index.

        ``entries`` are in index order. Raises :class:`Gap` when the first new
        entry is not ``applied_index + 1`` or the batch skips an index, and
        :class:`StaleEpoch` for an entry older than the newest applied epoch.
        """
        with self._transaction() as conn:
            applied, applied_epoch = self._lock_state(conn, vpn)
            fresh = [e for e in entries if e.index > applied]
            if not fresh:
                return applied
            expected, epoch = applied + 1, applied_epoch
            for entry in fresh:
                if entry.index != expected:
                    raise Gap(vpn, expected, entry.index)
                if entry.epoch < epoch:
                    raise StaleEpoch(vpn, entry.index, entry.epoch, epoch)
                expected, epoch = expected + 1, entry.epoch
            apply_entries(conn, vpn, fresh)
            conn.execute(_SET_APPLIED, (fresh[-1].index, epoch, vpn))
            return fresh[-1].index

    def install_checkpoint(
        self, vpn: str, epoch: int, index: int, rows: Iterable[CheckpointRow]
    ) -> None:
        """Make ``rows`` the VPN's whole live state as of ledger ``index``."""
        if index < 0 or epoch < 1:
            raise ValueError(f"checkpoint at index {index}, epoch {epoch}")
        with self._transaction() as conn:
            self._lock_state(conn, vpn)
            conn.execute("DELETE FROM live_message WHERE vpn = %s", (vpn,))
            with conn.cursor() as cur, cur.copy(_COPY_CHECKPOINT) as copy:
                copy.set_types(_CHECKPOINT_TYPES)
                for row in rows:
                    copy.write_row((vpn, *row))
            conn.execute(_SET_APPLIED, (index, epoch, vpn))

    def applied_index(self, vpn: str) -> int:
        with self._transaction() as conn, conn.cursor(row_factory=tuple_row) as cur:
            row = cur.execute(
                "SELECT applied_index FROM vpn_state WHERE vpn = %s", (vpn,)
            ).fetchone()
        if row is None:
            raise NotStandby(f"VPN {vpn!r} is not enabled on this site")
        return int(row[0])
