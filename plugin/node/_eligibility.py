"""Sync eligibility written down: the sync gates' changes go to ``vpn_state``,
so ``vpnrepl status`` (which reads the database) shows a degraded VPN too.
"""

from __future__ import annotations

import asyncio
import logging

import psycopg

from bridge.active import Replicator
from bridge.store import record_sync_eligible

__all__ = ["record_eligibility"]

log = logging.getLogger("vpnrepl.node")

ELIGIBILITY_SECONDS = 0.5


async def record_eligibility(dsn: str, replicator: Replicator) -> None:
    """Every :data:`ELIGIBILITY_SECONDS`, what changed since the last record
    (a VPN whose gate is gone counts as eligible)."""
    recorded: dict[str, bool] = {}
    while True:
        await asyncio.sleep(ELIGIBILITY_SECONDS)
        changed = {
            vpn: gate.eligible
            for vpn, gate in replicator.gates.items()
            if recorded.get(vpn, True) != gate.eligible
        }
        changed.update({vpn: True for vpn in recorded if vpn not in replicator.gates})
        if not changed:
            continue
        try:
            async with await psycopg.AsyncConnection.connect(
                dsn, autocommit=True, connect_timeout=10
            ) as conn:
                for vpn, eligible in changed.items():
                    await record_sync_eligible(vpn, eligible).run_async(conn)
        except psycopg.Error as e:
            log.warning("sync eligibility not recorded: %s", e)
            continue
        recorded.update(changed)
        for vpn in [v for v in recorded if v not in replicator.gates]:
            del recorded[vpn]
