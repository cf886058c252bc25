"""The active site's end of the bridge.

The end every standby dials (:class:`ActiveBridge`) with what it lists
and its ledger prune, each VPN's stream to a standby (replay, checkpoint,
live), the replication sink
the listener's events go to (:class:`Replicator`) with its sync gates and
the sync-ineligible windows it records, and the transaction link's active
end (:class:`ActiveTxnLink`).
"""

from __future__ import annotations

from ._bridge import ActiveBridge
from ._replicator import Replicator, commit_in_task
from ._syncgate import HOLD_BOUND, SyncGate, WindowClosed, WindowOpened
from ._window_recorder import WindowRecorder

__all__ = [
    "ActiveBridge",
    "HOLD_BOUND",
    "Replicator",
    "SyncGate",
    "WindowClosed",
    "WindowOpened",
    "WindowRecorder",
    "commit_in_task",
]
