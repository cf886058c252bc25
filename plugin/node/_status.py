"""What the node reports about its site: the ``status --json`` document with
the node's live view folded in, and the ``/metrics`` body.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from bridge.active import Replicator
from bridge.broker import ManagementAPI
from plugin._errors import PluginError
from plugin.admin import Metrics
from plugin.config import SiteConfig
from plugin.ops import add_broker_depths, connect, status

__all__ = ["metrics_body", "site_status"]

log = logging.getLogger("vpnrepl.node")


async def site_status(
    cfg: SiteConfig, api: ManagementAPI, replicator: Replicator, broker: bool = True
) -> dict[str, Any]:
    """The ``status --json`` document; ``broker=False``: without the
    queue counts, live or at the broker (``/metrics`` and the lag history
    read it every few seconds)."""

    def read() -> dict[str, Any]:
        with connect(cfg.store_dsn) as conn:
            return status(
                conn,
                cfg.site_name,
                queues=broker,
                bridge_authenticated=cfg.bridge_authenticated,
            )

    doc = await asyncio.to_thread(read)
    if broker:
        await asyncio.to_thread(add_broker_depths, doc, api)
    for vpn in doc["vpns"]:
        if vpn["role"] == "active":
            vpn["sync_eligible"] = replicator.sync_eligible(vpn["name"])
            vpn["fenced"] = vpn["fenced"] or vpn["name"] in replicator.fenced
    return doc


async def metrics_body(
    metrics: Metrics, read_status: Callable[[], Awaitable[dict[str, Any]]]
) -> bytes:
    """The ``/metrics`` body: the counters and this site's per-VPN state
    (``read_status()``, without the broker); with ``vpnrepl_store_up 0``
    and no per-VPN state when the database cannot be read (a scrape still
    answers)."""
    try:
        doc: dict[str, Any] | None = await read_status()
    except (PluginError, OSError, psycopg.Error) as e:
        log.warning("metrics: this site's store cannot be read: %s", e)
        doc = None
    return metrics.render(doc)
