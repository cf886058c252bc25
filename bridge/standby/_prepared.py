"""The participant's prepared rows on the standby, settled with their groups.

Invariant: a participant's ``txn_log`` row is ``prepared`` exactly while its
transaction's group is not on the standby, so a promotion commits exactly
those. The row moves to ``committed`` in the transaction that applies the
group's settling event (its last publish), keeping that index in
``ledger_last``; a group applied before its row was written (a late
prepare) is remembered for the participant, which settles the row when it
writes it. The participant's outcome never settles a row. Why, and what a
checkpoint does: docs/behaviour.md, "Local transactions", step 4.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import psycopg

from bridge._entry import LedgerEntry, decode_event, split_events
from bridge._events import Event, Published

__all__ = ["ROWLESS_KEPT", "PreparedRows"]

#: groups applied before their rows were written, remembered for the rows
ROWLESS_KEPT = 10_000

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


def _settle(conn: psycopg.Connection[Any], txids: list[str], lasts: list[int]) -> list[str]:
    """Move the prepared rows of ``txids`` to committed at ``lasts``; the
    ids of the rows that moved (a row not written yet does not)."""
    moved = conn.execute(_SETTLE_WITH_GROUP, (txids, lasts)).fetchall()
    return [str(row[0]) for row in moved]


class PreparedRows:
    """The prepared rows' events, by VPN, and where groups without a row
    went. :meth:`expect` is called from the event loop while a batch may
    run in a worker thread, hence the lock."""

    def __init__(self) -> None:
        #: vpn -> encoded event -> (txid, does it settle the row? :func:`_settling`)
        self._events: dict[str, dict[bytes, tuple[str, bool]]] = {}
        #: txid -> (vpn, its events' encodings)
        self._rows: dict[str, tuple[str, tuple[bytes, ...]]] = {}
        self._loaded: set[str] = set()
        #: txid -> the index its group ended at, applied before its row was
        #: written (:meth:`arrived_before_its_row`)
        self._rowless: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def expect(self, vpn: str, txid: str, voted: Sequence[tuple[bytes, Event]]) -> None:
        """The participant votes yes on ``txid`` (its events, encoding and
        event): its row settles when the stream brings the group's last
        publish (:func:`_settling`)."""
        if not voted:
            return
        at = _settling([event for _, event in voted])
        with self._lock:
            self._rows[txid] = (vpn, tuple(data for data, _ in voted))
            events = self._events.setdefault(vpn, {})
            for i, (data, _) in enumerate(voted):
                events[data] = (txid, i == at)

    def forget(self, txid: str) -> None:
        """``txid``'s group will not come through the stream unannounced:
        aborted, voted no, or committed early (its row settled already)."""
        with self._lock:
            found = self._rows.pop(txid, None)
            if found is None:
                return
            events = self._events.get(found[0], {})
            for data in found[1]:
                if events.get(data, ("",))[0] == txid:
                    del events[data]

    def arrived_before_its_row(self, txid: str) -> int | None:
        """Where ``txid``'s group was applied when its row was not written
        yet (a late prepare: the active went on without the vote); the
        participant settles the row with it (None: not so)."""
        with self._lock:
            return self._rowless.pop(txid, None)

    def expected(self, conn: psycopg.Connection[Any], vpn: str) -> dict[bytes, tuple[str, bool]]:
        """The VPN's prepared rows' events (the rows read at first use)."""
        if vpn not in self._loaded:
            for txid, events in conn.execute(_PREPARED_ROWS, (vpn,)).fetchall():
                encoded = split_events(bytes(events))
                voted = [(data, decode_event(data, vpn)) for data in encoded]
                with self._lock:
                    known = str(txid) in self._rows
                if not known:
                    self.expect(vpn, str(txid), voted)
            self._loaded.add(vpn)
        with self._lock:
            return self._events.setdefault(vpn, {})

    def settle_groups(
        self, conn: psycopg.Connection[Any], vpn: str, entries: Sequence[LedgerEntry]
    ) -> tuple[list[str], dict[str, int]]:
        """Settle the prepared rows whose groups end among ``entries`` (in
        the caller's transaction); returns their ids, and the groups that
        ended with no row prepared (txid -> index: its row comes late)."""
        expected = self.expected(conn, vpn)
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

    def covered(
        self, conn: psycopg.Connection[Any], vpn: str, held: set[bytes], index: int
    ) -> list[str]:
        """Settle the prepared rows a checkpoint at ``index`` shows came:
        one of their published messages is in it (``held``: its
        replication ids)."""
        self.expected(conn, vpn)
        with self._lock:
            rows = [(t, enc) for t, (v, enc) in self._rows.items() if v == vpn]
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

    def ended(self, settled: Iterable[str], rowless: Mapping[str, int] | None = None) -> None:
        """After the commit: forget the settled rows; remember where the
        groups without a row went (a bounded few)."""
        for txid in settled:
            self.forget(txid)
        if rowless:
            with self._lock:
                self._rowless.update(rowless)
                while len(self._rowless) > ROWLESS_KEPT:
                    self._rowless.popitem(last=False)
            for txid in rowless:
                self.forget(txid)
