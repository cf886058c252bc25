"""``vpnrepl switchover VPN`` on the standby: a controlled swap of the two
live sites, with nothing lost and nothing doubled.

1. The active's node (reached through its database, ``[peers.NAME] store_dsn``)
   closes the VPN's client connections (320, "switchover to site X"),
   admits no new ones, and waits until the standby has acknowledged its
   whole ledger (``switchover-prepare``): nothing is confirmed there any
   more that the standby does not hold.
2. This site waits until it has applied that index, then promotes itself
   (the epoch rises; the active hears of it over the bridge and is fenced).
3. The active's node demotes itself (``switchover-finish``): its tail is
   empty by step 1, it becomes this site's standby and resynchronises.

If step 1 or 2 fails, the active is told to admit its clients again
(``switchover-abort``) and nothing changed.

The CLI runs these steps itself; ``POST /vpns/VPN/switchover`` on the
standby's admin endpoint has its node run them as an operator request,
promoting with its own handler (the node serves one request at a time: a
promote request of its own would wait behind the switchover for ever).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bridge.store import role_state
from plugin._errors import PluginError, StateError, UsageError
from plugin.config import SiteConfig

from ._promote import PromotionSummary, promote
from ._requests import Local, Progress, run_command
from ._store import connect

__all__ = ["switchover"]

#: how long this site waits to have applied what the active drained
APPLY_WAIT = 60.0


async def _no_node(progress: Progress) -> dict[str, Any]:
    raise StateError(
        "the active site's node is not running: a switchover needs both sites up "
        "(after a disaster, `vpnrepl promote` the standby instead)"
    )


def _standby_state(cfg: SiteConfig, vpn: str) -> tuple[str, str, int]:
    with connect(cfg.store_dsn) as conn:
        found = role_state(vpn).run(conn)
    if found is None:
        raise StateError(f"VPN {vpn!r} is not enabled on this site")
    return found.role.value, found.bridge_state, found.applied_index


async def _applied(cfg: SiteConfig, vpn: str, index: int) -> None:
    deadline = time.monotonic() + APPLY_WAIT
    while True:
        _, _, applied = await asyncio.to_thread(_standby_state, cfg, vpn)
        if applied >= index:
            return
        if time.monotonic() > deadline:
            raise StateError(
                f"this site applied index {applied} of VPN {vpn!r}, not {index}, "
                f"within {APPLY_WAIT:.0f} s"
            )
        await asyncio.sleep(0.05)


async def switchover(
    cfg: SiteConfig, vpn: str, progress: Progress, promote_here: Local | None = None
) -> list[str]:
    """Run the switchover of ``vpn`` to this site; returns what to print.
    ``promote_here``: how this site promotes, giving
    ``PromotionSummary.as_dict()`` (default: through its node when one
    runs, else in this process)."""
    peer = cfg.peer_store_dsn
    if peer is None:
        raise UsageError(
            f"{cfg.path}: {cfg.peer_store_key}: a switchover reaches the active site's node "
            "through its database: set it"
        )
    role, bridge, _ = await asyncio.to_thread(_standby_state, cfg, vpn)
    if role != "standby" or bridge != "connected":
        raise StateError(
            f"VPN {vpn!r} is {role} here with its bridge {bridge}: a switchover is run on a "
            "standby that follows the active"
        )
    args = {"to": cfg.site_name}
    drained = await run_command(peer, "switchover-prepare", vpn, args, _no_node, progress)
    lines = [
        f"the active closed VPN {vpn!r}'s clients and drained to index "
        f"{drained['ledger_index']} (acknowledged by this site)"
    ]
    try:
        await _applied(cfg, vpn, int(drained["ledger_index"]))

        if promote_here is None:

            async def here(p: Progress) -> dict[str, Any]:
                return (await promote(cfg, vpn, p)).as_dict()

            promoted = await run_command(
                cfg.store_dsn, "promote", vpn, {"switchover": True}, here, progress
            )
        else:
            promoted = await promote_here(progress)
    except PluginError:
        await run_command(peer, "switchover-abort", vpn, args, _no_node, progress)
        raise
    lines.append(PromotionSummary.from_dict(promoted).line())
    finished = await run_command(peer, "switchover-finish", vpn, args, _no_node, progress)
    lines.append(f"the former active site: {finished['line']}")
    return lines
