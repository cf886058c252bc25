"""``vpnrepl nodes``: the site's nodes as its database knows them: which
one leads (the site's lease, its term and how long it runs), each one's
last heartbeat, and the VPNs the leader leads."""

from __future__ import annotations

from typing import Any

import psycopg

from bridge.store import SITE, enabled_vpns, heartbeats, lease_of
from plugin.config import SiteConfig

__all__ = ["nodes_doc", "render_nodes"]


def nodes_doc(conn: psycopg.Connection[Any], cfg: SiteConfig) -> dict[str, Any]:
    """The ``nodes --json`` document."""
    lease = lease_of(SITE).run(conn)
    beats = {name: (holder, leads, ago) for name, holder, leads, ago in heartbeats().run(conn)}
    vpns = sorted(v.settings.name for v in enabled_vpns().run(conn))
    holder = lease[0] if lease is not None and lease[2] > 0 else None
    names = [n.name for n in cfg.nodes] or [cfg.holder]
    names += sorted(set(beats) - set(names))  # nodes that beat but are no longer configured
    rows = []
    for name in names:
        node = cfg.node(name)
        seen = beats.get(name)
        leads = holder is not None and holder.rpartition(".")[0] == name
        rows.append(
            {
                "name": name,
                "configured": node is not None or not cfg.nodes,
                "amqp": str(node.amqp) if node else str(cfg.listen_amqp),
                "bridge": str(node.bridge) if node else str(cfg.listen_bridge),
                "admin": str(node.admin) if node else str(cfg.listen_admin),
                "leads": leads,
                "term": lease[1] if leads and lease is not None else None,
                "last_heartbeat_seconds": round(seen[2], 1) if seen else None,
                "vpns": vpns if leads else [],
            }
        )
    return {
        "site": cfg.site_name,
        "lease": None
        if lease is None
        else {"holder": lease[0], "term": lease[1], "seconds_left": round(lease[2], 1)},
        "nodes": rows,
    }


def render_nodes(doc: dict[str, Any]) -> str:
    """The ``nodes`` table."""
    head = ("NODE", "ROLE", "TERM", "HEARTBEAT", "AMQP", "BRIDGE", "VPNS")
    rows = [head]
    for n in doc["nodes"]:
        seen = n["last_heartbeat_seconds"]
        rows.append(
            (
                n["name"] + ("" if n["configured"] else " (not configured)"),
                "leader" if n["leads"] else "relays",
                str(n["term"]) if n["term"] is not None else "-",
                f"{seen:g} s ago" if seen is not None else "never",
                n["amqp"],
                n["bridge"],
                ", ".join(n["vpns"]) or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lease = doc["lease"]
    if lease is None:
        tail = "no node has led this site yet"
    elif lease["seconds_left"] > 0:
        tail = f"lease: {lease['holder']}, term {lease['term']}, {lease['seconds_left']:g} s left"
    else:
        tail = f"lease: expired {-lease['seconds_left']:g} s ago (term {lease['term']}): no leader"
    return "\n".join([f"site {doc['site']}", *lines, tail]) + "\n"
