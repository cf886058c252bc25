"""``[reconcile] interval``: the node reconciles its active VPNs on a schedule.

About every interval (±10 %, so that sites and VPNs do not run in step),
``vpnrepl reconcile`` of each VPN active here, one at a time, as a child
process: the Spark job's JVM and memory stay out of the node, and the run
records itself in ``reconcile_run`` like one an operator starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
from collections.abc import Callable, Iterable

__all__ = ["ReconcileSchedule"]

# the node's own log: the schedule runs inside it
log = logging.getLogger("vpnrepl.node")


class ReconcileSchedule:
    """Runs the reconciliations (:meth:`run`): of each VPN ``names()`` lists
    that ``serves(name)`` when its turn comes."""

    def __init__(
        self,
        config_path: str,
        repair: bool,
        names: Callable[[], Iterable[str]],
        serves: Callable[[str], bool],
    ) -> None:
        self.config_path = config_path  # the config file a scheduled ``reconcile`` reads
        self.repair = repair
        self.names = names
        self.serves = serves

    async def run(self, interval: int) -> None:
        while True:
            await asyncio.sleep(interval * random.uniform(0.9, 1.1))  # noqa: S311 - jitter
            for name in self.names():
                if self.serves(name):  # active here, admitting clients, not fenced
                    await self.reconcile_once(name)

    async def reconcile_once(self, vpn: str) -> None:
        argv = [sys.executable, "-m", "plugin", "--config", self.config_path]
        argv += ["reconcile", vpn, "--json"] + (["--repair"] if self.repair else [])
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await proc.communicate()
        if proc.returncode not in (0, 3):
            why = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
            log.error(
                "scheduled reconcile of VPN %s failed (exit %s): %s", vpn, proc.returncode, why
            )
            return
        doc = json.loads(out)
        remaining = doc["remaining"]
        log.log(
            logging.INFO if proc.returncode == 0 else logging.WARNING,
            "scheduled reconcile of VPN %s: %s (missing on standby %d, extra %d, differs %d; "
            "repaired %d; broker drift in %d queues) in %.1f s",
            vpn,
            "the sites agree" if proc.returncode == 0 else "the sites DIFFER",
            remaining["missing_on_standby"],
            remaining["extra_on_standby"],
            remaining["differs"],
            doc["repaired"],
            len(doc["broker_drift"]),
            doc["seconds"],
        )
