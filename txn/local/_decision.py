"""The steps after the broker commit: the step table's actions performed
as the ledger, the standby and the sync gate answer, ending in the
client's answer (:class:`DecisionSteps`, a part of
:class:`~txn.local._coordinator.Coordinator`).

They run in callbacks, not in the client's task, so the listener writes
``tx.commit-ok`` the moment the transaction settles. A degraded
transaction's answer waits until its group is recorded as a
sync-ineligible window; a decision the site's database has not made
durable in :data:`DECISION_BOUND_SECONDS` releases the client, told the
outcome is unknown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from bridge import TransactionRefused, failpoint
from bridge.ledger import LedgerError

from ._collaborators import GroupLedger, ParticipantLink, SyncWait
from ._inflight import InFlight, TxnStats
from ._log import TxnLog
from ._machine import (
    Action,
    Answer,
    AwaitStandbyAck,
    CommitEarly,
    Input,
    MarkDegraded,
    OpenStandbyPhase,
    RecordDecision,
    RetireMarker,
    SendOutcome,
    StandbySettled,
    TxnProtocolError,
    WithdrawStandbyWait,
)
from ._sweep import MarkerSweep

__all__ = ["DecisionSteps"]

log = logging.getLogger(__name__)

#: how long a client waits for its commit decision to be durable in the
#: site's own database after the broker committed; then its connection is
#: closed, the outcome unknown to it (the decision still commits once the
#: database answers)
DECISION_BOUND_SECONDS = 10.0


class DecisionSteps:
    """Performs a transaction's actions after the broker commit. The
    coordinator holds the state declared here."""

    log: TxnLog
    ledger: GroupLedger
    sync: SyncWait
    link: ParticipantLink | None
    stats: TxnStats
    sweep: MarkerSweep
    _live: dict[str, InFlight]
    #: replication id of a message a committing transaction published -> txid
    _committing_ids: dict[bytes, str]
    _tasks: set[asyncio.Task[None]]
    _performers: dict[type[Action], Callable[[InFlight, Any], None]]

    def _performer_table(self) -> dict[type[Action], Callable[[InFlight, Any], None]]:
        """How each action after the broker commit is performed."""
        return {
            RecordDecision: self._record_decision,
            CommitEarly: self._commit_early,
            OpenStandbyPhase: self._open_standby_phase,
            AwaitStandbyAck: self._await_standby_ack,
            WithdrawStandbyWait: self._withdraw_standby_wait,
            StandbySettled: self._standby_settled,
            MarkDegraded: self._mark_degraded,
            RetireMarker: self._retire_marker,
            Answer: self._answer,
            SendOutcome: self._send_outcome,
        }

    def _release(self, live: InFlight, ok: bool) -> None:
        """The commit is recorded (``ok``) or cannot be: tell whoever waits."""
        if not live.done.done():
            live.done.set_result(ok)
        done, live.on_done = live.on_done, None
        if done is None:
            if live.answered_late:  # the client was told already: only the books
                self._live.pop(live.txn.txid, None)
                if ok:
                    live.finish("degraded" if live.machine.degraded else "committed")
                else:
                    live.finish("unrecorded", "the commit decision could not be recorded")
            return  # else no commit-ok came for it yet (resolve() awaits live.done)
        self._live.pop(live.txn.txid, None)
        if not ok:
            live.finish("unrecorded", "the commit decision could not be recorded")
            error: TransactionRefused | None = TransactionRefused(
                "the commit decision could not be recorded"
            )
        else:
            live.finish("degraded" if live.machine.degraded else "committed")
            failpoint("coordinator.after-decision")
            error = None
        try:
            done(error)
        except Exception:
            log.exception("transaction %s: answering the client failed", live.txn.txid)

    def _decide(self, live: InFlight) -> None:
        """The broker committed: the machine records the decision (once)."""
        self._feed(live, Input.BROKER_COMMITTED)

    def _feed(self, live: InFlight, what: Input) -> None:
        """Feed ``what`` to ``live``'s machine and perform what it answers."""
        try:
            actions = live.machine.feed(what)
        except TxnProtocolError:
            log.exception("transaction %s: a step out of order", live.txn.txid)
            self._release(live, False)
            return
        self._perform(live, actions)

    def _perform(self, live: InFlight, actions: list[Action]) -> None:
        """The actions after the broker commit, in order (the prepare's are
        performed by :meth:`_prepare`). A degraded transaction's answer,
        and what follows it, wait until its group is recorded as a
        sync-ineligible window (:meth:`_window_first`)."""
        for i, action in enumerate(actions):
            if isinstance(action, Answer) and self._window_first(live, action, actions[i:]):
                return
            perform = self._performers.get(type(action))
            if perform is None:
                raise TxnProtocolError(f"transaction {live.txn.txid}: {action} after the prepare")
            perform(live, action)

    def _window_first(self, live: InFlight, answer: Answer, rest: list[Action]) -> bool:
        """A degraded transaction was committed without the standby: its
        ledger group is recorded as a sync-ineligible window before the
        client is told (``rest``, from ``answer`` on, is performed once that
        is durable). True when ``rest`` now waits for the record."""
        m = live.machine
        if not (answer.ok and m.degraded and m.last_index) or live.window_asked:
            return False
        live.window_asked = True
        return self.sync.confirmed_without_standby(
            live.txn.vpn, m.first_index, m.last_index, lambda: self._perform(live, rest)
        )

    def _commit_early(self, live: InFlight, action: CommitEarly) -> None:
        if self.link is not None:
            # the standby commits from its prepared row while the ledger write runs
            txn = live.txn
            self.link.commit_early(
                txn.vpn, txn.txid, action.first, lambda: self._committed_early(live)
            )

    def _open_standby_phase(self, live: InFlight, action: OpenStandbyPhase) -> None:
        live.enter("txn.standby_commit")

    def _await_standby_ack(self, live: InFlight, action: AwaitStandbyAck) -> None:
        if not self.sync.wait_standby(
            live.txn.vpn,
            action.last,
            lambda acked: self._standby_answered(live, acked),
            live.machine.first_index,
        ):
            self._feed(live, Input.STANDBY_ACKED)  # no sync gate: nothing to wait for

    def _withdraw_standby_wait(self, live: InFlight, action: WithdrawStandbyWait) -> None:
        # the group waits in the sync gate: the stream's acknowledgement may
        # come after the VPN's sync timeout, which would count as the
        # standby falling behind
        self.sync.withdraw(live.txn.vpn, action.last)

    def _standby_settled(self, live: InFlight, action: StandbySettled) -> None:
        if live.phase is not None:
            live.phase.set_attribute("txn.standby_applied", action.acked)
            live.phase.set_attribute("txn.committed_early", action.early)
        live.enter(None)

    def _mark_degraded(self, live: InFlight, action: MarkDegraded) -> None:
        txn = live.txn
        log.warning(
            "VPN %s: transaction %s committed; the standby did not apply it in time",
            txn.vpn,
            txn.txid,
        )
        self._spawn(
            self.log.move(
                txn.txid,
                "committed",
                leaving=("prepared", "committed"),
                degraded=True,
                ledger_last=action.last_index,
            )
        )

    def _retire_marker(self, live: InFlight, action: RetireMarker) -> None:
        # decided and recorded: its marker is not needed any more (the row
        # ends in the sweep, once the standby's acknowledged index passed it)
        self.sweep.done(live.txn.vpn, live.txn.txid)

    def _answer(self, live: InFlight, action: Answer) -> None:
        self._release(live, action.ok)

    def _send_outcome(self, live: InFlight, action: SendOutcome) -> None:
        # After the client's answer: the outcome is bookkeeping. This
        # release's participant settles a row with its group and ignores a
        # commit outcome; a standby of the previous release settles the rows
        # it applied from the stream by it, so it is still sent.
        if self.link is not None:
            self.link.outcome(live.txn.vpn, live.txn.txid, commit=True)

    def _record_decision(self, live: InFlight, action: RecordDecision) -> None:
        """Append the transaction's events as one group: the decision."""
        for rid in live.published:
            self._committing_ids.pop(rid, None)
        txn = live.txn
        live.enter("txn.decision")
        try:
            last = self.ledger.append_group(
                txn.events, lambda ok: self._decision_durable(live, ok), decision=txn.txid
            )
        except LedgerError as e:
            log.error("VPN %s: transaction %s: decision not recorded: %s", txn.vpn, txn.txid, e)
            self._feed(live, Input.APPEND_FAILED)
            return
        live.late_answer = asyncio.get_running_loop().call_later(
            DECISION_BOUND_SECONDS, self._decision_late, live
        )
        self._perform(live, live.machine.appended(last - len(txn.events) + 1, last))

    def _decision_durable(self, live: InFlight, ok: bool) -> None:
        if live.late_answer is not None:
            live.late_answer.cancel()
            live.late_answer = None
        self._feed(live, Input.DECISION_DURABLE if ok else Input.DECISION_LOST)

    def _decision_late(self, live: InFlight) -> None:
        """The site's database has not made the decision durable in
        :data:`DECISION_BOUND_SECONDS`: the client stops waiting, told the
        outcome is unknown (the broker committed; the decision commits once
        the database answers, and recovery settles it if the node stops)."""
        live.late_answer = None
        done, live.on_done = live.on_done, None
        if done is None:
            return
        live.answered_late = True
        txn = live.txn
        log.warning(
            "VPN %s: transaction %s: its commit decision is not durable after %g s; "
            "the client is told the outcome is unknown",
            txn.vpn,
            txn.txid,
            DECISION_BOUND_SECONDS,
        )
        try:
            done(
                TransactionRefused(
                    f"the site database did not record the commit decision within "
                    f"{DECISION_BOUND_SECONDS:g} s"
                )
            )
        except Exception:
            log.exception("transaction %s: answering the client failed", txn.txid)

    def _committed_early(self, live: InFlight) -> None:
        """The standby committed the transaction early (ahead of the stream)."""
        failpoint("coordinator.after-early-commit")
        self.stats.committed_early[live.txn.vpn] += 1
        self._feed(live, Input.STANDBY_COMMITTED_EARLY)

    def _standby_answered(self, live: InFlight, acked: bool) -> None:
        """The sync gate: the stream acknowledged the group, or timed out."""
        self._feed(live, Input.STANDBY_ACKED if acked else Input.STANDBY_TIMEOUT)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[None]:
        """Run a bookkeeping step (a row's move) in the background; one that
        fails is logged, and recovery at the next start settles the row."""
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning(
                "transaction bookkeeping failed (settled at the next start): %s", task.exception()
            )
