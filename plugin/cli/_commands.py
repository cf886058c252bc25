"""What each ``vpnrepl`` command does, once its arguments are parsed
(:mod:`plugin.cli._parser` names them): a ``cmd_*`` function per command,
taking the site's config and the arguments, returning the exit status.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

from bridge import VpnSettings
from bridge.broker import ManagementAPI, ManagementUnavailable
from bridge.store import read_vpn_settings
from plugin._errors import PluginError, UsageError
from plugin.config import SiteConfig
from plugin.ops import add_broker_depths, connect, disable_vpn, enable_vpn, status

__all__ = [
    "EXIT_DIFFER",
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "cmd_audit",
    "cmd_demo",
    "cmd_demote",
    "cmd_init",
    "cmd_node",
    "cmd_nodes",
    "cmd_promote",
    "cmd_reconcile",
    "cmd_republish",
    "cmd_sandbox",
    "cmd_status",
    "cmd_switchover",
    "cmd_tls_init",
    "cmd_vpn_disable",
    "cmd_vpn_enable",
    "cmd_xa",
]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_DIFFER = 0, 1, 2, 3


def cmd_init(cfg: SiteConfig, args: argparse.Namespace) -> int:
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


def cmd_node(cfg: SiteConfig, args: argparse.Namespace) -> int:
    if cfg.nodes and not cfg.node_name:
        names = ", ".join(n.name for n in cfg.nodes)
        raise UsageError(
            f"{cfg.path}: the site has several nodes ({names}): start one with --name NODE"
        )
    import uvloop  # the relay's round trips are about half as long on uvloop

    from plugin.node import run_node  # imports the bridge; only the node needs it

    # TLS servers take their sockets before any transport reads from them
    # (bridge.link._acceptor), so TLS works on uvloop as on asyncio's loop
    uvloop.run(run_node(cfg))
    return EXIT_OK


def cmd_demo(cfg: SiteConfig | None, args: argparse.Namespace) -> int:
    from plugin.devtools import run_demo

    return run_demo()


def cmd_sandbox(cfg: SiteConfig | None, args: argparse.Namespace) -> int:
    from pathlib import Path

    from plugin.devtools import start_sandbox, stop_sandbox

    where = Path(args.dir)
    if args.action == "start":
        for line in start_sandbox(where, args.brokers):
            print(line)
    else:
        killed = stop_sandbox(where)
        print(f"sandbox in {where.resolve()} stopped ({killed} servers) and removed")
    return EXIT_OK


def cmd_tls_init(cfg: SiteConfig | None, args: argparse.Namespace) -> int:
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


def cmd_vpn_enable(cfg: SiteConfig, args: argparse.Namespace) -> int:
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
    api = ManagementAPI(cfg.management_urls, timeout=5)
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


def cmd_vpn_disable(cfg: SiteConfig, args: argparse.Namespace) -> int:
    with connect(cfg.store_dsn) as conn:
        disable_vpn(conn, args.vpn)
    print(f"VPN {args.vpn!r} disabled")
    return EXIT_OK


def cmd_audit(cfg: SiteConfig, args: argparse.Namespace) -> int:
    from plugin.ops import audit_rows, render_audit

    if args.limit < 1:
        raise UsageError(f"--limit {args.limit}: expected a number >= 1")
    with connect(cfg.store_dsn) as conn:
        rows = audit_rows(conn, args.limit, args.vpn)
    print(json.dumps(rows) if args.json else render_audit(rows), end="\n" if args.json else "")
    return EXIT_OK


def cmd_nodes(cfg: SiteConfig, args: argparse.Namespace) -> int:
    from plugin.ops import nodes_doc, render_nodes

    with connect(cfg.store_dsn) as conn:
        doc = nodes_doc(conn, cfg)
    print(json.dumps(doc) if args.json else render_nodes(doc), end="\n" if args.json else "")
    return EXIT_OK


def cmd_status(cfg: SiteConfig, args: argparse.Namespace) -> int:
    from ._status_table import render

    api = ManagementAPI(cfg.management_urls, timeout=5)

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
    with _Interrupted() as interrupted:
        while not interrupted.seen:
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
            interrupted.sleep(args.watch)
    return EXIT_OK


class _Interrupted:
    """Ctrl-C (or SIGTERM) as a flag a loop checks, not an exception: a
    KeyboardInterrupt raised inside a library's C code (libpq's wait) can
    be lost there, and a watch that missed its Ctrl-C ran on. The first
    signal ends the loop at its next check; a second one interrupts at once,
    as Python's own handler would."""

    def __init__(self) -> None:
        self.seen = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Interrupted:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.seen:
            raise KeyboardInterrupt
        self.seen = True

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or less once the signal came."""
        deadline = time.monotonic() + seconds
        while not self.seen and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))


def cmd_reconcile(cfg: SiteConfig, args: argparse.Namespace) -> int:
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


def cmd_promote(cfg: SiteConfig, args: argparse.Namespace) -> int:
    import asyncio

    from plugin.ops import Progress, PromotionSummary, promote, run_command
    from plugin.tls import site_broker_ssl

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


def cmd_demote(cfg: SiteConfig, args: argparse.Namespace) -> int:
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


def cmd_republish(cfg: SiteConfig, args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from plugin.ops import read_tail_file, republish

    records = read_tail_file(Path(args.file))
    print(asyncio.run(republish(cfg, records)).line())
    return EXIT_OK


def cmd_xa(cfg: SiteConfig, args: argparse.Namespace) -> int:
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


def cmd_switchover(cfg: SiteConfig, args: argparse.Namespace) -> int:
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
