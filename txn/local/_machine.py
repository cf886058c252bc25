"""The step table of one local transaction (sans-IO).

:class:`TxnMachine` takes what happened (:class:`Input`) and answers what
must be done next (actions, frozen values carrying their data); the driver
(:mod:`txn.local._coordinator`, :mod:`txn.local._decision`) performs them
and feeds the outcomes back. Every transition is in :data:`TXN_TRANSITIONS`
and the phase changes nowhere else; an input the phase does not allow is
a :class:`TxnProtocolError`.

Phases, in order (a transaction only moves forward)::

    PREPARING ──both prepared──▶ PREPARED ──broker commit sent──▶ COMMITTING
       │ (standby late: reject → ABORTED; degrade → PREPARED, degraded)
       ▼                                                  │ commit-ok (or a delivery)
    ABORTED ◀── rollback / client gone before the broker commit
                                                           ▼
    DECIDING ──standby committed early──▶ EARLY ──decision durable──▶ DONE
       │ decision durable                                             ▲
       ▼                                                              │
    AWAITING_STANDBY ──stream acknowledged, timed out, or early──────┘
    (DECIDING / EARLY: the decision could not be recorded → UNRECORDED)

EARLY is the standby's early commit of a sync-mode VPN (docs/behaviour.md,
"Local transactions", step 4); otherwise the standby's part is the stream's
acknowledgement of the group, through the VPN's sync gate.

Invariant: the client gets ``tx.commit-ok`` (:class:`Answer` ``ok``) only
once the decision is durable in the active's ledger and the standby holds
the transaction (committed early, or acknowledged by the stream) or the
transaction was degraded; nothing reaches the broker after a refusal, and
no action follows the end (DONE, ABORTED, UNRECORDED).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "TXN_TRANSITIONS",
    "Action",
    "Answer",
    "AwaitStandbyAck",
    "CommitEarly",
    "Forget",
    "Input",
    "MarkDegraded",
    "OpenStandbyPhase",
    "TxnPhase",
    "RecordDecision",
    "Refuse",
    "RetireMarker",
    "SendBrokerCommit",
    "SendOutcome",
    "StandbySettled",
    "TxnMachine",
    "TxnProtocolError",
    "WithdrawStandbyWait",
]


class TxnProtocolError(RuntimeError):
    """An input that the transaction's phase does not allow (a bug, not a
    client error): the driver logs it and fails the transaction safely."""


class TxnPhase(enum.Enum):
    PREPARING = "preparing"  # the prepared rows being written (here, and the standby's vote)
    PREPARED = "prepared"  # both prepared (or degraded): the broker may commit
    COMMITTING = "committing"  # marker publish + tx.commit sent, commit-ok owed
    DECIDING = "deciding"  # the broker committed: the decision (ledger group) being written
    EARLY = "early"  # the standby committed early; the decision not durable yet
    AWAITING_STANDBY = "awaiting standby"  # the decision durable; the stream's ack owed
    DONE = "done"  # recorded on both sites (or degraded): the client was answered
    ABORTED = "aborted"  # rolled back, or refused before the broker commit
    UNRECORDED = "unrecorded"  # the broker committed but the decision could not be recorded


class Input(enum.Enum):
    LOCAL_PREPARED = "local prepared"  # the coordinator's prepared row committed
    REMOTE_PREPARED = "remote prepared"  # the standby's participant voted yes
    REMOTE_TIMEOUT = "remote timeout"  # no yes vote within the VPN's sync timeout
    ABORT = "abort"  # rollback, close or failure before the broker commit
    BROKER_COMMIT_SENT = "broker commit sent"  # marker publish + tx.commit went out
    BROKER_COMMITTED = "broker committed"  # tx.commit-ok, or a delivery proving it
    GROUP_APPENDED = "group appended"  # the decision's group has its ledger indexes
    APPEND_FAILED = "append failed"  # the ledger refused the group
    DECISION_DURABLE = "decision durable"  # the ledger group is durable here
    DECISION_LOST = "decision lost"  # the ledger could not make the group durable
    STANDBY_COMMITTED_EARLY = "standby committed early"  # TxnApplied yes
    STANDBY_ACKED = "standby acked"  # the stream's acknowledgement (or nothing to wait for)
    STANDBY_TIMEOUT = "standby timeout"  # the sync gate's timeout passed first


# -- actions: what the driver does, with what it needs ------------------------


@dataclass(frozen=True, slots=True)
class SendBrokerCommit:
    """Release the client's held ``tx.commit`` behind the commit marker."""


@dataclass(frozen=True, slots=True)
class Refuse:
    """Fail the client's commit; nothing was applied anywhere."""

    reason: str


@dataclass(frozen=True, slots=True)
class Forget:
    """Mark the prepared rows aborted on both sites."""


@dataclass(frozen=True, slots=True)
class MarkDegraded:
    """Record the transaction as degraded: the standby gets it with the
    stream, not before the client's answer. ``last_index``: the group's
    last index once the decision is in the ledger (0 at prepare)."""

    last_index: int = 0


@dataclass(frozen=True, slots=True)
class RecordDecision:
    """Append the transaction's events to the ledger as one group, which
    moves the coordinator's row to committed (then feed GROUP_APPENDED)."""


@dataclass(frozen=True, slots=True)
class CommitEarly:
    """Ask the standby to commit the transaction from its prepared row (its
    group starts at ``first``)."""

    first: int


@dataclass(frozen=True, slots=True)
class OpenStandbyPhase:
    """The client now waits for the standby's commit (a span of its own)."""


@dataclass(frozen=True, slots=True)
class AwaitStandbyAck:
    """Wait for the stream's acknowledgement of ``last`` through the VPN's
    sync gate (feed STANDBY_ACKED at once when the VPN has none)."""

    last: int


@dataclass(frozen=True, slots=True)
class WithdrawStandbyWait:
    """Stop waiting for the acknowledgement of ``last``: the standby
    committed early, and a late acknowledgement must not count as a sync
    timeout."""

    last: int


@dataclass(frozen=True, slots=True)
class StandbySettled:
    """The standby's part is over: ``acked`` it holds the transaction,
    ``early`` by an early commit."""

    acked: bool
    early: bool


@dataclass(frozen=True, slots=True)
class RetireMarker:
    """The decision is recorded: the commit marker can go (in a sweep)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """Answer the client's ``tx.commit``: commit-ok, or (not ``ok``) the
    decision could not be recorded."""

    ok: bool


@dataclass(frozen=True, slots=True)
class SendOutcome:
    """Tell the standby the transaction committed (bookkeeping after the
    client's answer; a standby that committed early needs none)."""


Action = (
    SendBrokerCommit
    | Refuse
    | Forget
    | MarkDegraded
    | RecordDecision
    | CommitEarly
    | OpenStandbyPhase
    | AwaitStandbyAck
    | WithdrawStandbyWait
    | StandbySettled
    | RetireMarker
    | Answer
    | SendOutcome
)
_Step = Callable[["TxnMachine"], tuple[TxnPhase, list[Action]]]


# -- the steps ------------------------------------------------------------------


def _voted(m: TxnMachine) -> tuple[TxnPhase, list[Action]]:
    """A vote is in: the broker may commit once this site prepared and the
    standby did too, was late under ``degrade``, or is not needed."""
    remote = m.remote_prepared or m.degraded or not m.needs_standby
    if not (m.local_prepared and remote):
        return TxnPhase.PREPARING, []
    degraded: list[Action] = [MarkDegraded()] if m.degraded else []
    return TxnPhase.PREPARED, [*degraded, SendBrokerCommit()]


def _local_prepared(m: TxnMachine) -> tuple[TxnPhase, list[Action]]:
    m.local_prepared = True
    return _voted(m)


def _remote_prepared(m: TxnMachine) -> tuple[TxnPhase, list[Action]]:
    m.remote_prepared = True
    return _voted(m)


def _remote_timeout(m: TxnMachine) -> tuple[TxnPhase, list[Action]]:
    if m.remote_prepared:  # the yes vote won the race with the timer
        return _voted(m)
    if m.reject:
        m.refusal = "the standby did not prepare in time"
        return TxnPhase.ABORTED, [Forget(), Refuse(m.refusal)]
    m.degraded = True
    return _voted(m)


def _abort(m: TxnMachine) -> tuple[TxnPhase, list[Action]]:
    return TxnPhase.ABORTED, [Forget()]


def _to(phase: TxnPhase, *actions: Action) -> _Step:
    """A step that only moves to ``phase`` with fixed ``actions``."""
    return lambda m: (phase, list(actions))


def _appended(m: TxnMachine) -> tuple[TxnPhase, list[Action]]:
    """The group has its indexes: a sync transaction the standby prepared
    is committed early there, while the ledger write runs."""
    if m.needs_standby and not m.degraded:
        return TxnPhase.DECIDING, [CommitEarly(m.first_index)]
    return TxnPhase.DECIDING, []


def _settled(m: TxnMachine, acked: bool, early: bool) -> tuple[TxnPhase, list[Action]]:
    """The decision is durable and the standby's part is over: the client
    is answered. A standby that did not acknowledge in time degrades the
    transaction (the broker committed: it goes on without it)."""
    actions: list[Action] = [StandbySettled(acked, early)]
    if not acked and not m.degraded:
        m.degraded = True
        actions.append(MarkDegraded(m.last_index))
    actions += [RetireMarker(), Answer(True)]
    if not early:
        actions.append(SendOutcome())
    return TxnPhase.DONE, actions


def _durable(m: TxnMachine) -> tuple[TxnPhase, list[Action]]:
    """The decision is durable here; what the client still waits for."""
    if m.degraded:  # the standby gets it with the stream
        return _settled(m, acked=True, early=False)
    opened: list[Action] = [OpenStandbyPhase()] if m.needs_standby else []
    return TxnPhase.AWAITING_STANDBY, [*opened, AwaitStandbyAck(m.last_index)]


def _durable_after_early(m: TxnMachine) -> tuple[TxnPhase, list[Action]]:
    phase, actions = _settled(m, acked=True, early=True)
    return phase, [OpenStandbyPhase(), *actions]


def _early_while_deciding(m: TxnMachine) -> tuple[TxnPhase, list[Action]]:
    m.committed_early = True
    return TxnPhase.EARLY, []


def _early_while_awaiting(m: TxnMachine) -> tuple[TxnPhase, list[Action]]:
    m.committed_early = True
    phase, actions = _settled(m, acked=True, early=True)
    return phase, [WithdrawStandbyWait(m.last_index), *actions]


def _early_after_done(m: TxnMachine) -> tuple[TxnPhase, list[Action]]:
    m.committed_early = True
    return m.phase, []


def _acked(m: TxnMachine) -> tuple[TxnPhase, list[Action]]:
    return _settled(m, acked=True, early=False)


def _timed_out(m: TxnMachine) -> tuple[TxnPhase, list[Action]]:
    return _settled(m, acked=False, early=False)


_P, _I = TxnPhase, Input

#: (phase, input) -> the step that decides the next phase and the actions.
TXN_TRANSITIONS: Final[dict[tuple[TxnPhase, Input], _Step]] = {
    # Both prepares run at once; the votes arrive in either order.
    (_P.PREPARING, _I.LOCAL_PREPARED): _local_prepared,
    (_P.PREPARING, _I.REMOTE_PREPARED): _remote_prepared,
    # The standby's vote did not come within the sync timeout: the policy.
    (_P.PREPARING, _I.REMOTE_TIMEOUT): _remote_timeout,
    # Rollback, or the client gone, before the broker commit: both rows go.
    (_P.PREPARING, _I.ABORT): _abort,
    (_P.PREPARED, _I.ABORT): _abort,
    # The held tx.commit went out behind the commit marker.
    (_P.PREPARED, _I.BROKER_COMMIT_SENT): _to(_P.COMMITTING),
    # commit-ok, or a delivery of a message it published: record the decision.
    (_P.COMMITTING, _I.BROKER_COMMITTED): _to(_P.DECIDING, RecordDecision()),
    # A commit-ok after a delivery decided it (or after the end): nothing new.
    (_P.DECIDING, _I.BROKER_COMMITTED): _to(_P.DECIDING),
    (_P.EARLY, _I.BROKER_COMMITTED): _to(_P.EARLY),
    (_P.AWAITING_STANDBY, _I.BROKER_COMMITTED): _to(_P.AWAITING_STANDBY),
    (_P.DONE, _I.BROKER_COMMITTED): _to(_P.DONE),
    (_P.UNRECORDED, _I.BROKER_COMMITTED): _to(_P.UNRECORDED),
    # The group is in the ledger's queue with its indexes: the early commit.
    (_P.DECIDING, _I.GROUP_APPENDED): _appended,
    # The ledger refused the group, or lost it: the client cannot be told
    # it committed (recovery settles it by its marker at the next start).
    (_P.DECIDING, _I.APPEND_FAILED): _to(_P.UNRECORDED, Answer(False)),
    (_P.DECIDING, _I.DECISION_LOST): _to(_P.UNRECORDED, Answer(False)),
    (_P.EARLY, _I.DECISION_LOST): _to(_P.UNRECORDED, Answer(False)),
    # The decision is durable: settle, or wait for the standby's part.
    (_P.DECIDING, _I.DECISION_DURABLE): _durable,
    (_P.EARLY, _I.DECISION_DURABLE): _durable_after_early,
    # The standby committed early: before the decision is durable ...
    (_P.DECIDING, _I.STANDBY_COMMITTED_EARLY): _early_while_deciding,
    # ... while its acknowledgement was awaited (which is withdrawn) ...
    (_P.AWAITING_STANDBY, _I.STANDBY_COMMITTED_EARLY): _early_while_awaiting,
    # ... or after the stream's acknowledgement settled it, or after a
    # failure: the answer changes nothing.
    (_P.DONE, _I.STANDBY_COMMITTED_EARLY): _early_after_done,
    (_P.UNRECORDED, _I.STANDBY_COMMITTED_EARLY): _early_after_done,
    # The stream acknowledged the group, or the sync gate's timeout passed.
    (_P.AWAITING_STANDBY, _I.STANDBY_ACKED): _acked,
    (_P.AWAITING_STANDBY, _I.STANDBY_TIMEOUT): _timed_out,
    # A gate's answer after an early commit settled it: nothing new.
    (_P.DONE, _I.STANDBY_ACKED): _to(_P.DONE),
    (_P.DONE, _I.STANDBY_TIMEOUT): _to(_P.DONE),
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
    phase: TxnPhase = TxnPhase.PREPARING
    local_prepared: bool = False
    remote_prepared: bool = False
    degraded: bool = False
    #: the standby committed it early (its answer to CommitEarly was yes)
    committed_early: bool = False
    #: the decision's group in the ledger (GROUP_APPENDED)
    first_index: int = 0
    last_index: int = 0
    #: why the commit was refused (``Refuse``), for the client's reply text
    refusal: str = ""
    history: list[Input] = field(default_factory=list)

    def feed(self, what: Input) -> list[Action]:
        """Advance on ``what``; return the actions now due, in order."""
        step = TXN_TRANSITIONS.get((self.phase, what))
        if step is None:
            raise TxnProtocolError(
                f"transaction {self.txid}: {what.value} in phase {self.phase.value}"
            )
        self.history.append(what)
        self.phase, actions = step(self)
        return actions

    def appended(self, first: int, last: int) -> list[Action]:
        """GROUP_APPENDED: the decision's group holds ``first``..``last``."""
        self.first_index, self.last_index = first, last
        return self.feed(Input.GROUP_APPENDED)
