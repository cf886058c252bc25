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
from ._topology import ReplicationScope, Topology
from ._vpn import VpnSettings

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


class DirectoryRefresher:
    """Loads VPN settings and topologies into a directory, now and periodically."""

    def __init__(
        self,
        directory: VpnDirectory,
        api: ManagementAPI,
        load_settings: Callable[[], Awaitable[Sequence[VpnSettings]]],
        interval: float = 30.0,
    ) -> None:
        self.directory = directory
        self.api = api
        self.load_settings = load_settings
        self.interval = interval

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
                    view.role, view.scope = s.role, ReplicationScope.of(s)
                    continue
            if view is None:
                self.directory.put(VpnView(name, s.role, ReplicationScope.of(s), fresh))
                continue
            view.role, view.scope = s.role, ReplicationScope.of(s)
            if view.topology.generation == generation:
                view.topology = fresh

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except PluginError as e:
                log.warning("directory refresh failed: %s", e)
