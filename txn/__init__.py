"""Transactions over both sites: local transactions as an internal
two-phase (XA) commit, and clients' own XA branches.

The middle layer (``plugin`` → ``txn`` → ``bridge``). Its public API is
listed here once: the sans-IO step table (:class:`TxnMachine`) is imported
with the package; the coordinator, the participant, the transaction log and
the commit-marker store, which need asyncio, psycopg or pika, are imported
on first use of their names (:data:`_IO_BOUND`).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ._machine import TRANSITIONS, Action, Input, Phase, TxnMachine, TxnProtocolError
from ._marker_key import MarkerKey
from ._xa_states import BranchState
from ._xa_wire import (
    XA_EXCHANGE,
    Branch,
    Verb,
    XaDuplicate,
    XaError,
    XaHeuristic,
    XaInvalid,
    XaNotFound,
    XaNotOwner,
    XaProtocolError,
    XaReply,
    XaRequest,
    XaResourceError,
    XaResourceFailure,
    XaRolledBack,
)
from ._xid import Xid, XidError

if TYPE_CHECKING:
    from ._coordinator import (
        Coordinator as Coordinator,
        GroupLedger as GroupLedger,
        StandbyLink as StandbyLink,
        TxnStats as TxnStats,
    )
    from ._log import (
        XA_PENDING as XA_PENDING,
        TxnLog as TxnLog,
        TxnRow as TxnRow,
        decode_events as decode_events,
        encode_events as encode_events,
    )
    from ._markers import (
        MarkerError as MarkerError,
        MarkerStore as MarkerStore,
        load_marker_key as load_marker_key,
        marker_txid as marker_txid,
        restored_marker as restored_marker,
    )
    from ._participant import Participant as Participant
    from ._resource import XAResource as XAResource
    from ._xa import (
        BranchChannel as BranchChannel,
        LogPublisher as LogPublisher,
        XaCoordinator as XaCoordinator,
        XaStats as XaStats,
    )

#: module -> the names it exports through this package, imported on first use
_IO_BOUND: dict[str, tuple[str, ...]] = {
    "._coordinator": ("Coordinator", "GroupLedger", "StandbyLink", "TxnStats"),
    "._log": ("XA_PENDING", "TxnLog", "TxnRow", "decode_events", "encode_events"),
    "._markers": (
        "MarkerError",
        "MarkerStore",
        "load_marker_key",
        "marker_txid",
        "restored_marker",
    ),
    "._participant": ("Participant",),
    "._resource": ("XAResource",),
    "._xa": ("BranchChannel", "LogPublisher", "XaCoordinator", "XaStats"),
}
_LAZY = {name: module for module, names in _IO_BOUND.items() for name in names}


def __getattr__(name: str) -> Any:
    """An I/O-bound name, imported on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_LAZY[name], __name__), name)


__all__ = [
    "TRANSITIONS",
    "Action",
    "Input",
    "Phase",
    "TxnMachine",
    "TxnProtocolError",
    # commit markers only the site's node can make
    "MarkerKey",
    # client XA: the id, the wire, the branch states
    "XA_EXCHANGE",
    "Branch",
    "BranchState",
    "Verb",
    "XaDuplicate",
    "XaError",
    "XaHeuristic",
    "XaInvalid",
    "XaNotFound",
    "XaNotOwner",
    "XaProtocolError",
    "XaReply",
    "XaRequest",
    "XaResourceError",
    "XaResourceFailure",
    "XaRolledBack",
    "Xid",
    "XidError",
    # the I/O-bound parts
]
__all__ += _LAZY
