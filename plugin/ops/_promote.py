"""``vpnrepl promote VPN``: a standby VPN becomes the active one.

The steps, each safe to repeat (a SIGKILL of the node or the CLI anywhere,
then a re-run, loses nothing and duplicates nothing):

1. The epoch is raised and the role made ``active`` in one transaction, the
   in-doubt local transactions resolved in the same one
   (:func:`bridge.roles._roles.begin_promotion`): from then on the old active's
   stream is refused here, and the old active is fenced once it hears of
   the new epoch. A re-run finds the promotion ``running`` and resumes it.
2. The newest definitions the active sent (topology, users, permissions)
   are imported into this site's broker again, so the queues exist as the
   active last had them.
3. Every live message is published into its queues
   (:mod:`bridge.roles._materialise`: per queue, in publish order, with its
   original properties and the replication id header, confirmed; a queue
   an interrupted run left half done is emptied and done again).
4. The promotion is recorded ``done``; the node then admits the VPN's
   clients and serves it to a standby.

Clients are refused (530) while the promotion runs, so the queues hold only
what step 3 put there.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from bridge import BridgeError, failpoint
from bridge.broker import ManagementAPI, ManagementUnavailable, reimport
from bridge.roles import (
    PromotionStart,
    begin_promotion,
    fail_promotion,
    finish_promotion,
    materialise,
)
from plugin._errors import StateError
from plugin.config import SiteConfig

from ._requests import Progress
from ._store import connect

__all__ = ["PromotionSummary", "promote"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PromotionSummary:
    vpn: str
    epoch: int
    resumed: bool
    messages: int
    queues: int
    seconds: float
    txns_committed: int
    txns_committed_early: int

    def line(self) -> str:
        rate = self.messages / self.seconds if self.seconds > 0 else 0.0
        again = " (resumed)" if self.resumed else ""
        return (
            f"VPN {self.vpn!r} promoted to active at epoch {self.epoch}{again}: "
            f"{self.messages} messages into {self.queues} queues in {self.seconds:.1f} s "
            f"({rate:.0f} msg/s); in-doubt transactions committed: {self.txns_committed} "
            f"(and {self.txns_committed_early} already applied ahead)"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> PromotionSummary:
        return cls(**{k: doc[k] for k in cls.__dataclass_fields__})


def _begin(cfg: SiteConfig, vpn: str) -> PromotionStart:
    with connect(cfg.store_dsn) as conn:
        return begin_promotion(conn, vpn, cfg.site_name)


def _finish(cfg: SiteConfig, vpn: str, epoch: int) -> None:
    with connect(cfg.store_dsn) as conn:
        finish_promotion(conn, vpn, epoch)


def _fail(cfg: SiteConfig, vpn: str, error: str) -> None:
    with connect(cfg.store_dsn) as conn:
        fail_promotion(conn, vpn, error)


def _management(cfg: SiteConfig) -> ManagementAPI:
    """The site's management API as config-sync uses it: the node's own
    login, and the users it made itself, left alone."""
    node_user = unquote(urlsplit(cfg.amqp_url).username or "guest")
    return ManagementAPI(cfg.management_urls, keep_users=(node_user,), copy_tags=cfg.copy_tags)


async def promote(
    cfg: SiteConfig,
    vpn: str,
    progress: Progress | None = None,
    broker_ssl: ssl.SSLContext | None = None,
) -> PromotionSummary:
    """Promote ``vpn`` on this site (see the module docstring)."""
    t0 = time.monotonic()
    try:
        start = await asyncio.to_thread(_begin, cfg, vpn)
    except BridgeError as e:
        raise StateError(str(e)) from e
    failpoint("promotion.after-begin")

    def advanced(done: int, total: int) -> None:
        if total and done * 2 >= total:
            failpoint("promotion.mid-materialise")
        if progress is not None:
            progress(done, total)

    log.info(
        "VPN %s: %s promotion at epoch %d (in-doubt transactions committed: %d)",
        vpn,
        "resuming the" if start.resumed else "started the",
        start.epoch,
        start.txns_committed,
    )
    try:
        api = _management(cfg)
        if not await asyncio.to_thread(reimport, api, vpn, cfg.store_dsn):
            log.warning(
                "VPN %s: no definitions from the active are stored here; "
                "materialising into the topology the broker has",
                vpn,
            )
        result = await materialise(
            cfg.store_dsn,
            cfg.amqp_urls,
            vpn,
            start.epoch,
            ssl_context=broker_ssl,
            progress=advanced,
            api=api,
        )
        failpoint("promotion.before-finish")
        await asyncio.to_thread(_finish, cfg, vpn, start.epoch)
    except (BridgeError, ManagementUnavailable, OSError) as e:
        await asyncio.to_thread(_fail, cfg, vpn, str(e))
        raise StateError(
            f"promotion of VPN {vpn!r} stopped: {e}; run `vpnrepl promote {vpn}` again to resume"
        ) from e
    summary = PromotionSummary(
        vpn,
        start.epoch,
        start.resumed,
        result.total,
        result.queues + len(result.skipped_queues),
        time.monotonic() - t0,
        start.txns_committed,
        start.txns_committed_early,
    )
    log.info("%s", summary.line())
    return summary
