"""``vpnrepl reconcile``: both sites' live states compared on Spark — per
queue counts and digests, row by row only where they differ — its report,
the repair it asks the node for, and the node's schedule of it."""

from __future__ import annotations

from ._reconcile import (
    Reconciler,
    ReconcileResult,
    repair_through_node,
    store_failed_run,
    store_run,
)
from ._report import render
from ._schedule import ReconcileSchedule
from ._spark import SiteSnapshot, SparkRun, SparkUnavailable, jdbc_url

__all__ = [
    "ReconcileResult",
    "ReconcileSchedule",
    "Reconciler",
    "SiteSnapshot",
    "SparkRun",
    "SparkUnavailable",
    "jdbc_url",
    "render",
    "repair_through_node",
    "store_failed_run",
    "store_run",
]
