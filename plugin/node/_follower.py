"""What a node that does not lead its site answers on its admin endpoint.

``/health`` says ok while the node relays to a leader it knows (a load
balancer may send clients here; they reach the leader through the relay)
and 503 while it knows none. ``/vpns/VPN/active`` answers 503: a load
balancer that routes by it sends a VPN's clients straight to the leader,
with no relay hop. ``/status`` says which node leads; ``/metrics`` holds
``vpnrepl_node_leads`` only, so the per-VPN series, and the README's alerts
on them, come from the leader alone and fire once. Operator requests
(``POST /vpns/VPN/promote`` ...) go through the site's database and reach
the leader as from any node.
"""

from __future__ import annotations

from typing import Any

from plugin.admin import AdminCredentials, AdminServer, LagHistory
from plugin.config import SiteConfig
from plugin.ops import read_request, start_request

from ._relay import Relay

__all__ = ["follower_admin", "leads_metric"]


def leads_metric(cfg: SiteConfig, leads: bool) -> bytes:
    """The ``vpnrepl_node_leads`` gauge of this node, in the exposition format."""
    return (
        "# HELP vpnrepl_node_leads 1 while this node leads its site's VPNs, 0 while it relays\n"
        "# TYPE vpnrepl_node_leads gauge\n"
        f'vpnrepl_node_leads{{site="{cfg.site_name}",node="{cfg.holder}"}} {int(leads)}\n'
    ).encode()


def follower_admin(cfg: SiteConfig, relay: Relay | None) -> AdminServer:
    """The admin endpoint of this node while another leads."""

    async def status() -> dict[str, Any]:
        leader = relay.leader.name if relay is not None and relay.leader is not None else None
        return {
            "site": cfg.site_name,
            "node": cfg.holder,
            "leads": False,
            "leader": leader,
            "relayed_connections": relay.relayed if relay is not None else 0,
            "vpns": [],
        }

    async def metrics() -> bytes:
        return leads_metric(cfg, False)

    credentials = (
        AdminCredentials(cfg.admin_user, cfg.admin_password, cfg.admin_token)
        if cfg.admin_user is not None or cfg.admin_token is not None
        else None
    )
    return AdminServer(
        status,
        metrics,
        lambda vpn: False,
        LagHistory(),
        credentials,
        lambda command, vpn, args: start_request(cfg.store_dsn, command, vpn, args),
        lambda request: read_request(cfg.store_dsn, request),
        healthy=lambda: relay is not None and relay.leader is not None,
    )
