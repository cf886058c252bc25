"""Local transactions as an internal two-phase commit over both sites.

The step table (sans-IO), the coordinator on the active (the prepare, the
steps after the broker commit, recovery, the sweep), the participant on the
standby, ``txn_log``, and the commit markers recovery reads in the broker.
"""

from __future__ import annotations

from ._coordinator import RESOLVE_DELAY, Coordinator
from ._inflight import TxnStats
from ._log import PARTICIPANT, PRUNE_LIMIT, XA_PENDING, TxnLog, TxnRow, encode_events
from ._machine import (
    TXN_TRANSITIONS,
    Answer,
    AwaitStandbyAck,
    CommitEarly,
    Forget,
    Input,
    MarkDegraded,
    OpenStandbyPhase,
    RecordDecision,
    Refuse,
    RetireMarker,
    SendBrokerCommit,
    SendOutcome,
    StandbySettled,
    TxnMachine,
    TxnPhase,
    TxnProtocolError,
    WithdrawStandbyWait,
)
from ._markers import (
    CLOCK_SLACK_SECONDS,
    LEGACY_MARKER_QUEUE,
    MARKER_ARGUMENTS,
    MARKER_RETENTION_SECONDS,
    MarkerError,
    MarkerStore,
    load_marker_key,
    restored_marker,
)
from ._participant import Participant
from ._sink import TransactionalSink
from ._sweep import TXN_RETAIN_SECONDS

__all__ = [
    "TransactionalSink",
    "Answer",
    "AwaitStandbyAck",
    "CommitEarly",
    "Coordinator",
    "Forget",
    "Input",
    "MarkDegraded",
    "MarkerError",
    "MarkerStore",
    "CLOCK_SLACK_SECONDS",
    "LEGACY_MARKER_QUEUE",
    "MARKER_RETENTION_SECONDS",
    "MARKER_ARGUMENTS",
    "OpenStandbyPhase",
    "PARTICIPANT",
    "PRUNE_LIMIT",
    "Participant",
    "TxnPhase",
    "RESOLVE_DELAY",
    "RecordDecision",
    "Refuse",
    "RetireMarker",
    "SendBrokerCommit",
    "SendOutcome",
    "StandbySettled",
    "TXN_TRANSITIONS",
    "TXN_RETAIN_SECONDS",
    "TxnLog",
    "TxnMachine",
    "TxnProtocolError",
    "TxnRow",
    "TxnStats",
    "WithdrawStandbyWait",
    "XA_PENDING",
    "encode_events",
    "load_marker_key",
    "restored_marker",
]
