"""``vpnrepl demote VPN``: a fenced former active becomes a standby.

After a failover the old active still holds what it confirmed after the new
active took over (the *unreplicated tail*: in async mode, and in sync mode
what ``degrade`` confirmed without the standby). Nothing of it may vanish
silently, so demotion goes:

1. :func:`export_tail` writes the tail to a file (JSON lines: id, exchange,
   routing key, queues, properties and body in base64) and says how many
   messages it holds; ``vpnrepl republish FILE`` on the new active
   publishes them there, at most once per id. The CLI does this itself,
   whether a node runs or not: it only reads the database.
2. :func:`demote` empties the VPN's in-scope queues on this site's broker
   (they are the old epoch's; the new active's checkpoint refills the
   standby's state), counts what out-of-scope queues hold (left for the
   admin), and makes the VPN a standby with nothing applied
   (:func:`bridge.roles._roles.demote_to_standby`): the new active sends it a
   checkpoint, then the live stream.

Both steps can be repeated: a crash between them leaves a fenced active,
whose tail is exported again the same.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from bridge import BridgeError, VpnSettings
from bridge.amqp import AmqpEndpoint
from bridge.broker import BrokerPublisher, ManagementAPI, ManagementUnavailable
from bridge.roles import Tail, demote_to_standby, ensure_fenced, read_tail
from bridge.store import read_vpn_settings
from plugin._errors import StateError
from plugin.config import SiteConfig
from plugin.tls import site_broker_ssl
from plugin.topology import ReplicationScope

from ._republish import write_tail_file
from ._store import connect

__all__ = ["DemotionSummary", "demote", "export_tail"]

log = logging.getLogger(__name__)


def export_tail(
    cfg: SiteConfig, vpn: str, path: Path | None = None, directory: Path | None = None
) -> tuple[Tail, Path]:
    """Write ``vpn``'s unreplicated tail to ``path`` (default: a file named
    after the site, VPN and epoch in ``directory``, or the current one)."""
    try:
        with connect(cfg.store_dsn) as conn:
            tail = read_tail(conn, vpn)
    except BridgeError as e:
        raise StateError(str(e)) from e
    if path is None:
        name = f"vpnrepl-tail-{cfg.site_name}-{quote(vpn, safe='')}-epoch{tail.epoch}.jsonl"
        path = (directory or Path()) / name
    write_tail_file(path, vpn, tail.messages)
    return tail, path


@dataclass(frozen=True, slots=True)
class DemotionSummary:
    vpn: str
    epoch: int
    emptied: dict[str, int]
    left: dict[str, int]

    def line(self) -> str:
        emptied = sum(self.emptied.values())
        left = ", ".join(f"{q}: {n}" for q, n in sorted(self.left.items()) if n) or "none"
        return (
            f"VPN {self.vpn!r} is a standby of epoch {self.epoch} now: {emptied} messages "
            f"emptied from {len(self.emptied)} in-scope queues (the new active's checkpoint "
            f"replaces them); left in out-of-scope queues for the admin: {left}"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> DemotionSummary:
        return cls(**{k: doc[k] for k in cls.__dataclass_fields__})


def _settings(cfg: SiteConfig, vpn: str) -> tuple[VpnSettings, set[str]]:
    with connect(cfg.store_dsn) as conn:
        settings = read_vpn_settings(vpn).run(conn)
        held = {
            r["queue"]
            for r in conn.execute(
                "SELECT DISTINCT queue FROM live_message WHERE vpn = %s", (vpn,)
            ).fetchall()
        }
    if settings is None:
        raise StateError(f"VPN {vpn!r} is not known on this site")
    return settings, held


def _queue_names(cfg: SiteConfig, vpn: str) -> list[str]:
    names = ManagementAPI(cfg.management_urls).get(f"queues/{quote(vpn, safe='')}?columns=name")
    return [str(q["name"]) for q in names] if isinstance(names, list) else []


async def _empty_queues(cfg: SiteConfig, vpn: str) -> tuple[dict[str, int], dict[str, int]]:
    """Empty the in-scope queues (by name, or holding replicated messages)
    and count what the others hold, through AMQP (exact counts; the
    management API's lag by its statistics interval)."""
    settings, held = await asyncio.to_thread(_settings, cfg, vpn)
    scope = ReplicationScope.of(settings)
    names = await asyncio.to_thread(_queue_names, cfg, vpn)
    emptied: dict[str, int] = {}
    left: dict[str, int] = {}
    async with await BrokerPublisher.connect(
        [AmqpEndpoint.from_url(url) for url in cfg.amqp_urls],
        vpn,
        ssl_context=site_broker_ssl(cfg),
        connection_name="vpnrepl demote",
    ) as broker:
        for queue in names:
            if queue.startswith("vpnrepl."):
                continue  # ours (commit markers)
            if scope.names_queue(queue) or queue in held:
                emptied[queue] = await broker.purge(queue)
            else:
                left[queue] = await broker.declare_passive(queue)
    return emptied, left


def _ensure_fenced(cfg: SiteConfig, vpn: str) -> None:
    with connect(cfg.store_dsn) as conn:
        ensure_fenced(conn, vpn)


def _demote_in_db(cfg: SiteConfig, vpn: str) -> int:
    with connect(cfg.store_dsn) as conn:
        return demote_to_standby(conn, vpn)


async def demote(cfg: SiteConfig, vpn: str) -> DemotionSummary:
    """Steps 2 (see the module docstring); the tail must be exported first."""
    try:
        # still a fenced former active? (RoleError if not: its queues stay)
        await asyncio.to_thread(_ensure_fenced, cfg, vpn)
        emptied, left = await _empty_queues(cfg, vpn)
        epoch = await asyncio.to_thread(_demote_in_db, cfg, vpn)
    except (BridgeError, ManagementUnavailable) as e:
        raise StateError(f"VPN {vpn!r} not demoted: {e}") from e
    summary = DemotionSummary(vpn, epoch, emptied, left)
    log.info("%s", summary.line())
    return summary
