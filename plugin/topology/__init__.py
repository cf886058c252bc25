"""A VPN's topology and RabbitMQ's routing, reproduced without I/O, and the
listener's view of the site's VPNs (role, scope, topology per vhost).
"""

from __future__ import annotations

from ._directory import VpnDirectory, VpnView
from ._entities import Binding, DestinationKind, Exchange, ExportError, Policy, Queue
from ._routing import Refused, header_routes, tagged, topic_matches
from ._scope import ReplicationScope
from ._scope_report import DEPTH_COLUMNS, out_of_scope, replicable_depth, scope_report
from ._topology import Topology

__all__ = [
    "Binding",
    "ExportError",
    "DestinationKind",
    "Exchange",
    "Policy",
    "Queue",
    "Refused",
    "ReplicationScope",
    "Topology",
    "VpnDirectory",
    "VpnView",
    "header_routes",
    "out_of_scope",
    "replicable_depth",
    "DEPTH_COLUMNS",
    "scope_report",
    "tagged",
    "topic_matches",
]
