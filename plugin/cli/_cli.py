"""``vpnrepl``: the broker admin's command line (names are a contract).

Exit status: 0 on success, 2 on a usage or config error, 1 on any other
failure, always with one line on stderr saying what is wrong; ``reconcile``
exits 3 when the sites still differ at the end of its run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from bridge import (
    DEFAULT_SYNC_TIMEOUT_MS,
    MAX_SEGMENTS,
    BridgeError,
    InvalidSettings,
    Mode,
    Role,
    SyncTimeoutPolicy,
    VpnSettings,
)
from bridge.broker import ManagementAPI, ManagementUnavailable
from bridge.store import read_vpn_settings
from plugin._config import SiteConfig, load_config
from plugin._errors import PluginError, UsageError
from plugin.ops import add_broker_depths, connect, disable_vpn, enable_vpn, status

__all__ = ["main"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_DIFFER = 0, 1, 2, 3

log = logging.getLogger("vpnrepl")

#: Libraries that log routine steps at INFO (pika: every connection's open
#: and close, the demo's client; alembic: each plugin and revision at
#: ``init``, which prints its own summary; py4j: every Spark gateway
#: connection of ``reconcile``): noise around the command's own
#: lines; their warnings still show, and ``-v`` shows everything.
_CHATTY = ("pika", "alembic", "py4j")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _cmd_init(cfg: SiteConfig, args: argparse.Namespace) -> int:
    from sql import migrate  # alembic is slow to import; only init needs it

    try:
        before, after = migrate(cfg.store_dsn)
    except Exception as e:
        if isinstance(e, PluginError):
            raise
        # translate at this boundary: SQLAlchemy wraps psycopg's errors
        with connect(cfg.store_dsn):
            pass  # raises StoreUnavailable with a clear reason if unreachable
        raise PluginError(f"schema migration failed: {e}") from e
    if before == after:
        print(f"schema is current (revision {after})")
    else:
        print(f"schema upgraded from {before or 'empty'} to revision {after}")
    return EXIT_OK


def _cmd_node(cfg: SiteConfig, args: argparse.Namespace) -> int:
    import uvloop  # the relay's round trips are about half as long on uvloop

    from plugin.node import run_node  # imports the bridge; only the node needs it

    # TLS servers take their sockets before any transport reads from them
    # (bridge.link._acceptor), so TLS works on uvloop as on asyncio's loop
    uvloop.run(run_node(cfg))
    return EXIT_OK


def _cmd_demo(cfg: SiteConfig | None, args: argparse.Namespace) -> int:
    from plugin.devtools import run_demo

    return run_demo()


def _cmd_sandbox(cfg: SiteConfig | None, args: argparse.Namespace) -> int:
    from pathlib import Path

    from plugin.devtools import start_sandbox, stop_sandbox

    where = Path(args.dir)
    if args.action == "start":
        for line in start_sandbox(where):
            print(line)
    else:
        killed = stop_sandbox(where)
        print(f"sandbox in {where.resolve()} stopped ({killed} servers) and removed")
    return EXIT_OK


def _cmd_tls_init(cfg: SiteConfig | None, args: argparse.Namespace) -> int:
    from pathlib import Path

    from plugin.tls import init_certificates

    where = Path(args.dir).resolve()
    sites = [s.strip() for s in args.sites.split(",")]
    for files in init_certificates(where, sites, days=args.days, renew=args.renew):
        made = ("renewed" if args.renew else "made") if files.created else "already there, kept"
        print(f"# site {files.site}: {files.cert.name} and {files.key.name} {made}")
        print(files.tls_lines())
    print(f"# keep {where / 'ca.key'} off the sites: it signs new site certificates")
    return EXIT_OK


def _enable_settings(args: argparse.Namespace, now: VpnSettings) -> VpnSettings:
    """The options given, over ``now`` where one was left out."""
    return VpnSettings.from_args(
        name=args.vpn,
        role=args.role,
        mode=args.mode or now.mode,
        sync_timeout_ms=now.sync_timeout_ms
        if args.sync_timeout_ms is None
        else args.sync_timeout_ms,
        on_sync_timeout=args.on_sync_timeout or now.on_sync_timeout,
        # given, a list replaces the stored one; an empty pattern clears it
        queues=tuple(now.queue_patterns if args.queues is None else filter(None, args.queues)),
        topics=tuple(
            map(str, now.topic_filters) if args.topics is None else filter(None, args.topics)
        ),
        expose_id=now.expose_id if args.expose_id is None else args.expose_id,
    )


def _cmd_vpn_enable(cfg: SiteConfig, args: argparse.Namespace) -> int:
    # checked before the database is asked; over the defaults a new VPN takes
    settings = _enable_settings(args, VpnSettings.from_args(args.vpn, args.role))
    with connect(cfg.store_dsn) as conn:
        # an option left out keeps the VPN's stored value
        stored = read_vpn_settings(args.vpn).run(conn)
        if stored is not None:
            settings = _enable_settings(args, stored)
        created = enable_vpn(conn, settings, cfg.site_name)
    verb = "enabled" if created else "updated"
    print(f"VPN {settings.name!r} {verb}: role {settings.role}, mode {settings.mode}")
    _print_scope(cfg, settings)
    return EXIT_OK


def _print_scope(cfg: SiteConfig, settings: VpnSettings) -> None:
    """Which of the VPN's queues at the broker now the scope takes; a pattern
    that matches none of them is warned about. The VPN stays enabled when
    the broker cannot be asked: the report is advice."""
    from urllib.parse import quote

    from plugin.topology import ReplicationScope, scope_report

    scope = ReplicationScope.of(settings)
    if scope.everything:
        print("  scope: every queue of the VPN")
        return
    api = ManagementAPI(cfg.management_url, timeout=5)
    try:
        listed = api.get(f"queues/{quote(settings.name, safe='')}?columns=name")
    except ManagementUnavailable as e:
        if e.not_found:
            print(
                f"  the broker has no vhost {settings.name!r} yet: no queue to check the scope on"
            )
        else:
            print(f"  cannot list the VPN's queues to check the scope: {e}")
        return
    rows = listed if isinstance(listed, list) else []
    names = [str(q["name"]) for q in rows if isinstance(q, dict) and "name" in q]
    for line in scope_report(scope, names).lines():
        print(line)


def _cmd_vpn_disable(cfg: SiteConfig, args: argparse.Namespace) -> int:
    with connect(cfg.store_dsn) as conn:
        disable_vpn(conn, args.vpn)
    print(f"VPN {args.vpn!r} disabled")
    return EXIT_OK


def _cmd_audit(cfg: SiteConfig, args: argparse.Namespace) -> int:
    from plugin.ops import audit_rows, render_audit

    if args.limit < 1:
        raise UsageError(f"--limit {args.limit}: expected a number >= 1")
    with connect(cfg.store_dsn) as conn:
        rows = audit_rows(conn, args.limit, args.vpn)
    print(json.dumps(rows) if args.json else render_audit(rows), end="\n" if args.json else "")
    return EXIT_OK


def _cmd_status(cfg: SiteConfig, args: argparse.Namespace) -> int:
    import time

    from ._status_table import render

    api = ManagementAPI(cfg.management_url, timeout=5)

    def once() -> None:
        with connect(cfg.store_dsn) as conn:
            doc = status(conn, cfg.site_name, bridge_authenticated=cfg.bridge_authenticated)
        add_broker_depths(doc, api)
        if args.json:
            print(json.dumps(doc), flush=True)
        else:
            print(render(doc), end="", flush=True)

    if args.watch is None:
        once()
        return EXIT_OK
    clear = not args.json and sys.stdout.isatty()
    first = True
    try:
        while True:
            if clear:
                print("\x1b[H\x1b[2J", end="")
            if not args.json:
                print(f"{time.strftime('%H:%M:%S')}, every {args.watch:g} s (Ctrl-C stops)")
            try:
                once()
            except PluginError as e:
                if first:
                    raise
                print(f"vpnrepl: status unavailable: {e}", file=sys.stderr, flush=True)
            first = False
            if not clear and not args.json:
                print()
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return EXIT_OK


def _cmd_reconcile(cfg: SiteConfig, args: argparse.Namespace) -> int:
    from datetime import UTC, datetime

    from plugin.reconcile import (
        Reconciler,
        render,
        repair_through_node,
        store_failed_run,
        store_run,
    )

    rc = cfg.reconcile
    method = args.method or rc.method
    started = datetime.now(UTC)
    job = Reconciler(
        cfg,
        args.vpn,
        method=method,
        master=args.master or rc.master,
        segments=args.segments or rc.segments,
        progress=sys.stderr.isatty() and not args.json,
    )
    try:
        result = job.run(
            repair_through_node(cfg.store_dsn) if args.repair else None,
            repair_through_node(cfg.store_dsn, "retire-uncertain") if args.repair else None,
        )
    except PluginError as e:
        store_failed_run(cfg.store_dsn, args.vpn, method, started, str(e))
        raise
    store_run(cfg.store_dsn, result)
    doc = result.as_dict()
    if args.json:
        print(json.dumps(doc))
    else:
        print(render(doc, repaired=args.repair), end="")
    return EXIT_OK if result.agree else EXIT_DIFFER


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


class _ProgressBar:
    """A progress bar on stderr when it is a terminal (tqdm), else nothing:
    a log file or a pipe gets the summary line only."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._bar: Any = None
        self._shown = sys.stderr.isatty()

    def update(self, done: int, total: int) -> None:
        if not self._shown:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=self._what, unit="msg", file=sys.stderr)
        self._bar.total = total
        self._bar.n = done
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _cmd_promote(cfg: SiteConfig, args: argparse.Namespace) -> int:
    import asyncio

    from plugin.listener import site_broker_ssl
    from plugin.ops import Progress, PromotionSummary, promote, run_command

    async def here(progress: Progress) -> dict[str, Any]:
        summary = await promote(cfg, args.vpn, progress, site_broker_ssl(cfg))
        return summary.as_dict()

    bar = _ProgressBar(f"promoting {args.vpn}")
    try:
        request = {"force": True} if args.force else {}
        result = asyncio.run(
            run_command(cfg.store_dsn, "promote", args.vpn, request, here, bar.update)
        )
    finally:
        bar.close()
    print(PromotionSummary.from_dict(result).line())
    return EXIT_OK


def _cmd_demote(cfg: SiteConfig, args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from plugin.ops import DemotionSummary, Progress, demote, export_tail, run_command

    tail, path = export_tail(cfg, args.vpn, Path(args.export) if args.export else None)
    print(
        f"unreplicated tail of VPN {args.vpn!r}: {len(tail.messages)} messages this site "
        f"confirmed after index {tail.taken_over_at}, where epoch {tail.epoch} took over, "
        f"exported to {path}; `vpnrepl --config ACTIVE.toml republish {path}` publishes them "
        "on the active site"
    )
    if tail.other_events:
        print(
            f"  {tail.other_events} acknowledgements (or purges) made here after that index "
            "were not replicated: those messages are still on the active site"
        )
    if tail.topology_changes:
        print(
            f"  {tail.topology_changes} topology changes (declares, binds, deletes) made through "
            "this site's listener after that index are not on the active site: make them "
            "there before you republish the tail"
        )

    async def here(progress: Progress) -> dict[str, Any]:
        return (await demote(cfg, args.vpn)).as_dict()

    result = asyncio.run(run_command(cfg.store_dsn, "demote", args.vpn, {}, here, _quiet))
    print(DemotionSummary.from_dict(result).line())
    return EXIT_OK


def _cmd_republish(cfg: SiteConfig, args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from plugin.ops import read_tail_file, republish

    records = read_tail_file(Path(args.file))
    print(asyncio.run(republish(cfg, records)).line())
    return EXIT_OK


def _cmd_xa(cfg: SiteConfig, args: argparse.Namespace) -> int:
    import asyncio
    import json

    from plugin.ops import Progress, list_branches, run_command

    if args.xa_command == "list":
        branches = list_branches(cfg.store_dsn, args.vpn)
        if args.json:
            print(json.dumps({"vpn": args.vpn, "branches": branches}))
            return EXIT_OK
        if not branches:
            print(f"VPN {args.vpn!r}: no XA branch is prepared or heuristic on this site")
        for b in branches:
            how = f" heuristic {b['heuristic']}" if b["heuristic"] else ""
            hazard = f": {b['hazard']}" if b["hazard"] else ""
            print(f"{b['xid']}  {b['state']}{how}  since {b['prepared_at']}{hazard}")
        return EXIT_OK
    from txn.xa import Xid, XidError

    try:
        xid = str(Xid.from_string(args.xid))
    except XidError as e:
        raise UsageError(str(e)) from e

    async def here(progress: Progress) -> dict[str, Any]:
        raise PluginError(
            "an XA branch is resolved through the broker: the active site's node must be running"
        )

    request = {"xid": xid, "commit": args.xa_command == "commit"}
    result = asyncio.run(
        run_command(cfg.store_dsn, "xa-decide", args.vpn, request, here, lambda done, total: None)
    )
    verb = "committed" if request["commit"] else "rolled back"
    print(f"XA branch {result['xid']} of VPN {args.vpn!r} {verb} (recorded as heuristic)")
    if result["code"] == "XA_HEURHAZ":
        print(f"  hazard: {result['text']}")
    return EXIT_OK


def _cmd_switchover(cfg: SiteConfig, args: argparse.Namespace) -> int:
    import asyncio

    from plugin.ops import switchover

    bar = _ProgressBar(f"switching {args.vpn} over")
    try:
        lines = asyncio.run(switchover(cfg, args.vpn, bar.update))
    finally:
        bar.close()
    for line in lines:
        print(line)
    return EXIT_OK


def _quiet(done: int, total: int) -> None:
    """No progress to show."""


def _build_parser() -> _Parser:
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
    c.set_defaults(run=_cmd_init)
    c = sub.add_parser("node", help="run the site process")
    c.set_defaults(run=_cmd_node)

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
    e.set_defaults(run=_cmd_vpn_enable)
    d = vsub.add_parser("disable", help="stop replicating VPN")
    d.add_argument("vpn", metavar="VPN")
    d.set_defaults(run=_cmd_vpn_disable)

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
    s.set_defaults(run=_cmd_status)
    c = sub.add_parser("promote", help="standby -> active (after a disaster, or a switchover)")
    c.add_argument("vpn", metavar="VPN")
    c.add_argument(
        "--force",
        action="store_true",
        help="even while the old active still serves the VPN to this site (split brain)",
    )
    c.set_defaults(run=_cmd_promote)
    c = sub.add_parser("demote", help="fenced former active -> standby (exports its tail)")
    c.add_argument("vpn", metavar="VPN")
    c.add_argument("--export", metavar="FILE", help="where to write the unreplicated tail")
    c.set_defaults(run=_cmd_demote)
    c = sub.add_parser("switchover", help="on the standby: swap roles with the live active")
    c.add_argument("vpn", metavar="VPN")
    c.set_defaults(run=_cmd_switchover)
    c = sub.add_parser("republish", help="publish a demoted site's exported tail here")
    c.add_argument("file", metavar="FILE")
    c.set_defaults(run=_cmd_republish)
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
    c.set_defaults(run=_cmd_reconcile)
    xa = sub.add_parser("xa", help="list, commit or roll back client XA branches of a VPN")
    xsub = xa.add_subparsers(dest="xa_command", metavar="ACTION", parser_class=_Parser)
    xsub.required = True
    c = xsub.add_parser("list", help="the VPN's prepared and heuristic branches on this site")
    c.add_argument("vpn", metavar="VPN")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(run=_cmd_xa, xid=None)
    for action, what in (("commit", "commit"), ("rollback", "roll back")):
        c = xsub.add_parser(
            action, help=f"{what} a prepared branch whose transaction manager is gone"
        )
        c.add_argument("vpn", metavar="VPN")
        c.add_argument("xid", metavar="XID", help="format_id:gtrid-hex:bqual-hex")
        c.set_defaults(run=_cmd_xa, json=False)
    c = sub.add_parser("demo", help="two local sites, a workload, a promotion")
    c.set_defaults(run=_cmd_demo, needs_config=False)
    c = sub.add_parser(
        "sandbox", help="start (stop) two sites' RabbitMQ and PostgreSQL here, to try things"
    )
    c.add_argument("action", choices=("start", "stop"))
    c.add_argument("dir", metavar="DIR", help="where the servers, configs and addresses go")
    c.set_defaults(run=_cmd_sandbox, needs_config=False)
    c = sub.add_parser("audit", help="operator actions on this site, newest first, and who asked")
    c.add_argument("--vpn", help="only this VPN's")
    c.add_argument("--limit", type=int, default=50, help="how many (50)")
    c.add_argument("--json", action="store_true", help="one JSON array")
    c.set_defaults(run=_cmd_audit)
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
    c.set_defaults(run=_cmd_tls_init, needs_config=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        args = _build_parser().parse_args(argv)
        if args.verbose:
            logging.getLogger().setLevel(logging.DEBUG)
        else:
            for name in _CHATTY:
                logging.getLogger(name).setLevel(logging.WARNING)
            # pika logs a failed connect as an ERROR with a traceback; every
            # such failure reaches our code, which says what it means
            logging.getLogger("pika").setLevel(logging.CRITICAL)
        run: Callable[[Any, argparse.Namespace], int] = args.run
        cfg = None
        if getattr(args, "needs_config", True):
            if not args.config:
                raise UsageError("vpnrepl: --config SITE.TOML is required for this command")
            cfg = load_config(args.config, tuple(args.overrides))
        return run(cfg, args)
    except (UsageError, InvalidSettings) as e:
        print(f"vpnrepl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (PluginError, BridgeError) as e:
        print(f"vpnrepl: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_FAILURE
