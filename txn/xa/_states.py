"""The states of a client's XA branch held by the node (sans-IO).

One table (:data:`BRANCH_TRANSITIONS`) says which verb a branch in a given state
takes and the state it is in while the verb runs; the state after the verb
depends on its outcome and is set by the driver (:mod:`txn.branches._manager`) through
:func:`settle`. A verb the state does not allow is an
:class:`~txn.xa._wire.XaProtocolError` for the client, never a silent skip.

A branch is *bound* to the client channel whose broker transaction holds
its work from ``start`` until it is prepared and committed or rolled back;
a prepared branch whose channel closed lives on in ``txn_log`` alone.
"""

from __future__ import annotations

import enum
from typing import Final

from ._wire import Verb, XaProtocolError

__all__ = ["BRANCH_TRANSITIONS", "BranchState", "begin", "settle"]


class BranchState(enum.Enum):
    ACTIVE = "active"  # started: the channel's work belongs to it
    IDLE = "idle"  # ended: no more work; prepare, one-phase commit or rollback next
    PREPARING = "preparing"  # persisted on both sites, the standby's vote awaited
    PREPARED = "prepared"  # voted yes: only commit or rollback
    COMMITTING = "committing"  # the broker commit or the log's publish under way
    ROLLING_BACK = "rolling back"
    ENDED = "ended"  # committed, rolled back, or read-only: forgotten


_S, _V = BranchState, Verb

#: (state, verb) -> the state while the verb runs
BRANCH_TRANSITIONS: Final[dict[tuple[BranchState, Verb], BranchState]] = {
    # Work goes into the channel's transaction until end.
    (_S.ACTIVE, _V.END): _S.IDLE,
    # A transaction manager may roll back a branch it never ended (a failure).
    (_S.ACTIVE, _V.ROLLBACK): _S.ROLLING_BACK,
    (_S.IDLE, _V.PREPARE): _S.PREPARING,
    # One-phase commit: prepare and commit in one call (the standby's vote still needed).
    (_S.IDLE, _V.COMMIT): _S.PREPARING,
    (_S.IDLE, _V.ROLLBACK): _S.ROLLING_BACK,
    (_S.PREPARED, _V.COMMIT): _S.COMMITTING,
    (_S.PREPARED, _V.ROLLBACK): _S.ROLLING_BACK,
}

#: the states a verb may settle into, by the state it ran in
_SETTLES: Final[dict[BranchState, frozenset[BranchState]]] = {
    _S.IDLE: frozenset({_S.IDLE}),
    _S.PREPARING: frozenset({_S.PREPARED, _S.COMMITTING, _S.ENDED}),
    _S.COMMITTING: frozenset({_S.ENDED, _S.PREPARED}),
    _S.ROLLING_BACK: frozenset({_S.ENDED, _S.PREPARED}),
}


def begin(state: BranchState, verb: Verb, xid: str) -> BranchState:
    """The state while ``verb`` runs on a branch in ``state``."""
    if state in (_S.PREPARING, _S.COMMITTING, _S.ROLLING_BACK):
        raise XaProtocolError(f"XA branch {xid}: another call on it is under way ({state.value})")
    after = BRANCH_TRANSITIONS.get((state, verb))
    if after is None:
        raise XaProtocolError(f"XA branch {xid}: {verb.value} is not allowed when {state.value}")
    return after


def settle(during: BranchState, after: BranchState) -> BranchState:
    """The state a verb that ran in ``during`` leaves the branch in."""
    if after not in _SETTLES.get(during, frozenset()):
        raise RuntimeError(f"an XA branch cannot go from {during.value} to {after.value}")
    return after
