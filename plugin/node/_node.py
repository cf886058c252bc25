"""``vpnrepl node``: the site process.

Starts, in order: the site database check and a new process incarnation (the
high bits of every replication id it hands out), the ledger writer, the
sync-ineligible windows' recorder (which first closes those a crash left
open), the replication sink with the transaction coordinator, the VPN directory
(settings from the database, topology from the management API, refreshed
every ``[broker] topology_refresh_seconds``), the recovery of transactions a
crash left in doubt (txn/local/_coordinator.py; before any client is accepted), the AMQP
listener on ``listen.amqp`` (and ``listen.amqps`` over TLS) and the admin endpoint
on ``listen.admin``. It
stops on SIGTERM or SIGINT in reverse order: clients first, then the ledger
after committing what it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import psycopg
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_random_exponential,
)

from bridge import (
    INCARNATION_LIMIT,
    BridgeError,
    IdSource,
    Purged,
    Role,
    TopologyChanged,
    UnknownFailpoint,
    VpnSettings,
    armed,
    name_item,
    redact_url,
)
from bridge.active import ActiveBridge, Replicator, WindowRecorder
from bridge.broker import ManagementAPI
from bridge.ledger import LedgerBound, LedgerError, LedgerWriter
from bridge.link import TlsSetupError, make_client_context, make_server_context
from bridge.roles import TakeoverUnknown
from bridge.standby import StandbyBridge
from bridge.store import enabled_vpns, ledger_progress, record_sync_eligible
from plugin._config import SiteConfig, load_config
from plugin._errors import ConfigError, PluginError, StateError, StoreUnavailable, UsageError
from plugin.admin import SAMPLE_SECONDS, AdminCredentials, AdminServer, LagHistory, Metrics
from plugin.listener import BrokerAddress, DirectoryRefresher, Listener, XaGateway, site_broker_ssl
from plugin.ops import (
    DemotionSummary,
    Progress,
    RequestServer,
    add_broker_depths,
    connect,
    decide_branch,
    demote,
    export_tail,
    promote,
    read_request,
    start_request,
    status,
    switchover,
)
from plugin.topology import VpnDirectory, VpnView
from txn.branches import XaCoordinator
from txn.local import Coordinator, MarkerError, MarkerStore, Participant, TxnLog, load_marker_key

from ._tracing import Tracing
from ._uncertain import UncertainLog, retire
from ._xa_publish import BranchPublisher, ReplyPublisher

__all__ = ["run_node"]

log = logging.getLogger("vpnrepl.node")

#: how long start-up waits for the broker to answer for commit markers
RECOVERY_SECONDS = 60.0
ELIGIBILITY_SECONDS = 0.5

#: how long a switchover waits for the standby to acknowledge everything
SWITCHOVER_DRAIN = 60.0
#: how long a starting node waits for its peer's listing (the epochs the
#: peer holds) before it admits clients of its active VPNs
PEER_EPOCH_WAIT = 5.0


#: how long a repair request may wait for the live stream to leave room
REPAIR_SECONDS = 120.0


def fenced_text(vpn: str, epoch: int, site: str) -> str:
    """What a fenced former active tells the VPN's clients (320 and 530)."""
    where = f"site {site!r}" if site else "the other site"
    return f"vhost '{vpn}' is now active on {where} (epoch {epoch}); connect to that site"


def _warn_plaintext(cfg: SiteConfig) -> None:
    if cfg.bridge_moving:
        log.warning(
            "the bridge takes and dials plain TCP beside mutual TLS ([tls] and "
            "[insecure] plaintext_bridge = true: the pair is moving to TLS); remove "
            "plaintext_bridge once both sites have [tls]"
        )
    elif cfg.plaintext_bridge:
        log.warning(
            "the bridge is plain TCP ([insecure] plaintext_bridge = true): peers are not "
            "authenticated and replicated messages cross the network readable; set "
            "[tls] cert, key and ca (`vpnrepl tls init`) to end this"
        )


async def _incarnation(cfg: SiteConfig) -> int:
    try:
        async with await psycopg.AsyncConnection.connect(
            cfg.store_dsn, autocommit=True, connect_timeout=10
        ) as conn:
            cur = await conn.execute(
                "INSERT INTO node_incarnation (site) VALUES (%s) RETURNING incarnation",
                (cfg.site_name,),
            )
            row = await cur.fetchone()
            assert row is not None  # noqa: S101 - RETURNING always yields the row
            incarnation = int(row[0])
    except psycopg.errors.UndefinedTable as e:
        raise StateError("the site database has no schema: run `vpnrepl init` first") from e
    except psycopg.OperationalError as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise StoreUnavailable(f"cannot connect to {redact_url(cfg.store_dsn)}: {reason}") from e
    if incarnation >= INCARNATION_LIMIT:
        raise StateError(
            f"this site has recorded {incarnation - 1} node incarnations; replication ids "
            f"have room for {INCARNATION_LIMIT - 1} (table node_incarnation)"
        )
    return incarnation


def _amqps_note(cfg: SiteConfig) -> str:
    if cfg.listen_amqps is None or cfg.client_tls is None:
        return ""
    certs = "client certificates required" if cfg.client_tls.ca else "no client certificates"
    return f", AMQPS on {cfg.listen_amqps} ({certs})"


class Node:
    """The running site process."""

    def __init__(self, cfg: SiteConfig) -> None:
        self.cfg = cfg
        #: the config file a scheduled ``reconcile`` reads
        self._config_path = os.path.abspath(cfg.path)
        self.directory = VpnDirectory()
        self.api = ManagementAPI(cfg.management_url)
        self.metrics = Metrics()
        self.tracing = Tracing(cfg)
        self.writer = LedgerWriter(cfg.store_dsn)
        #: records the sync-ineligible windows (``sync_window``)
        self.windows = WindowRecorder(cfg.store_dsn)
        self.replicator = Replicator(self.writer, self.windows)
        self.txn_log = TxnLog(cfg.store_dsn)
        self.broker_ssl = site_broker_ssl(cfg)
        self.coordinator = Coordinator(
            self.txn_log, MarkerStore(cfg.amqp_url, self.broker_ssl), self.writer, self.replicator
        )
        self.replicator.coordinator = self.coordinator
        self.participant = Participant(self.txn_log)
        self.xa = XaCoordinator(
            self.coordinator,
            BranchPublisher(cfg.amqp_url, cfg.store_dsn, self.coordinator.markers, self.broker_ssl),
        )
        self.xa_replies = ReplyPublisher(cfg.amqp_url, self.broker_ssl)
        self.uncertain = UncertainLog(cfg.store_dsn)
        self.ledger_bound = LedgerBound(
            cfg.store_dsn, cfg.ledger_max_bytes, cfg.ledger_check_seconds
        )
        self.listener: Listener | None = None
        self.ids: IdSource | None = None
        self.admin: AdminServer | None = None
        self.lag_history = LagHistory()
        self.bridge_server: ActiveBridge | None = None
        self.bridge_client: StandbyBridge | None = None
        self._bridge_up = False
        self._tasks: list[asyncio.Task[None]] = []
        self.requests = RequestServer(
            cfg.store_dsn,
            {
                "promote": self._promote,
                "demote": self._demote,
                "switchover-prepare": self._switchover_prepare,
                "switchover-finish": self._switchover_finish,
                "switchover-abort": self._switchover_abort,
                "switchover": self._switchover,
                "repair": self._repair,
                "xa-decide": lambda vpn, args, _progress: decide_branch(self.xa, vpn, args),
                "retire-uncertain": self._retire_uncertain,
            },
        )
        self.refresher: DirectoryRefresher | None = None
        self._refreshing: asyncio.Task[None] | None = None
        #: VPN -> why its clients are refused although it is active here
        self.refusals: dict[str, str] = {}
        #: VPN -> the refusal of a switchover under way (kept across refreshes)
        self.switching: dict[str, str] = {}

    async def _load_settings(self) -> list[VpnSettings]:
        settings = await self._read_settings()
        if self._bridge_up and self.bridge_server is not None:
            await self.bridge_server.relist()  # standbys learn of changes at once
        return settings

    async def _read_settings(self) -> list[VpnSettings]:
        async with await psycopg.AsyncConnection.connect(
            self.cfg.store_dsn, autocommit=True, connect_timeout=10
        ) as conn:
            rows = await enabled_vpns().run_async(conn)
        out = []
        for r in rows:
            s = r.settings
            self.refusals.pop(s.name, None)
            if s.role is Role.ACTIVE and r.promotion in ("running", "failed"):
                self.refusals[s.name] = (
                    f"vhost '{s.name}' is being promoted to active on this site; "
                    "connect again when the promotion has finished"
                )
            elif s.role is Role.ACTIVE:
                if r.fenced:
                    self.replicator.fenced.add(s.name)
                    self.refusals[s.name] = fenced_text(
                        s.name, r.newest_epoch or 0, r.newest_site or ""
                    )
                await self.writer.open_vpn(s.name)
                self.replicator.configure(s, r.applied_index)
            if s.name in self.switching:
                self.refusals[s.name] = self.switching[s.name]
            out.append(s)
        return out

    def _adopted(self, vpn: str) -> None:
        """The peer's listing made ``vpn`` a standby VPN here: the listener
        refuses its clients from now on, not from the next periodic refresh
        (until then they would reach the broker unreplicated)."""
        if self.refresher is None:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self.refresher.refresh(), name="refresh")

    def _serves(self, vpn: str) -> bool:
        """``vpn`` is active here, admits clients and confirms publishes."""
        view = self.directory.lookup(vpn)
        return (
            view is not None
            and view.role is Role.ACTIVE
            and view.refusal is None
            and vpn not in self.replicator.fenced
        )

    def _fenced_by_peer(self, vpn: str, epoch: int, site: str) -> None:
        """The peer holds ``vpn`` active at a higher epoch: stop confirming,
        close the VPN's clients (320) and refuse new ones (530)."""
        text = fenced_text(vpn, epoch, site)
        log.error("VPN %s is fenced: %s", vpn, text)
        self.replicator.fenced.add(vpn)
        self._refuse(vpn, text)
        if self.listener is not None:
            self.listener.close_vpn(vpn, text)

    async def _promote(
        self, vpn: str, args: Mapping[str, Any], progress: Progress
    ) -> dict[str, Any]:
        """The ``promote`` operator request, on the running node: refused
        while the peer still serves the VPN as active (split brain), unless
        ``force`` or it is a switchover's own promotion."""
        if not (args.get("force") or args.get("switchover")):
            await self._peer_not_serving(vpn)
        summary = await promote(self.cfg, vpn, progress, self.broker_ssl)
        # the promoted VPN's ids must not repeat any the old active made
        await self._take_incarnation()
        if self.refresher is not None:
            await self.refresher.refresh()  # opens its ledger; the listener admits clients
        return summary.as_dict()

    async def _peer_not_serving(self, vpn: str) -> None:
        """Raise when the peer still serves ``vpn`` as active to this site.
        A link that is up is given the heartbeat timeout to prove it is
        alive (an active killed a moment ago leaves a link that has not
        noticed yet)."""
        client = self.bridge_client
        if client is None or not client.follows(vpn):
            log.warning(
                "VPN %s: promoting while the old active is not connected to this site: it "
                "cannot be fenced until it reconnects (keep its node down meanwhile)",
                vpn,
            )
            return
        for _ in range(int(client.heartbeat_timeout / 0.1)):  # (the link says so itself)
            if not client.follows(vpn):
                break
            await asyncio.sleep(0.1)
        if client.follows(vpn):
            raise StateError(
                f"site {client.peer_site!r} still serves VPN {vpn!r} as active (this site "
                "follows it over the bridge): promoting it here would leave two active sites. "
                f"Run `vpnrepl switchover {vpn}` to move it with nothing lost, or "
                f"`vpnrepl promote {vpn} --force` if you mean it"
            )

    async def _repair(
        self, vpn: str, args: Mapping[str, Any], progress: Progress
    ) -> dict[str, Any]:
        """The ``repair`` request of ``vpnrepl reconcile --repair``: the keys
        go to the standby as Repair frames, below the live stream."""
        if self.bridge_server is None:
            raise StateError("the node is not serving its bridge yet")
        try:
            keys = [(str(q), bytes.fromhex(str(r))) for q, r in args["keys"]]
        except (KeyError, TypeError, ValueError) as e:
            raise UsageError(f"a repair request needs keys as [queue, hex id] pairs: {e}") from e
        try:
            async with asyncio.timeout(REPAIR_SECONDS):
                sent = await self.bridge_server.repair(vpn, keys)
        except TimeoutError:
            raise StateError(
                f"VPN {vpn!r}: the repair was not sent in {REPAIR_SECONDS:g} s "
                "(the live stream kept the bridge busy): run reconcile again"
            ) from None
        except BridgeError as e:
            raise StateError(f"VPN {vpn!r}: repair not sent: {e}") from e
        return {"sent": sent.sent, "skipped": sent.skipped}

    async def _retire_uncertain(
        self, vpn: str, args: Mapping[str, Any], progress: Progress
    ) -> dict[str, Any]:
        """``reconcile --repair``: uncertain publishes the broker does not hold
        are consumed through the ledger (``plugin.node._uncertain``)."""
        try:
            keys = [(str(q), bytes.fromhex(str(r))) for q, r in args["keys"]]
        except (KeyError, TypeError, ValueError) as e:
            raise UsageError(f"a retire request needs keys as [queue, hex id] pairs: {e}") from e
        return {"retired": await retire(self.writer, self.cfg.store_dsn, vpn, keys)}

    async def status(self, broker: bool = True) -> dict[str, Any]:
        """The ``status --json`` document; ``broker=False``: without the
        queue counts, live or at the broker (``/metrics`` and the lag history
        read it every few seconds)."""

        def read() -> dict[str, Any]:
            with connect(self.cfg.store_dsn) as conn:
                return status(
                    conn,
                    self.cfg.site_name,
                    queues=broker,
                    bridge_authenticated=self.cfg.bridge_authenticated,
                )

        doc = await asyncio.to_thread(read)
        if broker:
            await asyncio.to_thread(add_broker_depths, doc, self.api)
        for vpn in doc["vpns"]:
            if vpn["role"] == "active":
                vpn["sync_eligible"] = self.replicator.sync_eligible(vpn["name"])
                vpn["fenced"] = vpn["fenced"] or vpn["name"] in self.replicator.fenced
        return doc

    async def metrics_text(self) -> bytes:
        """The ``/metrics`` body: the counters and this site's per-VPN state;
        with ``vpnrepl_store_up 0`` and no per-VPN state when the database
        cannot be read (a scrape still answers)."""
        try:
            doc: dict[str, Any] | None = await self.status(broker=False)
        except (PluginError, OSError, psycopg.Error) as e:
            log.warning("metrics: this site's store cannot be read: %s", e)
            doc = None
        return self.metrics.render(doc)

    async def start(self) -> None:
        cfg = self.cfg
        try:
            point = armed()  # an unknown name stops the node here
        except UnknownFailpoint as e:
            raise UsageError(str(e)) from e
        if point is not None:
            log.warning("failpoint %s is armed: this node kills itself there", point)
        _warn_plaintext(cfg)
        incarnation = await _incarnation(cfg)  # checks the schema first
        # the site lock: no operator command runs without the node meanwhile
        await self.requests.start()
        try:
            await self.writer.start()
        except LedgerError as e:
            raise PluginError(str(e)) from e
        await self._start_windows()
        await self._load_marker_key()
        self.replicator.start()
        await self.txn_log.open()
        try:
            self.bridge_server = ActiveBridge(
                cfg.site_name,
                cfg.store_dsn,
                self.writer,
                self.replicator,
                peers=[p.name for p in cfg.peers],
                management_url=cfg.management_url,
                tls=cfg.tls,
                plaintext_too=cfg.plaintext_bridge,
                retain_seconds=cfg.ledger_retain_seconds,
            )
            peer = cfg.peer
            if peer is not None and peer.bridge:
                self.bridge_client = StandbyBridge(
                    cfg.site_name,
                    cfg.store_dsn,
                    peer.bridge,
                    management_url=cfg.management_url,
                    # the user this site's node logs in to its broker with
                    keep_users=(unquote(urlsplit(cfg.amqp_url).username or "guest"),),
                    tls=cfg.tls,
                    plaintext_too=cfg.plaintext_bridge,
                    peer_site=peer.name,
                    copy_tags=cfg.copy_tags,
                )
        except TlsSetupError as e:
            raise ConfigError(cfg.path, "tls", str(e)) from e
        self.bridge_server.on_fenced = self._fenced_by_peer
        self.bridge_server.txn_link.coordinator = self.coordinator
        self.coordinator.link = self.bridge_server.txn_link
        if self.bridge_client is not None:
            self.bridge_client.txn_link.participant = self.participant
            self.bridge_client.on_fenced = self._fenced_by_peer
            self.bridge_client.on_adopted = self._adopted
            self._tasks.append(asyncio.create_task(self.bridge_client.run(), name="bridge-client"))
        refresher = DirectoryRefresher(
            self.directory,
            self.api,
            self._load_settings,
            cfg.topology_refresh_seconds,
            self._queues_gone,
            self.refusals.get,
        )
        self.refresher = refresher
        await self._hear_peer_epochs()
        await refresher.refresh()
        await self._recover_transactions()
        self.coordinator.start()
        self.ledger_bound.start()
        self.ids = IdSource(incarnation, on_low=self._renew_incarnation)
        self.listener = Listener(
            BrokerAddress.from_url(cfg.amqp_url),
            self.directory,
            self.ids,
            self.replicator,
            broker_ssl=self.broker_ssl,
            max_connections=cfg.max_client_connections,
            marker_key=self.coordinator.markers.key,
        )
        self.listener.xa = XaGateway(self.xa, self.xa_replies)
        self.listener.on_uncertain = self.uncertain.record
        self.metrics.observe_listener(self.listener.stats)
        self.metrics.observe_xa(self.xa.stats)
        self.metrics.observe_ledger_bound(self.ledger_bound.unacknowledged)
        self.metrics.observe_txn(self.coordinator.stats)
        self.metrics.observe_markers(self.coordinator.markers.forged)
        self.metrics.observe_ledger(self.writer.stats)
        self.metrics.observe_sync(self.replicator.sync_counts)
        self._observe_security(cfg)
        await self.listener.start(cfg.listen_amqp.host, cfg.listen_amqp.port)
        if cfg.listen_amqps is not None and cfg.client_tls is not None:
            try:
                await self.listener.start_tls(
                    cfg.listen_amqps.host, cfg.listen_amqps.port, cfg.client_tls
                )
            except TlsSetupError as e:
                raise ConfigError(cfg.path, "client_tls", str(e)) from e
        credentials = (
            AdminCredentials(cfg.admin_user, cfg.admin_password, cfg.admin_token)
            if cfg.admin_user is not None or cfg.admin_token is not None
            else None
        )
        self.admin = AdminServer(
            self.status,
            self.metrics_text,
            self._serves,
            self.lag_history,
            credentials,
            lambda command, vpn, args: start_request(cfg.store_dsn, command, vpn, args),
            lambda request: read_request(cfg.store_dsn, request),
        )
        await self.admin.start(cfg.listen_admin.host, cfg.listen_admin.port)
        await self.bridge_server.start(cfg.listen_bridge.host, cfg.listen_bridge.port)
        self._bridge_up = True
        self._tasks.append(asyncio.create_task(refresher.run(), name="directory-refresh"))
        self._tasks.append(asyncio.create_task(self._record_eligibility(), name="eligibility"))
        self._tasks.append(asyncio.create_task(self._sample_lag(), name="lag-history"))
        if cfg.reconcile.interval_seconds is not None:
            self._tasks.append(
                asyncio.create_task(
                    self._reconcile_periodically(cfg.reconcile.interval_seconds),
                    name="reconcile-schedule",
                )
            )
        vpns = [v for n in self.directory.names() if (v := self.directory.lookup(n))]
        log.info(
            "site %s up (incarnation %d): AMQP on %s%s, bridge on %s%s, admin on %s, VPNs: %s",
            cfg.site_name,
            incarnation,
            cfg.listen_amqp,
            _amqps_note(cfg),
            cfg.listen_bridge,
            f" (standby of site {cfg.peer.name} at {cfg.peer_bridge})"
            if cfg.peer and cfg.peer_bridge
            else "",
            cfg.listen_admin,
            ", ".join(f"{v.name} ({v.role})" for v in vpns) or "none",
        )

    async def _load_marker_key(self) -> None:
        """The site's commit-marker key, before recovery reads a marker."""
        try:
            self.coordinator.markers.key = await load_marker_key(self.cfg.store_dsn)
        except psycopg.errors.UndefinedTable as e:
            raise StateError(
                "the site database's schema is older than this release (no table "
                "marker_key): run `vpnrepl init`, which upgrades it"
            ) from e
        except LookupError as e:
            raise StateError(
                "the site's commit-marker key is gone (table marker_key is empty): "
                "restore the table from a backup of this site's database"
            ) from e
        except psycopg.Error as e:
            raise StoreUnavailable(f"marker key: {e.diag.message_primary or e}") from e

    async def _start_windows(self) -> None:
        """Close the sync-ineligible windows a crash left open, at each VPN's
        ledger index (before anything is confirmed), and start recording."""
        try:
            await self.windows.start()
        except psycopg.errors.UndefinedTable as e:
            raise StateError(
                "the site database's schema is older than this release (no table "
                "sync_window): run `vpnrepl init`, which upgrades it"
            ) from e
        except psycopg.Error as e:
            raise StoreUnavailable(f"sync windows: {e.diag.message_primary or e}") from e

    async def _demote(
        self, vpn: str, args: Mapping[str, Any], progress: Progress
    ) -> dict[str, Any]:
        """The ``demote`` operator request, on the running node: the CLI has
        exported the tail; from the admin endpoint (``export``) the node
        writes it first, next to the config file, before anything is purged."""
        exported = None
        if args.get("export"):
            tail_dir = Path(self.cfg.path).parent
            _, path = await asyncio.to_thread(export_tail, self.cfg, vpn, None, tail_dir)
            exported = str(path)
        summary = await demote(self.cfg, vpn)
        self.replicator.fenced.discard(vpn)
        self.refusals.pop(vpn, None)
        self.writer.forget_vpn(vpn)
        if self.refresher is not None:
            await self.refresher.refresh()  # a standby now: clients refused as for any standby
        if self.bridge_client is not None:
            self.bridge_client.relist_now()  # and the new active's checkpoint asked for
        result = summary.as_dict()
        if exported is not None:
            result["tail"] = exported
        return result

    def _refuse(self, vpn: str, text: str | None) -> None:
        if text is None:
            self.refusals.pop(vpn, None)
        else:
            self.refusals[vpn] = text
        view = self.directory.lookup(vpn)
        if view is not None:
            view.refusal = text

    async def _switchover(
        self, vpn: str, args: Mapping[str, Any], progress: Progress
    ) -> dict[str, Any]:
        """``POST /vpns/VPN/switchover`` on the standby: this node runs the
        switchover's steps (plugin/ops/_switchover.py), promoting with its own
        handler."""

        async def promote_here(p: Progress) -> dict[str, Any]:
            return await self._promote(vpn, {"switchover": True}, p)

        lines = await switchover(self.cfg, vpn, progress, promote_here)
        return {"lines": lines, "line": "; ".join(lines)}

    async def _switchover_prepare(
        self, vpn: str, args: Mapping[str, Any], progress: Progress
    ) -> dict[str, Any]:
        """Switchover, on the active: close and refuse the VPN's clients, then
        wait until the standby acknowledged the whole ledger."""
        if not self._serves(vpn):
            raise StateError(f"VPN {vpn!r} is not served by this site's node")
        text = f"switchover to site {args.get('to', '?')!r}: connect to that site"
        self.switching[vpn] = text
        self._refuse(vpn, text)
        if self.listener is not None:
            self.listener.close_vpn(vpn, text)
        try:
            index = await self._drained(vpn)
        except StateError:
            self.switching.pop(vpn, None)
            self._refuse(vpn, None)
            raise
        log.info("VPN %s: drained to index %d for a switchover", vpn, index)
        return {"ledger_index": index}

    async def _drained(self, vpn: str) -> int:
        """The ledger index once every entry is durable and acknowledged."""
        deadline = asyncio.get_running_loop().time() + SWITCHOVER_DRAIN
        steady = 0
        while True:
            async with await psycopg.AsyncConnection.connect(
                self.cfg.store_dsn, autocommit=True, connect_timeout=10
            ) as conn:
                found = await ledger_progress(vpn).run_async(conn)
            ledger, applied = found if found is not None else (0, -1)
            steady = steady + 1 if ledger == applied and not self.writer.pending else 0
            if steady >= 2:
                return ledger
            if asyncio.get_running_loop().time() > deadline:
                raise StateError(
                    f"VPN {vpn!r}: the standby acknowledged index {applied} of {ledger} within "
                    f"{SWITCHOVER_DRAIN:.0f} s; switchover abandoned, clients admitted again"
                )
            await asyncio.sleep(0.1)

    async def _switchover_finish(
        self, vpn: str, args: Mapping[str, Any], progress: Progress
    ) -> dict[str, Any]:
        """Switchover, on the former active: once fenced by the promoted
        standby's epoch, become its standby (the tail is empty: drained)."""
        deadline = asyncio.get_running_loop().time() + SWITCHOVER_DRAIN
        while vpn not in self.replicator.fenced:
            if asyncio.get_running_loop().time() > deadline:
                raise StateError(f"VPN {vpn!r}: the promoted site's epoch did not arrive here")
            await asyncio.sleep(0.1)
        while True:  # fenced by the standby's report: where the epoch took over comes next
            try:
                tail, path = await asyncio.to_thread(export_tail, self.cfg, vpn)
                break
            except StateError as e:
                if not isinstance(e.__cause__, TakeoverUnknown):
                    raise
                if asyncio.get_running_loop().time() > deadline:
                    raise StateError(
                        f"VPN {vpn!r}: where the promoted site's epoch took over did not come"
                    ) from e
                await asyncio.sleep(0.1)
        if tail.messages:  # cannot happen after a drain; never dropped silently all the same
            log.error("VPN %s: %d messages left at switchover: %s", vpn, len(tail.messages), path)
        else:
            path.unlink()
        self.switching.pop(vpn, None)
        summary = await self._demote(vpn, args, progress)
        return {"line": DemotionSummary.from_dict(summary).line(), "tail": len(tail.messages)}

    async def _switchover_abort(
        self, vpn: str, args: Mapping[str, Any], progress: Progress
    ) -> dict[str, Any]:
        self.switching.pop(vpn, None)
        self._refuse(vpn, None)
        log.warning("VPN %s: switchover abandoned; clients admitted again", vpn)
        return {}

    async def _hear_peer_epochs(self) -> None:
        """Before admitting clients, learn which VPNs the peer holds at a
        higher epoch (a promotion there while this node was down fences them
        here). Bounded: a peer that does not answer in time cannot be asked;
        the node then starts as its database says (README: "Starting a site
        whose peer is unreachable")."""
        client = self.bridge_client
        if client is None:
            return
        try:
            await asyncio.wait_for(client.listed.wait(), PEER_EPOCH_WAIT)
        except TimeoutError:
            log.warning(
                "peer %s did not list its VPNs within %.0f s: starting without knowing whether "
                "it promoted any VPN that is active here",
                self.cfg.peer_bridge,
                PEER_EPOCH_WAIT,
            )

    def _observe_security(self, cfg: SiteConfig) -> None:
        """The metrics of what guards the site: its certificates' dates,
        and the users config-sync left alone."""
        if cfg.tls is not None:
            self.metrics.observe_certificates(cfg.tls)
        client = self.bridge_client
        if client is not None:
            self.metrics.observe_config_sync(lambda: client.users_not_ours)

    def reload_tls(self) -> None:
        """SIGHUP: the config file's ``[tls]`` and ``[insecure]`` and the
        certificate, key and CA files are read again — a rotation, or a step
        of the move to TLS (README "Moving a plaintext pair to mutual TLS")
        — without a restart: new links use them; a plain TCP link that is no
        longer allowed is dropped (the standby dials again). An unusable
        file or config is logged and the bridge stays as it was."""
        try:
            fresh = load_config(self.cfg.path, self.cfg.overrides)
            tls, plaintext = fresh.tls, fresh.plaintext_bridge
            if tls is not None:  # both contexts first: the ends switch together or not at all
                make_server_context(tls)
                make_client_context(tls)
            for end in (self.bridge_server, self.bridge_client):
                if end is not None:
                    end.reload_tls(tls, plaintext)
        except (TlsSetupError, ConfigError) as e:
            log.error("SIGHUP: the bridge stays as it was: %s", e)
            return
        self.cfg = replace(self.cfg, tls=tls, plaintext_bridge=plaintext)
        _warn_plaintext(self.cfg)
        if tls is not None:
            self.metrics.observe_certificates(tls)
        log.info(
            "SIGHUP: the bridge's TLS read again (%s; new links use it)",
            "certificate " + str(tls.cert) if tls is not None else "no [tls]",
        )

    async def _queues_gone(self, view: VpnView, queues: list[str]) -> None:
        """Queues of an active VPN that the broker lost outside the listener
        (management UI, ``rabbitmqctl``, auto-delete; the refresher checked
        each with the broker): their deletion is replicated, unless a client
        declared the queue again through the listener meanwhile."""
        for queue in queues:
            if queue in view.topology.queues:
                continue
            log.info(
                "VPN %s: queue %r was deleted outside the listener; replicating the deletion",
                view.name,
                queue,
            )
            self.replicator.append(Purged(view.name, queue, (), deleted=True), None)
            self.replicator.append(
                TopologyChanged(view.name, "queue.delete", name_item(queue)), None
            )

    def _renew_incarnation(self) -> None:
        """The id counter is running low: record a new incarnation (retried
        until the database takes it; hours of ids are left meanwhile)."""
        self._tasks.append(asyncio.create_task(self._take_incarnation(), name="incarnation"))

    async def _take_incarnation(self) -> None:
        async for attempt in AsyncRetrying(
            wait=wait_random_exponential(multiplier=1, max=60),
            retry=retry_if_exception_type(StoreUnavailable),
        ):
            with attempt:
                incarnation = await _incarnation(self.cfg)
        assert self.ids is not None  # noqa: S101 - set before the listener starts
        self.ids.renew(incarnation)
        log.info("replication ids continue with incarnation %d", incarnation)

    async def _recover_transactions(self) -> None:
        """Resolve what a crash left in doubt before any client is let in
        (txn/local/_coordinator.py); the broker must answer for its markers."""
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(MarkerError),
                wait=wait_random_exponential(multiplier=0.5, max=5),
                stop=stop_after_delay(RECOVERY_SECONDS),
                reraise=True,
            ):
                with attempt:
                    await self.coordinator.recover()
        except MarkerError as e:
            raise PluginError(f"in-doubt transactions not recovered: {e}") from e

    async def _reconcile_periodically(self, interval: int) -> None:
        """``[reconcile] interval``: about that often (±10 %, so that sites
        and VPNs do not run in step), ``vpnrepl reconcile`` of each VPN
        active here, one at a time, as a child process: the Spark job's JVM
        and memory stay out of the node, and the run records itself in
        ``reconcile_run`` like one an operator starts."""
        while True:
            await asyncio.sleep(interval * random.uniform(0.9, 1.1))  # noqa: S311 - jitter
            for name in self.directory.names():
                if self._serves(name):  # active here, admitting clients, not fenced
                    await self._reconcile_once(name)

    async def _reconcile_once(self, vpn: str) -> None:
        argv = [sys.executable, "-m", "plugin", "--config", self._config_path]
        argv += ["reconcile", vpn, "--json"] + (["--repair"] if self.cfg.reconcile.repair else [])
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

    async def _sample_lag(self) -> None:
        """Every few seconds, each VPN's lag into the status page's history."""
        while True:
            try:
                self.lag_history.add(await self.status(broker=False))
            except (PluginError, OSError, psycopg.Error) as e:
                log.debug("lag sample skipped: %s", e)
            await asyncio.sleep(SAMPLE_SECONDS)

    async def _record_eligibility(self) -> None:
        """Write sync eligibility changes to ``vpn_state``, so ``vpnrepl
        status`` (which reads the database) shows a degraded VPN too."""
        recorded: dict[str, bool] = {}
        while True:
            await asyncio.sleep(ELIGIBILITY_SECONDS)
            changed = {
                vpn: gate.eligible
                for vpn, gate in self.replicator.gates.items()
                if recorded.get(vpn, True) != gate.eligible
            }
            changed.update({vpn: True for vpn in recorded if vpn not in self.replicator.gates})
            if not changed:
                continue
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.cfg.store_dsn, autocommit=True, connect_timeout=10
                ) as conn:
                    for vpn, eligible in changed.items():
                        await record_sync_eligible(vpn, eligible).run_async(conn)
            except psycopg.Error as e:
                log.warning("sync eligibility not recorded: %s", e)
                continue
            recorded.update(changed)
            for vpn in [v for v in recorded if v not in self.replicator.gates]:
                del recorded[vpn]

    async def stop(self) -> None:
        if self.listener is not None:
            await self.listener.close()
            await self.listener.xa.close()
        await self.xa_replies.close()
        await self.uncertain.close()
        if self.bridge_client is not None:
            await self.bridge_client.close()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.bridge_server is not None:
            await self.bridge_server.close()
        if self._refreshing is not None:
            self._refreshing.cancel()
            try:
                await self._refreshing
            except asyncio.CancelledError:
                pass
            except Exception as e:  # the node is stopping: say so, stop anyway
                log.warning("the last directory refresh failed: %s", e)
        await self.requests.close()
        await self.ledger_bound.close()
        await self.coordinator.close()
        await self.replicator.close()
        await self.windows.close()
        await self.writer.close()
        await self.participant.close()
        await self.txn_log.close()
        if self.admin is not None:
            await self.admin.close()
        await self.tracing.shutdown()


async def run_node(cfg: SiteConfig, stop: asyncio.Event | None = None) -> None:
    """Run the site until ``stop`` is set or SIGTERM/SIGINT arrives."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    node = Node(cfg)
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGHUP, node.reload_tls)
    try:
        await node.start()
        await stop.wait()
        log.info("site %s stopping", cfg.site_name)
    except OSError as e:
        raise PluginError(str(e)) from e
    except BridgeError as e:
        raise PluginError(str(e)) from e
    finally:
        await node.stop()
