"""Keeps the listener's :class:`VpnDirectory` in step with the site.

At start and then every ``interval`` seconds: which VPNs have replication
enabled and how (a callable, backed by the site database in the node), and
each VPN's topology from the management HTTP API
(``GET /api/definitions/{vhost}``). Topology changes seen on the wire are
applied by the sessions in between; a re-read catches what bypassed the
listener (management UI, direct clients, exclusive queues of dead
connections).

A fetched topology replaces the live one only if no wire change happened
while it was being fetched (the topology's ``generation`` is unchanged);
otherwise the fetch is retried at the next tick, so a declare seen on the wire
is never overwritten by an older snapshot.

A definitions export leaves out exclusive queues. A queue the live topology
has and the snapshot lacks is therefore looked up at the broker: one that
exists (an exclusive queue declared through the listener) keeps its place
and bindings in the new topology; one that does not was deleted in the
management UI, with ``rabbitmqctl`` or by auto-delete, and on an active VPN
is handed to ``on_gone`` (the node replicates the deletion).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import quote, urlsplit

from ._config import redact_url
from ._directory import VpnDirectory, VpnView
from ._errors import PluginError
from ._topology import DestinationKind, ReplicationScope, Topology
from ._vpn import Role, VpnSettings

__all__ = ["DirectoryRefresher", "ManagementAPI", "ManagementUnavailable"]

log = logging.getLogger(__name__)


class ManagementUnavailable(PluginError):
    """The broker's management API could not be read."""


class ManagementAPI:
    """The few management HTTP API calls the node needs (blocking; run in a thread)."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        parts = urlsplit(url)
        self._base = (
            f"{parts.scheme}://{parts.hostname}:{parts.port or 15672}{parts.path.rstrip('/')}"
        )
        self._display = redact_url(url)
        user, password = parts.username or "guest", parts.password or "guest"
        self._auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self._timeout = timeout

    def get(self, path: str) -> object:
        req = urllib.request.Request(f"{self._base}/api/{path}")  # noqa: S310 - admin-configured URL
        req.add_header("Authorization", self._auth)
        try:
            with urllib.request.urlopen(req, timeout=self._timeout) as resp:  # noqa: S310
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise ManagementUnavailable(f"{self._display}: GET /api/{path}: HTTP {e.code}") from e
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ManagementUnavailable(f"{self._display}: GET /api/{path}: {e}") from e

    def definitions(self, vhost: str) -> object:
        return self.get(f"definitions/{quote(vhost, safe='')}")

    def queue_exists(self, vhost: str, queue: str) -> bool:
        """Whether the broker has ``queue`` (exclusive ones included)."""
        try:
            self.get(f"queues/{quote(vhost, safe='')}/{quote(queue, safe='')}")
        except ManagementUnavailable as e:
            if isinstance(e.__cause__, urllib.error.HTTPError) and e.__cause__.code == 404:
                return False
            raise
        return True


class DirectoryRefresher:
    """Loads VPN settings and topologies into a directory, now and periodically."""

    def __init__(
        self,
        directory: VpnDirectory,
        api: ManagementAPI,
        load_settings: Callable[[], Awaitable[Sequence[VpnSettings]]],
        interval: float = 30.0,
        on_gone: Callable[[VpnView, list[str]], Awaitable[None]] | None = None,
        refusal: Callable[[str], str | None] | None = None,
    ) -> None:
        """``refusal(vpn)``: why the VPN's clients are refused although it
        is active here (None: admitted)."""
        self.directory = directory
        self.api = api
        self.load_settings = load_settings
        self.interval = interval
        self.on_gone = on_gone
        self.refusal = refusal

    def _settle(self, view: VpnView, s: VpnSettings) -> None:
        view.role, view.scope, view.expose_id = s.role, ReplicationScope.of(s), s.expose_id
        view.refusal = self.refusal(s.name) if self.refusal is not None else None

    async def refresh(self) -> None:
        """One pass; a VPN whose definitions cannot be read keeps its old view."""
        settings = {s.name: s for s in await self.load_settings()}
        for name in self.directory.names():
            if name not in settings:
                self.directory.remove(name)
        for name, s in settings.items():
            view = self.directory.lookup(name)
            generation = view.topology.generation if view is not None else None
            try:
                raw = await asyncio.to_thread(self.api.definitions, name)
                fresh = Topology.from_definitions(name, raw)  # type: ignore[arg-type]
            except PluginError as e:
                log.warning("VPN %s: topology not refreshed: %s", name, e)
                if view is None:
                    fresh = Topology(name)
                else:
                    self._settle(view, s)
                    continue
            if view is None:
                view = VpnView(name, s.role, ReplicationScope.of(s), fresh)
                self._settle(view, s)
                self.directory.put(view)
                continue
            self._settle(view, s)
            try:
                gone = await self._reconcile_missing(name, view.topology, fresh)
            except PluginError as e:
                log.warning("VPN %s: topology not refreshed: %s", name, e)
                continue
            if view.topology.generation == generation:
                view.topology = fresh
                if gone and view.role is Role.ACTIVE and self.on_gone is not None:
                    await self.on_gone(view, gone)

    async def _reconcile_missing(self, vhost: str, live: Topology, fresh: Topology) -> list[str]:
        """Queues ``live`` has and ``fresh`` lacks: those the broker still has
        are copied into ``fresh`` with their bindings; returns the others."""
        gone = []
        for name in sorted(set(live.queues) - set(fresh.queues)):
            if not await asyncio.to_thread(self.api.queue_exists, vhost, name):
                gone.append(name)
                continue
            fresh.declare_queue(name, live.queues[name].arguments)
            for b in live.bindings():
                if b.destination_kind is DestinationKind.QUEUE and b.destination == name:
                    fresh.bind_queue(name, b.source, b.routing_key, b.arguments)
        return gone

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except PluginError as e:
                log.warning("directory refresh failed: %s", e)
