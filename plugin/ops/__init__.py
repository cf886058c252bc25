"""The operator's runbook: what ``vpnrepl`` commands and the node's operator
requests do — promote, demote (and its tail export), switchover,
republish, deciding XA branches — and the request table they run through
(one at a time per site, recorded in the audit trail). The CLI calls these
directly or through the node (``run_command``); the node serves the
requests (``RequestServer``) with its side of each (``NodeRequests``).
"""

from __future__ import annotations

from ._audit import audit_rows, render_audit
from ._demote import DemotionSummary, demote, export_tail
from ._node_requests import NodeRequests, RunningNode
from ._nodes import nodes_doc, render_nodes
from ._promote import PromotionSummary, promote
from ._republish import RepublishSummary, TailRecord, read_tail_file, republish, write_tail_file
from ._requests import (
    ANSWERS,
    REQUESTS,
    SITE_LOCK,
    Local,
    Progress,
    RequestServer,
    read_request,
    run_command,
    start_request,
)
from ._store import (
    add_broker_depths,
    connect,
    disable_vpn,
    enable_vpn,
    status,
    store_unreachable,
)
from ._switchover import switchover
from ._xa_admin import decide_branch, list_branches

__all__ = [
    "add_broker_depths",
    "connect",
    "disable_vpn",
    "enable_vpn",
    "status",
    "store_unreachable",
    "ANSWERS",
    "REQUESTS",
    "SITE_LOCK",
    "DemotionSummary",
    "Local",
    "NodeRequests",
    "Progress",
    "PromotionSummary",
    "RepublishSummary",
    "RequestServer",
    "RunningNode",
    "TailRecord",
    "audit_rows",
    "nodes_doc",
    "render_nodes",
    "decide_branch",
    "demote",
    "export_tail",
    "list_branches",
    "promote",
    "read_request",
    "read_tail_file",
    "render_audit",
    "republish",
    "run_command",
    "start_request",
    "switchover",
    "write_tail_file",
]
