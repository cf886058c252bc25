"""Transactions decided from their ``txn_log`` rows rather than in flight.

**Recovery** (either node, at start, before clients are accepted): every
coordinator row still ``prepared`` is resolved — its group in the ledger
after ``ledger_floor`` means the decision was made (mark committed); else
its marker in the broker means the broker committed (record the decision
now); else the broker did not commit (abort on both sites). A standby
resolves its own prepared rows by asking the active when the bridge
connects (``TxnQuery``, answered by :func:`outcomes_for`): aborted or
unknown → aborted (presumed abort: the broker commit waits for the
coordinator's row to be durable, so no row means no commit); committed or
ended → the row waits for its group, which the resync brings and which
settles it. A prepared XA branch whose channel closed is committed from
its row too (:func:`decide_logged`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Sequence

from bridge import TransactionRefused, future_callback
from bridge.ledger import LedgerError

from ._collaborators import GroupLedger, ParticipantLink, SyncWait
from ._inflight import tracer
from ._log import COORDINATOR, TxnLog, TxnRow
from ._markers import CLOCK_SLACK_SECONDS, MARKER_RETENTION_SECONDS, MarkerError, MarkerStore

__all__ = ["decide_logged", "outcomes_for", "recover"]

log = logging.getLogger(__name__)


async def recover(
    txn_log: TxnLog,
    markers: MarkerStore,
    ledger: GroupLedger,
    link: ParticipantLink | None,
    vpns: Collection[str] = (),
) -> dict[str, str]:
    """Resolve every coordinator row left prepared by a crash; returns
    ``{txid: outcome}`` (``committed``/``aborted``) for the log. Then the
    legacy marker queue of each VPN (of ``vpns`` and of the rows) keeps
    only the markers a row still prepared needs (``retire_legacy``)."""
    outcomes: dict[str, str] = {}
    rows = await txn_log.prepared_rows(COORDINATOR)
    present: dict[str, set[str]] = {}
    for row in rows:
        if row.vpn not in present:  # rows come oldest first
            wanted = {r.txid for r in rows if r.vpn == row.vpn}
            present[row.vpn] = await markers.present(row.vpn, row.created_at, wanted)
        outcomes[row.txid] = await _recover_one(txn_log, ledger, link, row, present[row.vpn])
    if outcomes:
        log.info(
            "recovered %d in-doubt transaction(s): %s",
            len(outcomes),
            ", ".join(f"{t} {o}" for t, o in outcomes.items()),
        )
    prepared = {t for t, outcome in outcomes.items() if outcome == "prepared"}
    for vpn in sorted({*vpns, *present}):
        try:
            await markers.retire_legacy(vpn, keep=prepared)
        except MarkerError as e:  # its lookups read the legacy queue meanwhile
            log.warning("VPN %s: the legacy marker queue stays for now: %s", vpn, e)
    return outcomes


async def _recover_one(
    txn_log: TxnLog,
    ledger: GroupLedger,
    link: ParticipantLink | None,
    row: TxnRow,
    markers: set[str],
) -> str:
    with tracer.start_as_current_span("txn.recover", attributes={"txid": row.txid}):
        events = row.recorded_events()
        first = await txn_log.decision_index(row)
        if first is not None:  # a group ledgered before decisions moved rows with it
            last = first + len(events) - 1
            await txn_log.move(row.txid, "committed", leaving=("prepared",), ledger_last=last)
            return "committed"
        if row.txid in markers:
            loop = asyncio.get_running_loop()
            durable: asyncio.Future[bool] = loop.create_future()
            ledger.append_group(events, future_callback(durable), decision=row.txid)
            if not await durable:
                return "prepared"  # the ledger is down: stays in doubt, retried next start
            return "committed"
        if row.xid is not None:  # an XA branch: its transaction manager decides
            return "prepared"
        if row.age > MARKER_RETENTION_SECONDS - CLOCK_SLACK_SECONDS:
            log.error(
                "VPN %s: transaction %s stays in doubt: it began before the commit-marker "
                "stream's retention, so a missing marker proves nothing (README, "
                '"Transactions left in doubt")',
                row.vpn,
                row.txid,
            )
            return "prepared"
        await txn_log.move(row.txid, "aborted", leaving=("prepared",))
        if link is not None:
            link.outcome(row.vpn, row.txid, commit=False)
        return "aborted"


async def outcomes_for(txn_log: TxnLog, txids: Sequence[str]) -> dict[str, bool | None]:
    """For a standby's query: True committed, False aborted (or unknown:
    presumed abort), None still in flight here."""
    states = await txn_log.states(txids)
    out: dict[str, bool | None] = {}
    for txid in txids:
        state = states.get(txid)
        if state in ("committed", "ended"):
            out[txid] = True
        elif state == "prepared":
            out[txid] = None
        else:
            out[txid] = False
    return out


async def decide_logged(
    txn_log: TxnLog,
    ledger: GroupLedger,
    sync: SyncWait,
    link: ParticipantLink | None,
    marker_done: Callable[[str, str], None],
    row: TxnRow,
) -> bool:
    """Record the commit of a prepared XA branch whose work reached the
    broker from its row (its channel had closed): its events as one
    ledger group, then the standby's acknowledgement (up to the VPN's
    sync timeout; True if it came) and its outcome. Raises
    :class:`TransactionRefused` when the decision could not be recorded
    (the branch stays prepared; its marker settles it at the next start).
    Committed without the standby's acknowledgement, its group is
    recorded as a sync-ineligible window before this returns."""
    events = row.recorded_events()
    acked = True
    if not events:
        await txn_log.move(row.txid, "committed", leaving=("prepared",))
    else:
        loop = asyncio.get_running_loop()
        durable: asyncio.Future[bool] = loop.create_future()
        answered: asyncio.Future[bool] = loop.create_future()
        last = 0

        def on_durable(ok: bool) -> None:
            # the sync gate's wait is made here, in the ledger's callback
            # (in index order), not after an await
            if not durable.done():
                durable.set_result(ok)
            first = last - len(events) + 1
            if ok and not sync.wait_standby(row.vpn, last, future_callback(answered), first):
                future_callback(answered)(True)

        try:
            last = ledger.append_group(events, on_durable, decision=row.txid)
        except LedgerError as e:
            raise TransactionRefused(f"the commit decision could not be recorded: {e}") from e
        if not await durable:
            raise TransactionRefused("the commit decision could not be made durable")
        acked = await answered
        recorded: asyncio.Future[None] = loop.create_future()
        if not acked and sync.confirmed_without_standby(
            row.vpn, last - len(events) + 1, last, lambda: _settle(recorded)
        ):
            await recorded
    marker_done(row.vpn, row.txid)
    if link is not None:
        link.outcome(row.vpn, row.txid, commit=True)
    return acked


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
