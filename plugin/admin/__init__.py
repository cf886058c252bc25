"""The admin endpoint (aiohttp) and the node's metrics.

Read-only resources, the status page and its lag history, Prometheus
metrics, and promote / demote / switchover requests behind the endpoint's
credentials (:class:`AdminServer`).
"""

from __future__ import annotations

from ._endpoint import AdminCredentials, AdminServer
from ._lag_history import SAMPLE_SECONDS, LagHistory
from ._metrics import Buckets, ListenerStats, Metrics

__all__ = [
    "AdminCredentials",
    "AdminServer",
    "Buckets",
    "LagHistory",
    "ListenerStats",
    "Metrics",
    "SAMPLE_SECONDS",
]
