"""The coordinator's state machine for one local transaction (sans-IO).

A client's ``tx.commit`` on a channel that published or acked replicated
messages becomes an internal two-phase transaction. This module holds the
order of its steps and nothing else: :class:`TxnMachine` takes what happened
(:class:`Input`) and answers what must be done next (:class:`Action`); the
driver in :mod:`txn._coordinator` performs the actions with the database,
the bridge and the broker, and feeds the outcomes back. Every transition is
in one table (:data:`TRANSITIONS`), so an input in the wrong phase is a
:class:`TxnProtocolError`, never a silent skip.

Phases, in order (a transaction only moves forward)::

    PREPARING ──local+remote prepared──▶ PREPARED ──broker commit sent──▶ COMMITTING
        │  (remote timed out: reject → ABORTED; degrade → PREPARED, degraded)
        ▼                                                     │ broker commit-ok
    ABORTED ◀── rollback / client gone before the broker commit ▼
                                                           DECIDING ──decision durable──▶ DONE

``DONE`` means the decision is durable in the active's ledger and, unless the
transaction is degraded, applied by the standby: the client may get
``tx.commit-ok``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Action", "Input", "Phase", "TxnMachine", "TxnProtocolError", "TRANSITIONS"]


class TxnProtocolError(RuntimeError):
    """An input that the transaction's phase does not allow (a bug, not a
    client error): the driver logs it and fails the transaction safely."""


class Phase(enum.Enum):
    PREPARING = "preparing"
    PREPARED = "prepared"
    COMMITTING = "committing"
    DECIDING = "deciding"
    DONE = "done"
    ABORTED = "aborted"


class Input(enum.Enum):
    LOCAL_PREPARED = "local prepared"  # the coordinator's prepared row committed
    REMOTE_PREPARED = "remote prepared"  # the standby's participant voted yes
    REMOTE_TIMEOUT = "remote timeout"  # no vote within the VPN's sync timeout
    BROKER_COMMIT_SENT = "broker commit sent"  # marker publish + tx.commit went out
    BROKER_COMMITTED = "broker committed"  # tx.commit-ok, or a delivery proving it
    DECISION_DURABLE = "decision durable"  # ledger group durable (and applied, sync)
    ABORT = "abort"  # rollback, close or failure before the broker commit


class Action(enum.Enum):
    SEND_BROKER_COMMIT = "send broker commit"  # release the held tx.commit + marker
    REFUSE = "refuse"  # fail the client's commit; nothing was applied anywhere
    RECORD_DECISION = "record decision"  # append the events to the ledger as one group
    RELEASE_COMMIT_OK = "release commit-ok"
    FORGET = "forget"  # mark the rows aborted on both sites


#: (phase, input) -> next phase; the actions follow from the phase entered.
TRANSITIONS: dict[tuple[Phase, Input], Phase] = {
    (Phase.PREPARING, Input.LOCAL_PREPARED): Phase.PREPARING,
    (Phase.PREPARING, Input.REMOTE_PREPARED): Phase.PREPARING,
    (Phase.PREPARING, Input.REMOTE_TIMEOUT): Phase.PREPARING,
    (Phase.PREPARING, Input.ABORT): Phase.ABORTED,
    (Phase.PREPARED, Input.BROKER_COMMIT_SENT): Phase.COMMITTING,
    (Phase.PREPARED, Input.ABORT): Phase.ABORTED,
    (Phase.COMMITTING, Input.BROKER_COMMITTED): Phase.DECIDING,
    (Phase.DECIDING, Input.BROKER_COMMITTED): Phase.DECIDING,  # commit-ok after a delivery
    (Phase.DECIDING, Input.DECISION_DURABLE): Phase.DONE,
    (Phase.DONE, Input.BROKER_COMMITTED): Phase.DONE,
}


@dataclass
class TxnMachine:
    """One transaction's progress. ``needs_standby`` is False for an async
    VPN (the standby gets the transaction with the ledger stream) and True
    for a sync VPN, whose standby must prepare before the broker commits;
    ``reject`` is the VPN's ``on-sync-timeout`` policy."""

    txid: str
    needs_standby: bool
    reject: bool
    phase: Phase = Phase.PREPARING
    local_prepared: bool = False
    remote_prepared: bool = False
    degraded: bool = False
    #: why the commit was refused (``REFUSE``), for the client's reply text
    refusal: str = ""
    history: list[Input] = field(default_factory=list)

    def feed(self, what: Input) -> list[Action]:
        """Advance on ``what``; return the actions now due, in order."""
        after = TRANSITIONS.get((self.phase, what))
        if after is None:
            raise TxnProtocolError(
                f"transaction {self.txid}: {what.value} in phase {self.phase.value}"
            )
        self.history.append(what)
        before, self.phase = self.phase, after
        if what is Input.LOCAL_PREPARED:
            self.local_prepared = True
        elif what is Input.REMOTE_PREPARED:
            self.remote_prepared = True
        elif what is Input.REMOTE_TIMEOUT and not self.remote_prepared:
            if self.reject:
                self.phase = Phase.ABORTED
                self.refusal = "the standby did not prepare in time"
                return [Action.FORGET, Action.REFUSE]
            self.degraded = True
        elif what is Input.ABORT:
            return [Action.FORGET]
        if self.phase is Phase.PREPARING and self._voted():
            self.phase = Phase.PREPARED
            return [Action.SEND_BROKER_COMMIT]
        if before is Phase.COMMITTING and self.phase is Phase.DECIDING:
            return [Action.RECORD_DECISION]
        if before is Phase.DECIDING and self.phase is Phase.DONE:
            return [Action.RELEASE_COMMIT_OK]
        return []

    def _voted(self) -> bool:
        remote = self.remote_prepared or self.degraded or not self.needs_standby
        return self.local_prepared and remote
