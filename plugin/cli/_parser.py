"""``vpnrepl``'s arguments: every command, its options and their checks
(names are a contract). Each command's parser names the function that
runs it (``run``, from :mod:`plugin.cli._commands`).
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from bridge import DEFAULT_SYNC_TIMEOUT_MS, MAX_SEGMENTS, Mode, Role, SyncTimeoutPolicy
from plugin._errors import UsageError

from ._commands import (
    cmd_audit,
    cmd_demo,
    cmd_demote,
    cmd_init,
    cmd_node,
    cmd_nodes,
    cmd_promote,
    cmd_reconcile,
    cmd_republish,
    cmd_sandbox,
    cmd_status,
    cmd_switchover,
    cmd_tls_init,
    cmd_vpn_disable,
    cmd_vpn_enable,
    cmd_xa,
)

__all__ = ["build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _segment_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 1 <= value <= MAX_SEGMENTS:
        raise argparse.ArgumentTypeError(f"{value}: expected 1 to {MAX_SEGMENTS} segments")
    return value


def _seconds(text: str) -> float:
    """``--watch``'s interval: a number of seconds, at least 0.5."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.5 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"{text!r}: the interval must be 0.5 to 86400 seconds")
    return value


def build_parser() -> _Parser:
    p = _Parser(prog="vpnrepl", description="Disaster-recovery replication for RabbitMQ vhosts.")
    p.add_argument("--config", metavar="SITE.TOML", help="the site's configuration file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key of the config file (repeatable)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    c = sub.add_parser("init", help="create or upgrade the site's schema")
    c.set_defaults(run=cmd_init)
    c = sub.add_parser("node", help="run the site process")
    c.add_argument(
        "--name",
        metavar="NODE",
        help="the node to run as: its [nodes.NODE] table (required when the site has several)",
    )
    c.set_defaults(run=cmd_node)

    vpn = sub.add_parser("vpn", help="enable or disable replication of a VPN (vhost)")
    vsub = vpn.add_subparsers(dest="vpn_command", metavar="ACTION", parser_class=_Parser)
    vsub.required = True
    e = vsub.add_parser("enable", help="enable replication of VPN, or change its settings")
    e.add_argument("vpn", metavar="VPN")
    e.add_argument("--role", required=True, choices=[r.value for r in Role])
    # (an option left out keeps the VPN's stored value; a new VPN takes the default)
    e.add_argument("--mode", choices=[m.value for m in Mode], help=f"default {Mode.ASYNC.value}")
    e.add_argument(
        "--sync-timeout-ms", type=int, metavar="N", help=f"default {DEFAULT_SYNC_TIMEOUT_MS}"
    )
    e.add_argument(
        "--on-sync-timeout",
        choices=[s.value for s in SyncTimeoutPolicy],
        help=f"default {SyncTimeoutPolicy.DEGRADE.value}",
    )
    e.add_argument(
        "--queues",
        action="append",
        metavar="REGEX",
        help="replicate queues whose name matches REGEX (repeatable; default, or '', every queue)",
    )
    e.add_argument(
        "--topics",
        action="append",
        metavar="EXCHANGE:PATTERN",
        help="replicate publishes to EXCHANGE matching PATTERN (repeatable; '' clears them)",
    )
    e.add_argument(
        "--expose-id",
        action=argparse.BooleanOptionalAction,
        help="let consumers see the x-vpnrepl-id header (tracing); hidden by default",
    )
    e.set_defaults(run=cmd_vpn_enable)
    d = vsub.add_parser("disable", help="stop replicating VPN")
    d.add_argument("vpn", metavar="VPN")
    d.set_defaults(run=cmd_vpn_disable)

    s = sub.add_parser("status", help="per VPN: role, epoch, mode, lag, in-doubt txns, bridge")
    s.add_argument(
        "--json", action="store_true", help="print one JSON object (one line per refresh)"
    )
    s.add_argument(
        "--watch",
        type=_seconds,
        metavar="N",
        help="refresh every N seconds until interrupted",
    )
    s.set_defaults(run=cmd_status)
    s = sub.add_parser("nodes", help="the site's nodes: which leads, its term, heartbeats, VPNs")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(run=cmd_nodes)
    c = sub.add_parser("promote", help="standby -> active (after a disaster, or a switchover)")
    c.add_argument("vpn", metavar="VPN")
    c.add_argument(
        "--force",
        action="store_true",
        help="even while the old active still serves the VPN to this site (split brain)",
    )
    c.set_defaults(run=cmd_promote)
    c = sub.add_parser("demote", help="fenced former active -> standby (exports its tail)")
    c.add_argument("vpn", metavar="VPN")
    c.add_argument("--export", metavar="FILE", help="where to write the unreplicated tail")
    c.set_defaults(run=cmd_demote)
    c = sub.add_parser("switchover", help="on the standby: swap roles with the live active")
    c.add_argument("vpn", metavar="VPN")
    c.set_defaults(run=cmd_switchover)
    c = sub.add_parser("republish", help="publish a demoted site's exported tail here")
    c.add_argument("file", metavar="FILE")
    c.set_defaults(run=cmd_republish)
    c = sub.add_parser(
        "reconcile", help="on the active: compare (and repair) the standby's live state (Spark)"
    )
    c.add_argument("vpn", metavar="VPN")
    c.add_argument("--repair", action="store_true", help="send what differs to the standby")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.add_argument("--master", metavar="URL", help="Spark master (default [reconcile] master)")
    c.add_argument(
        "--segments", type=_segment_count, metavar="N", help="segments per queue (default 1024)"
    )
    c.add_argument(
        "--method",
        choices=("pushdown", "jdbc"),
        help="hash segments in PostgreSQL (pushdown, default) or in Spark from JDBC rows",
    )
    c.set_defaults(run=cmd_reconcile)
    xa = sub.add_parser("xa", help="list, commit or roll back client XA branches of a VPN")
    xsub = xa.add_subparsers(dest="xa_command", metavar="ACTION", parser_class=_Parser)
    xsub.required = True
    c = xsub.add_parser("list", help="the VPN's prepared and heuristic branches on this site")
    c.add_argument("vpn", metavar="VPN")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(run=cmd_xa, xid=None)
    for action, what in (("commit", "commit"), ("rollback", "roll back")):
        c = xsub.add_parser(
            action, help=f"{what} a prepared branch whose transaction manager is gone"
        )
        c.add_argument("vpn", metavar="VPN")
        c.add_argument("xid", metavar="XID", help="format_id:gtrid-hex:bqual-hex")
        c.set_defaults(run=cmd_xa, json=False)
    c = sub.add_parser("demo", help="two local sites, a workload, a promotion")
    c.set_defaults(run=cmd_demo, needs_config=False)
    c = sub.add_parser(
        "sandbox", help="start (stop) two sites' RabbitMQ and PostgreSQL here, to try things"
    )
    c.add_argument("action", choices=("start", "stop"))
    c.add_argument("dir", metavar="DIR", help="where the servers, configs and addresses go")
    c.add_argument(
        "--brokers", type=int, default=1, metavar="N",
        help="each site's RabbitMQ a cluster of N nodes (start; 1 to 5, default 1)",
    )  # fmt: skip
    c.set_defaults(run=cmd_sandbox, needs_config=False)
    c = sub.add_parser("audit", help="operator actions on this site, newest first, and who asked")
    c.add_argument("--vpn", help="only this VPN's")
    c.add_argument("--limit", type=int, default=50, help="how many (50)")
    c.add_argument("--json", action="store_true", help="one JSON array")
    c.set_defaults(run=cmd_audit)
    tls = sub.add_parser("tls", help="certificates for the bridge")
    tsub = tls.add_subparsers(dest="tls_command", metavar="ACTION", parser_class=_Parser)
    tsub.required = True
    c = tsub.add_parser(
        "init", help="a private CA and a certificate naming each site, with their [tls] lines"
    )
    c.add_argument("dir", metavar="DIR", help="where the CA and the certificates go")
    c.add_argument("--sites", required=True, metavar="A,B", help="the site names, comma-separated")
    c.add_argument("--days", type=int, default=825, help="site certificates' validity (825)")
    c.add_argument(
        "--renew",
        action="store_true",
        help="issue the sites' certificates again from the CA there (then SIGHUP the nodes)",
    )
    c.set_defaults(run=cmd_tls_init, needs_config=False)
    return p
