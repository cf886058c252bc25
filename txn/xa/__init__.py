"""The XA protocol between a client and the node, without I/O: the
branch id (:class:`Xid`), the wire's requests and replies, and the
states of a branch the node holds.
"""

from __future__ import annotations

from ._states import BRANCH_TRANSITIONS, BranchState, begin, settle
from ._wire import (
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

__all__ = [
    "Branch",
    "BranchState",
    "BRANCH_TRANSITIONS",
    "Verb",
    "XA_EXCHANGE",
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
    "begin",
    "settle",
]
