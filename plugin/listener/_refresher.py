"""Keeps the listener's :class:`VpnDirectory` in step with the site.

At start and every ``interval`` seconds it reads which VPNs have replication
enabled and how (a callable, backed by the site database in the node) and
each VPN's definitions from the management API; the sessions apply what
they see on the wire in between. A fetched topology replaces the live one
only if no wire change happened meanwhile (``generation`` unchanged), else
it is fetched again at the next tick. A VPN whose definitions were never
read refuses clients (530) and is tried every second. A queue the live
topology has and the export lacks is looked up at the broker: kept if it
exists (an exclusive queue), else, on an active VPN, handed to ``on_gone``.
Why each: docs/behaviour.md, "Routing is computed by the listener" and
"Queues deleted outside the listener"; README, "Clients find the active site".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from bridge import Role, VpnSettings
from bridge.broker import ManagementAPI, ManagementUnavailable
from plugin._errors import PluginError
from plugin.topology import DestinationKind, ReplicationScope, Topology, VpnDirectory, VpnView

__all__ = ["DirectoryRefresher"]

log = logging.getLogger(__name__)

#: how often a VPN whose definitions were never read is tried again
UNLOADED_RETRY = 1.0


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
        #: VPNs whose definitions were never read: their clients are refused
        self.unloaded: set[str] = set()

    def _settle(self, view: VpnView, s: VpnSettings) -> None:
        view.role, view.scope, view.expose_id = s.role, ReplicationScope.of(s), s.expose_id
        view.mode = s.mode.value
        view.refusal = self.refusal(s.name) if self.refusal is not None else None
        if view.refusal is None and s.name in self.unloaded and s.role is Role.ACTIVE:
            view.refusal = (
                f"the definitions of vhost {s.name!r} are not loaded yet (its broker's "
                "management API did not answer); try again"
            )

    async def refresh(self) -> None:
        """One pass; a VPN whose definitions cannot be read keeps its old view."""
        settings = {s.name: s for s in await self.load_settings()}
        for name in self.directory.names():
            if name not in settings:
                self.directory.remove(name)
                self.unloaded.discard(name)
        for name, s in settings.items():
            view = self.directory.lookup(name)
            generation = view.topology.generation if view is not None else None
            try:
                raw = await asyncio.to_thread(self.api.definitions, name)
                fresh = Topology.from_definitions(name, raw)  # type: ignore[arg-type]
            except (PluginError, ManagementUnavailable) as e:
                log.warning("VPN %s: topology not refreshed: %s", name, e)
                if view is None:
                    fresh = Topology(name)
                    self.unloaded.add(name)
                else:
                    self._settle(view, s)
                    continue
            else:
                self.unloaded.discard(name)
            if view is None:
                view = VpnView(name, s.role, ReplicationScope.of(s), fresh)
                self._settle(view, s)
                self.directory.put(view)
                continue
            self._settle(view, s)
            try:
                gone = await self._reconcile_missing(name, view.topology, fresh)
            except (PluginError, ManagementUnavailable) as e:
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
            await asyncio.sleep(UNLOADED_RETRY if self.unloaded else self.interval)
            try:
                await self.refresh()
            except (PluginError, ManagementUnavailable) as e:
                log.warning("directory refresh failed: %s", e)
