"""The standby's side of a local transaction: the participant.

On ``TxnPrepare`` it writes the transaction's events as a ``prepared``
``txn_log`` row in the standby's database and only then votes yes; a vote is
worth what its row is. It votes no for a VPN that is not a standby here
(promoted while the old active still asks): that site applies no stream
from it, and neither its promotion, which resolved the rows prepared before
it, nor anything later would give this site the transaction, so a yes would
let the old active commit and confirm it. The transaction's effects reach the standby's
``live_message`` through the ledger stream like every other event (the
active appends them as one group when it decides to commit), or, in sync
mode, early, from the prepared row (``TxnCommit``: a yes vote
returns the events decoded here, and the bridge builds the commit's
statement from them while the active commits the broker,
:meth:`bridge._standby.StandbyApplier.ready_early_commit`); ``TxnOutcome``
settles the row. After a reconnect the standby asks about every row still
prepared (``TxnQuery``) and the active answers each once it knows
(presumed abort: an id the active has no row for was never committed).

Commit outcomes are recorded in batches, every :data:`OUTCOME_FLUSH_SECONDS`
(one ``UPDATE`` for all of them, instead of a database commit per
transaction competing with the next transaction's prepare for the same
CPU): the row's state is bookkeeping, since the transaction's effects came
with the ledger stream and its outcome is the active's. A row whose
outcome a crash or a database error kept from being recorded stays
``prepared`` and is asked about again (``TxnQuery``) at the next connect;
until then ``status`` counts it in doubt. Aborts are recorded at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import psycopg

from bridge import EventDecodeError, Voted, decode_event, failpoint, split_events, xid_of_txid

from ._log import PARTICIPANT, TxnLog

__all__ = ["Participant"]

log = logging.getLogger(__name__)

#: how long commit outcomes gather before they are recorded together
OUTCOME_FLUSH_SECONDS = 0.05


class Participant:
    def __init__(self, txn_log: TxnLog) -> None:
        self.log = txn_log
        self._committed: dict[str, str] = {}  # txid -> vpn: known, not yet recorded
        self._flusher: asyncio.Task[None] | None = None
        self._failing = False  # the last flush did not reach the database

    async def prepare(
        self,
        vpn: str,
        txid: str,
        events: bytes,
        meanwhile: Callable[[Voted], object] | None = None,
        *,
        owner: str | None = None,
    ) -> Voted | None:
        """Persist ``txid`` as prepared. A yes vote returns the events it
        was for (encoding and event, for the standby to commit it early, ahead of
        the stream without reading them back); None is a no.

        The events are decoded while the database writes the row (the
        insert goes out first): a vote for unreadable events would be
        worthless, so they vote no and their row is aborted at once.
        ``owner``: an XA branch's broker user, kept in its row.
        ``meanwhile(voted)`` runs then too, before the vote is known: what
        the caller prepares for a yes is ready when the vote goes out, and
        nothing runs between the vote and the active's next step (on one
        machine, the active's node waits for the CPU this one holds)."""
        write = asyncio.ensure_future(
            self.log.prepare_as_standby(txid, vpn, events, xid=xid_of_txid(txid), xa_owner=owner)
        )
        try:
            await asyncio.sleep(0)  # the insert is sent
            try:
                voted = tuple((data, decode_event(data, vpn)) for data in split_events(events))
            except (EventDecodeError, ValueError) as e:
                log.error(
                    "VPN %s: transaction %s: events not readable, voting no: %s", vpn, txid, e
                )
                with contextlib.suppress(psycopg.Error):
                    if await write:  # a row no yes vote stands behind
                        await self.log.move(txid, "aborted", leaving=("prepared",))
                return None
            if meanwhile is not None:
                try:
                    meanwhile(voted)
                except Exception:  # its own affair: the vote does not depend on it
                    log.exception("VPN %s: transaction %s: not made ready to commit", vpn, txid)
            try:
                written = await write
            except psycopg.Error as e:
                log.warning("VPN %s: transaction %s not prepared, voting no: %s", vpn, txid, e)
                return None
            if written is None:
                log.warning(
                    "VPN %s: transaction %s not prepared, voting no: not a standby here", vpn, txid
                )
                return None
        finally:
            if not write.done():
                write.cancel()
        failpoint("participant.after-prepare")
        return voted

    async def outcome(self, vpn: str, txid: str, commit: bool) -> None:
        if commit:
            self._committed[txid] = vpn
            if self._flusher is None or self._flusher.done():
                self._flusher = asyncio.create_task(self._flush_loop(), name="txn-outcomes")
            return
        try:
            aborted = await self.log.move(txid, "aborted", leaving=("prepared",))
        except psycopg.Error as e:
            # the row stays prepared: the next resync asks the active about it
            log.warning(
                "VPN %s: transaction %s: its abort is not recorded yet (%s); "
                "it stays in doubt until the next resync",
                vpn,
                txid,
                e,
            )
            return
        if aborted:
            log.info("VPN %s: transaction %s aborted", vpn, txid)

    async def _flush_loop(self) -> None:
        while self._committed:
            await asyncio.sleep(1.0 if self._failing else OUTCOME_FLUSH_SECONDS)
            await self.flush()

    async def flush(self) -> None:
        """Record the commit outcomes gathered so far (kept for the next
        flush if the database does not take them)."""
        batch, self._committed = self._committed, {}
        if not batch:
            return
        try:
            moved = await self.log.move_many(list(batch), "committed", leaving=("prepared",))
        except psycopg.Error as e:
            if not self._failing:
                log.warning("%d transaction outcomes not recorded yet: %s", len(batch), e)
            self._failing = True
            self._committed = {**batch, **self._committed}
            return
        if self._failing:
            log.info("transaction outcomes recorded again")
        self._failing = False
        log.debug("%d of %d transactions marked committed", moved, len(batch))

    async def close(self) -> None:
        """Record what is gathered, then stop."""
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        await self.flush()

    async def in_doubt(self, vpn: str) -> list[str]:
        """Prepared rows of ``vpn`` whose outcome this site does not know."""
        rows = await self.log.prepared_rows(PARTICIPANT, vpn)
        return [r.txid for r in rows if r.txid not in self._committed]
