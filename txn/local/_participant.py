"""The standby's side of a local transaction: the participant.

On ``TxnPrepare`` it writes the transaction's events as a ``prepared``
``txn_log`` row and only then votes yes: a vote is worth what its row is. It
votes no for a VPN that is not a standby here (promoted while the old active
still asks): this site applies no stream from it, and its promotion
resolved only the rows prepared before, so a yes would let the old active
confirm what this site never gets. A yes returns the decoded events, from
which the standby builds an early commit's statement
(``bridge.standby``'s ``StandbyApplier.ready_early_commit``). A row
is settled committed with its group, by the applier, never by a commit
outcome, which writes nothing (docs/behaviour.md, "Local transactions",
step 4); an abort is recorded at once. After a reconnect every row still
prepared is asked about (``TxnQuery``; presumed abort), a commit answer
leaving the row to its group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable

import psycopg

from bridge import EventDecodeError, Voted, decode_event, failpoint, split_events, xid_of_txid

from ._log import PARTICIPANT, TxnLog

__all__ = ["Participant"]

log = logging.getLogger(__name__)


#: aborts heard before their prepare's row was written, remembered for it
ABORTED_EARLY_KEPT = 10_000


class Participant:
    def __init__(self, txn_log: TxnLog) -> None:
        self.log = txn_log
        #: txids whose abort found no row: the prepare and the outcome run
        #: as separate tasks, so the row may still be on its way; the
        #: prepare aborts it once written instead of voting yes
        self._aborted_early: OrderedDict[str, None] = OrderedDict()

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
            if txid in self._aborted_early:
                del self._aborted_early[txid]
                if written:  # its abort came first: a row no yes vote stands behind
                    await self.log.move(txid, "aborted", leaving=("prepared",))
                log.info("VPN %s: transaction %s was aborted before its prepare", vpn, txid)
                return None
        finally:
            if not write.done():
                write.cancel()
        failpoint("participant.after-prepare")
        return voted

    async def outcome(self, vpn: str, txid: str, commit: bool) -> None:
        """How ``txid`` ended at the active. A commit writes nothing: the
        row is settled with its group (see the module docstring)."""
        if commit:
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
        else:  # no row prepared (yet): a prepare still writing it aborts it
            self._aborted_early[txid] = None
            while len(self._aborted_early) > ABORTED_EARLY_KEPT:
                self._aborted_early.popitem(last=False)

    async def settle(self, vpn: str, txid: str, last: int) -> None:
        """``txid``'s group was applied here, at ``last``, before its row was
        written (a late prepare): the row is settled now."""
        try:
            if await self.log.move(txid, "committed", leaving=("prepared",), ledger_last=last):
                log.info("VPN %s: transaction %s: its group came before its prepare", vpn, txid)
        except psycopg.Error as e:
            log.warning("VPN %s: transaction %s: not settled (%s): it stays in doubt", vpn, txid, e)

    async def close(self) -> None:
        """Nothing is kept to record: outcomes are written as they come."""

    async def in_doubt(self, vpn: str) -> list[str]:
        """Prepared rows of ``vpn``: their groups are not here."""
        rows = await self.log.prepared_rows(PARTICIPANT, vpn)
        return [r.txid for r in rows]
