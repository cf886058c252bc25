"""``vpnrepl node``: the site process, its parts wired together.

Starts, in order (:meth:`Node.start`): the site database check and a new
process incarnation (the high bits of every replication id it hands out),
the site lock, the ledger writer, the sync-ineligible windows' recorder
(which first closes those a crash left open), the bridge, the VPN directory
(settings from the database, topology from the management API, refreshed
every ``[broker] topology_refresh_seconds``), the recovery of transactions a
crash left in doubt (txn/local/_recovery.py; before any client is accepted),
the AMQP listener on ``listen.amqp`` (and ``listen.amqps`` over TLS) and the
admin endpoint on ``listen.admin``. It stops on SIGTERM or SIGINT in reverse
order: clients first, then the ledger after committing what it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
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
    IdSource,
    Purged,
    Role,
    TopologyChanged,
    VpnSettings,
    name_item,
)
from bridge.active import ActiveBridge, Replicator, WindowRecorder
from bridge.broker import ManagementAPI
from bridge.ledger import LedgerBound, LedgerError, LedgerWriter
from bridge.link import TlsSetupError
from bridge.standby import StandbyBridge
from bridge.store import enabled_vpns
from plugin._errors import ConfigError, PluginError, StateError, StoreUnavailable
from plugin.admin import AdminCredentials, AdminServer, LagHistory, Metrics
from plugin.config import SiteConfig
from plugin.listener import BrokerAddress, DirectoryRefresher, Listener, XaGateway
from plugin.ops import (
    NodeRequests,
    RequestServer,
    read_request,
    start_request,
)
from plugin.reconcile import ReconcileSchedule
from plugin.tls import site_broker_ssl
from plugin.topology import VpnDirectory, VpnView
from txn.branches import XaCoordinator
from txn.local import (
    Coordinator,
    MarkerError,
    MarkerStore,
    Participant,
    TransactionalSink,
    TxnLog,
    load_marker_key,
)

from ._bridge_tls import reload_bridge_tls, warn_plaintext
from ._eligibility import record_eligibility
from ._follower import leads_metric
from ._incarnation import new_incarnation, new_incarnation_retried
from ._status import metrics_body, site_status
from ._tracing import Tracing
from ._uncertain import UncertainLog
from ._xa_publish import BranchPublisher, ReplyPublisher

__all__ = ["Node", "fenced_text"]

log = logging.getLogger("vpnrepl.node")

#: how long start-up waits for the broker to answer for commit markers
RECOVERY_SECONDS = 60.0
#: the longest wait between dials of a peer site that lists several nodes:
#: after its leader died, the new one is there within its lease
PEER_NODES_BACKOFF = 2.0
#: how long a node that took the site's lease waits for the site lock before
#: it ends the session holding it
LOCK_TAKEOVER_SECONDS = 3.0
#: how long a starting node waits for its peer's listing (the epochs the
#: peer holds) before it admits clients of its active VPNs
PEER_EPOCH_WAIT = 5.0


def fenced_text(vpn: str, epoch: int, site: str) -> str:
    """What a fenced former active tells the VPN's clients (320 and 530)."""
    where = f"site {site!r}" if site else "the other site"
    return f"vhost '{vpn}' is now active on {where} (epoch {epoch}); connect to that site"


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
        self.api = ManagementAPI(cfg.management_urls)
        self.metrics = Metrics()
        self.tracing = Tracing(cfg)
        self.writer = LedgerWriter(cfg.store_dsn)
        #: records the sync-ineligible windows (``sync_window``)
        self.windows = WindowRecorder(cfg.store_dsn)
        self.replicator = Replicator(self.writer, self.windows)
        self.txn_log = TxnLog(cfg.store_dsn)
        self.broker_ssl = site_broker_ssl(cfg)
        self.coordinator = Coordinator(
            self.txn_log, MarkerStore(cfg.amqp_urls, self.broker_ssl), self.writer, self.replicator
        )
        #: what the listener hands its events and transactions to
        self.sink = TransactionalSink(self.replicator, self.coordinator)
        self.participant = Participant(self.txn_log)
        markers = self.coordinator.markers
        publisher = BranchPublisher(cfg.amqp_urls, cfg.store_dsn, markers, self.broker_ssl)
        self.xa = XaCoordinator(self.coordinator, publisher)
        self.xa_replies = ReplyPublisher(cfg.amqp_urls, self.broker_ssl)
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
        # started under the site's lease: a CLI that holds the lock while it
        # waits out a lease hands over within a second and a half of seeing
        # the lease renewed (plugin/ops/_site_lease.py); a lock held longer
        # is an earlier leader's that lost the lease (_run.py)
        self.requests = RequestServer(
            cfg.store_dsn, NodeRequests(self).handlers(), take_over_after=LOCK_TAKEOVER_SECONDS
        )
        self.refresher: DirectoryRefresher | None = None
        self._refreshing: asyncio.Task[None] | None = None
        #: VPN -> why its clients are refused although it is active here
        self.refusals: dict[str, str] = {}
        #: VPN -> the refusal of a switchover under way (kept across refreshes)
        self.switching: dict[str, str] = {}

    async def start(self) -> None:
        """Start the site's parts in order; clients are admitted only once
        what a crash left in doubt is resolved."""
        warn_plaintext(self.cfg)
        incarnation = await new_incarnation(self.cfg)  # checks the schema first
        # the site lock: no operator command runs without the node meanwhile
        await self.requests.start()
        await self._open_ledger()
        self._make_bridge()
        await self._load_directory()
        await self._recover_transactions()
        self.coordinator.start()
        self.ledger_bound.start()
        self._make_listener(incarnation)
        self._observe()
        await self._listen()
        # the bridge listens before the admin endpoint answers: /health says
        # ok only once every listener of the site is up
        await self._serve_bridge()
        await self._start_admin()
        self._start_background()
        self._log_up(incarnation)

    async def _open_ledger(self) -> None:
        """The ledger writer, the sync-ineligible windows, the marker key
        and ``txn_log``: what confirms and recovery write to."""
        try:
            await self.writer.start()
        except LedgerError as e:
            raise PluginError(str(e)) from e
        await self._start_windows()
        await self._load_marker_key()
        self.replicator.start()
        await self.txn_log.open()

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

    def _make_bridge(self) -> None:
        """The bridge's server (this site's active VPNs) and, with a peer,
        its client (the peer's), wired to the node and to transactions."""
        cfg = self.cfg
        try:
            self.bridge_server = ActiveBridge(
                cfg.site_name,
                cfg.store_dsn,
                self.writer,
                self.replicator,
                peers=[p.name for p in cfg.peers],
                management_url=cfg.management_urls,
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
                    management_url=cfg.management_urls,
                    # the user this site's node logs in to its broker with
                    keep_users=(unquote(urlsplit(cfg.amqp_url).username or "guest"),),
                    tls=cfg.tls,
                    plaintext_too=cfg.plaintext_bridge,
                    peer_site=peer.name,
                    copy_tags=cfg.copy_tags,
                    # a peer of several nodes changes leader: retry soon
                    max_backoff=PEER_NODES_BACKOFF if len(peer.bridge) > 1 else 10.0,
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

    async def _load_directory(self) -> None:
        """The VPN directory, once the peer has said which VPNs it holds."""
        self.refresher = DirectoryRefresher(
            self.directory,
            self.api,
            self._load_settings,
            self.cfg.topology_refresh_seconds,
            self._queues_gone,
            self.refusals.get,
        )
        await self._hear_peer_epochs()
        await self.refresher.refresh()

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

    async def _recover_transactions(self) -> None:
        """Resolve what a crash left in doubt before any client is let in
        (txn/local/_recovery.py); the broker must answer for its markers."""
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(MarkerError),
                wait=wait_random_exponential(multiplier=0.5, max=5),
                stop=stop_after_delay(RECOVERY_SECONDS),
                reraise=True,
            ):
                with attempt:
                    await self.coordinator.recover(self.directory.names())
        except MarkerError as e:
            raise PluginError(f"in-doubt transactions not recovered: {e}") from e

    def _make_listener(self, incarnation: int) -> None:
        cfg = self.cfg
        self.ids = IdSource(incarnation, on_low=self._renew_incarnation)
        self.listener = Listener(
            [BrokerAddress.from_url(url) for url in cfg.amqp_urls],
            self.directory,
            self.ids,
            self.sink,
            broker_ssl=self.broker_ssl,
            max_connections=cfg.max_client_connections,
            marker_key=self.coordinator.markers.key,
        )
        self.listener.xa = XaGateway(self.xa, self.xa_replies)
        self.listener.on_uncertain = self.uncertain.record

    def _observe(self) -> None:
        """What ``/metrics`` reads, from the parts that count it."""
        assert self.listener is not None  # noqa: S101 - made just before
        self.metrics.observe_listener(self.listener.stats)
        self.metrics.observe_xa(self.xa.stats)
        self.metrics.observe_ledger_bound(self.ledger_bound.unacknowledged)
        self.metrics.observe_txn(self.coordinator.stats)
        self.metrics.observe_markers(self.coordinator.markers.forged)
        self.metrics.observe_ledger(self.writer.stats)
        self.metrics.observe_sync(self.replicator.sync_counts)
        self._observe_security(self.cfg)

    def _observe_security(self, cfg: SiteConfig) -> None:
        """The metrics of what guards the site: its certificates' dates,
        and the users config-sync left alone."""
        if cfg.tls is not None:
            self.metrics.observe_certificates(cfg.tls)
        client = self.bridge_client
        if client is not None:
            self.metrics.observe_config_sync(lambda: client.users_not_ours)

    async def _listen(self) -> None:
        """Clients in: AMQP, and AMQPS when configured."""
        cfg = self.cfg
        assert self.listener is not None  # noqa: S101 - made before
        await self.listener.start(cfg.listen_amqp.host, cfg.listen_amqp.port)
        if cfg.listen_amqps is not None and cfg.client_tls is not None:
            try:
                await self.listener.start_tls(
                    cfg.listen_amqps.host, cfg.listen_amqps.port, cfg.client_tls
                )
            except TlsSetupError as e:
                raise ConfigError(cfg.path, "client_tls", str(e)) from e

    async def _start_admin(self) -> None:
        cfg = self.cfg
        credentials = (
            AdminCredentials(cfg.admin_user, cfg.admin_password, cfg.admin_token)
            if cfg.admin_user is not None or cfg.admin_token is not None
            else None
        )
        self.admin = AdminServer(
            self.status,
            self.metrics_text,
            self.serves,
            self.lag_history,
            credentials,
            lambda command, vpn, args: start_request(cfg.store_dsn, command, vpn, args),
            lambda request: read_request(cfg.store_dsn, request),
        )
        await self.admin.start(cfg.listen_admin.host, cfg.listen_admin.port)

    async def _serve_bridge(self) -> None:
        assert self.bridge_server is not None  # noqa: S101 - made before
        await self.bridge_server.start(self.cfg.listen_bridge.host, self.cfg.listen_bridge.port)
        self._bridge_up = True

    def _start_background(self) -> None:
        """The periodic work: directory refreshes, sync eligibility into
        the database, lag samples, scheduled reconciliations."""
        assert self.refresher is not None  # noqa: S101 - made before
        tasks = self._tasks
        tasks.append(asyncio.create_task(self.refresher.run(), name="directory-refresh"))
        eligibility = record_eligibility(self.cfg.store_dsn, self.replicator)
        tasks.append(asyncio.create_task(eligibility, name="eligibility"))
        lag = self.lag_history.sample(lambda: self.status(broker=False))
        tasks.append(asyncio.create_task(lag, name="lag-history"))
        interval = self.cfg.reconcile.interval_seconds
        if interval is not None:
            schedule = ReconcileSchedule(
                self._config_path,
                self.cfg.reconcile.repair,
                self.directory.names,
                self.serves,
            )
            tasks.append(asyncio.create_task(schedule.run(interval), name="reconcile-schedule"))

    def _log_up(self, incarnation: int) -> None:
        cfg = self.cfg
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

    # -- what the parts call back; what the operator's requests (NodeRequests) use --

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
                self.sink.configure(s, r.applied_index)
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

    def serves(self, vpn: str) -> bool:
        """``vpn`` is active here, admits clients and confirms publishes."""
        view = self.directory.lookup(vpn)
        return (
            view is not None
            and view.role is Role.ACTIVE
            and view.refusal is None
            and vpn not in self.replicator.fenced
        )

    def refuse(self, vpn: str, text: str | None) -> None:
        """Refuse ``vpn``'s new clients with ``text`` (None: admit them again)."""
        if text is None:
            self.refusals.pop(vpn, None)
        else:
            self.refusals[vpn] = text
        view = self.directory.lookup(vpn)
        if view is not None:
            view.refusal = text

    def _fenced_by_peer(self, vpn: str, epoch: int, site: str) -> None:
        """The peer holds ``vpn`` active at a higher epoch: stop confirming,
        close the VPN's clients (320) and refuse new ones (530)."""
        text = fenced_text(vpn, epoch, site)
        log.error("VPN %s is fenced: %s", vpn, text)
        self.replicator.fenced.add(vpn)
        self.refuse(vpn, text)
        if self.listener is not None:
            self.listener.close_vpn(vpn, text)

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
        self._tasks.append(asyncio.create_task(self.take_incarnation(), name="incarnation"))

    async def take_incarnation(self) -> None:
        incarnation = await new_incarnation_retried(self.cfg)
        assert self.ids is not None  # noqa: S101 - set before the listener starts
        self.ids.renew(incarnation)
        log.info("replication ids continue with incarnation %d", incarnation)

    async def status(self, broker: bool = True) -> dict[str, Any]:
        """The ``status --json`` document (:func:`site_status`), and which
        node of the site this is (it leads: it runs these parts)."""
        doc = await site_status(self.cfg, self.api, self.replicator, broker)
        return {**doc, "node": self.cfg.node_name or None, "leads": True}

    async def metrics_text(self) -> bytes:
        """The ``/metrics`` body (:func:`metrics_body`)."""
        body = await metrics_body(self.metrics, lambda: self.status(broker=False))
        return body + leads_metric(self.cfg, True)

    def reload_tls(self) -> None:
        """SIGHUP: the bridge's TLS read again, without a restart
        (:func:`reload_bridge_tls`)."""
        fresh = reload_bridge_tls(self.cfg, (self.bridge_server, self.bridge_client))
        if fresh is None:
            return
        self.cfg = fresh
        if fresh.tls is not None:
            self.metrics.observe_certificates(fresh.tls)
