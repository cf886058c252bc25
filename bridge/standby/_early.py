"""Transactions committed early on the standby, ahead of the stream, and the
stream's copy of their groups skipped.

Invariant: a group committed early is applied once. Its early commit runs
only when the standby's state is exactly what precedes the group in the
active's ledger, moves the participant's row ``prepared`` → ``applied``
and leaves ``applied_index`` alone (the indexes are the active's promise
only once its ledger commit is durable). The stream's copy is recognised
by its events' encodings (unique: a fresh replication id, or the one
consumption of a message), skipped, and settles the row; so an active that
crashed before its ledger commit and re-appends the group at another index
still has it applied once. Why the early commit: docs/behaviour.md,
"Local transactions", step 4.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from bridge._entry import LedgerEntry, split_events
from bridge._events import Event, Published
from bridge.ledger import GuardedApply, GuardedTemplate, guarded_template

__all__ = [
    "EarlyCommits",
    "EarlyEvent",
    "ReadyEarlyCommit",
    "ready_early_commit",
    "settle_ahead",
    "settle_applied",
    "take_prepared",
]

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
# skip_statement: the stream's copy of groups committed early, at the indexes
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
_SETTLE_AHEAD = """
UPDATE txn_log SET state = 'committed', updated_at = now()
WHERE vpn = %s AND side = 'participant' AND state = 'applied'
"""
_REINDEX = """
UPDATE live_message SET publish_index = %s
WHERE vpn = %s AND queue = ANY(%s) AND repl_id = %s AND publish_index = %s
"""


@dataclass(frozen=True, slots=True)
class EarlyEvent:
    """One event of a transaction committed early."""

    txid: str
    index: int  # the index its row was applied at (the active's first assignment)
    last: bool  # the group's last event: the row is settled when it passes


@dataclass(frozen=True, slots=True)
class ReadyEarlyCommit:
    """A voted transaction made ready to commit early, ahead of the stream
    (:meth:`StandbyApplier.ready_early_commit`)."""

    txid: str
    encoded: tuple[bytes, ...]  # its events' encodings, in order
    template: GuardedTemplate | None  # None: one statement cannot hold it


def ready_early_commit(
    vpn: str, txid: str, voted: Sequence[tuple[bytes, Event]]
) -> ReadyEarlyCommit:
    """``txid``'s events as the participant voted on them, with the costly
    part of the early commit's one statement built before the index its
    group lands at is known."""
    entries = [
        # relative indexes (the statement adds the base); the apply stores no epoch
        LedgerEntry(vpn, 1, 1 + i, event, data)
        for i, (data, event) in enumerate(voted)
    ]
    template = guarded_template(vpn, entries, _TAKE_GUARD) if entries else None
    return ReadyEarlyCommit(txid, tuple(data for data, _ in voted), template)


def take_prepared(
    conn: psycopg.Connection[Any], vpn: str, txid: str, floor: int
) -> list[bytes] | None:
    """Move ``txid``'s prepared row to ``applied`` (its group after
    ``floor``); its events' encodings, or None when it is not prepared here
    (aborted, or settled already)."""
    row = conn.execute(_TAKE_PREPARED, (floor, txid, vpn)).fetchone()
    return None if row is None else split_events(bytes(row[0]))


def settle_applied(conn: psycopg.Connection[Any], txids: list[str]) -> None:
    """The stream brought the groups of ``txids``, committed early: their
    rows move ``applied`` → ``committed``."""
    conn.execute(_APPLIED_DONE, (txids,))


def settle_ahead(conn: psycopg.Connection[Any], vpn: str) -> None:
    """A checkpoint, and the replay after it, supersede what the VPN
    committed early: those rows are settled, their groups come as usual."""
    conn.execute(_SETTLE_AHEAD, (vpn,))


def _register(early: dict[bytes, EarlyEvent], txid: str, first: int, encoded: list[bytes]) -> None:
    """Record ``txid``'s events (its group applied at ``first`` onwards)."""
    last = first + len(encoded) - 1
    for i, data in enumerate(encoded):
        early[data] = EarlyEvent(txid, first + i, first + i == last)


class EarlyCommits:
    """The events committed early, by VPN (read from the ``applied`` rows
    at a VPN's first use), until the stream's copy passes."""

    def __init__(self) -> None:
        #: vpn -> encoded event -> where it was committed early
        self._by_vpn: dict[str, dict[bytes, EarlyEvent]] = {}

    def forget(self, vpn: str) -> None:
        """Read the VPN's early commits from the database again at next use
        (an outcome unknown, or a checkpoint superseded them)."""
        self._by_vpn.pop(vpn, None)

    def loaded(self, conn: psycopg.Connection[Any], vpn: str) -> dict[bytes, EarlyEvent]:
        """The VPN's events committed early (read at first use)."""
        early = self._by_vpn.get(vpn)
        if early is None:
            early = {}
            for txid, floor, events in conn.execute(_APPLIED_ROWS, (vpn,)).fetchall():
                _register(early, str(txid), int(floor) + 1, split_events(bytes(events)))
            self._by_vpn[vpn] = early
        return early

    def register(
        self, early: dict[bytes, EarlyEvent], txid: str, first: int, encoded: list[bytes]
    ) -> None:
        """``txid`` committed early, its group at ``first`` onwards."""
        _register(early, txid, first, encoded)

    def statement(
        self, vpn: str, ready: ReadyEarlyCommit, first: int, after: int
    ) -> GuardedApply | None:
        """The early commit's one statement for the group at ``first`` (None:
        the VPN's early commits are not loaded yet, or one statement cannot
        hold the group)."""
        if ready.template is None or vpn not in self._by_vpn:
            return None
        params = (vpn, first - 1, after, first - 1, after, first - 1, ready.txid, vpn)
        return ready.template.bind(params, first - 1)

    def committed(self, vpn: str, ready: ReadyEarlyCommit, first: int) -> int:
        """:meth:`statement`'s statement applied: record the group; its last index."""
        _register(self._by_vpn[vpn], ready.txid, first, list(ready.encoded))
        return first + len(ready.encoded) - 1

    def skip_statement(
        self, vpn: str, entries: Sequence[LedgerEntry]
    ) -> tuple[str, tuple[Any, ...]] | None:
        """The one statement (SQL, parameters) that settles ``entries`` when
        they are the stream's copy of groups committed early at these same
        indexes; None when they are anything else."""
        early = self._by_vpn.get(vpn)
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

    def skipped(self, vpn: str, entries: Sequence[LedgerEntry]) -> None:
        """:meth:`skip_statement`'s statement settled ``entries``."""
        early = self._by_vpn.get(vpn, {})
        for entry in entries:
            early.pop(entry.encoded, None)

    @staticmethod
    def split(
        conn: psycopg.Connection[Any],
        vpn: str,
        fresh: Sequence[LedgerEntry],
        early: dict[bytes, EarlyEvent],
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

    @staticmethod
    def passed(early: dict[bytes, EarlyEvent], passed: list[bytes], settled: list[str]) -> None:
        """After the commit of a batch :meth:`split`: the copies that
        passed, and the settled transactions' events, are not awaited any more."""
        for key in passed:
            early.pop(key, None)
        if settled:
            done = set(settled)
            for key in [k for k, a in early.items() if a.txid in done]:
                del early[key]
