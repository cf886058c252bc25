"""The standby's side of a local transaction: the participant.

On ``TxnPrepare`` it writes the transaction's events as a ``prepared``
``txn_log`` row in the standby's database and only then votes yes; a vote is
worth what its row is. The transaction's effects reach the standby's
``live_message`` through the ledger stream like every other event (the
active appends them as one group when it decides to commit); ``TxnOutcome``
settles the row. After a reconnect the standby asks about every row still
prepared (``TxnQuery``) and the active answers each once it knows
(presumed abort: an id the active has no row for was never committed).
"""

from __future__ import annotations

import logging

import psycopg

from bridge._entry import EventDecodeError

from ._failpoints import failpoint
from ._log import PARTICIPANT, TxnLog, decode_events

__all__ = ["Participant"]

log = logging.getLogger(__name__)


class Participant:
    def __init__(self, txn_log: TxnLog) -> None:
        self.log = txn_log

    async def prepare(self, vpn: str, txid: str, events: bytes) -> bool:
        """Persist ``txid`` as prepared; True is a yes vote."""
        try:
            decode_events(events, vpn)  # a vote for unreadable events would be worthless
            await self.log.prepare(txid, vpn, PARTICIPANT, events)
        except (EventDecodeError, ValueError) as e:
            log.error("VPN %s: transaction %s: events not readable, voting no: %s", vpn, txid, e)
            return False
        except psycopg.Error as e:
            log.warning("VPN %s: transaction %s not prepared, voting no: %s", vpn, txid, e)
            return False
        failpoint("participant.after-prepare")
        return True

    async def outcome(self, vpn: str, txid: str, commit: bool) -> None:
        moved = await self.log.move(
            txid, "committed" if commit else "aborted", leaving=("prepared",)
        )
        if moved:
            log.info("VPN %s: transaction %s %s", vpn, txid, "committed" if commit else "aborted")

    async def in_doubt(self, vpn: str) -> list[str]:
        """Prepared rows of ``vpn`` whose outcome this site does not know."""
        rows = await self.log.open_rows(PARTICIPANT)
        return [r.txid for r in rows if r.vpn == vpn and r.state == "prepared"]
