"""What a standby does with each VPN the active lists, before it replicates it.

A listed VPN is enabled here as ``standby`` if this site lacks it; at every
listing its settings follow the active's, its epoch rises to the active's
(never lowers), and the definitions are kept with the index they were read
at (:mod:`bridge.store._topology`), imported into the local broker
(``bridge.broker._configsync``) and the deletes streamed before that index
carried out. Invariant: a VPN is replicated only if this site holds it as an
enabled standby, and the higher epoch wins, the same epoch on both being a
conflict the admin settles (docs/behaviour.md, "The bridge between sites",
step 2); the role check, the epoch raise and the fencing run under the VPN's
row lock, so an operator's role change cannot interleave with them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import psycopg

from bridge._events import TopologyChanged
from bridge._settings import Role
from bridge.broker import (
    ConfigSyncError,
    ManagementAPI,
    carry_out_deletions,
    import_vpn_definitions,
)
from bridge.store import (
    SPLIT_BRAIN_SQL,
    ConfigLock,
    FollowedSettings,
    Pool,
    add_standby_vpn,
    add_vpn_state,
    fence_vpn,
    keep_definitions,
    lock_vpn_config,
    raise_epoch,
    read_followed_settings,
    save_followed_settings,
)
from bridge.wire import VpnResource

__all__ = ["VpnAdoption"]

log = logging.getLogger(__name__)


class VpnAdoption:
    """Settles each listed VPN on the standby site (module docstring)."""

    def __init__(
        self,
        pool: Pool,
        api: ManagementAPI | None,
        on_fenced: Callable[[str, int, str], None] | None = None,
        on_adopted: Callable[[str], None] | None = None,
    ) -> None:
        """``on_fenced(vpn, epoch, site)``: the peer holds a VPN that is
        active here at a higher epoch, and this site's VPN was recorded
        fenced; ``on_adopted(vpn)``: a VPN the active lists was enabled here
        as standby (committed)."""
        self._pool = pool
        self._api = api
        self._on_fenced = on_fenced
        self._on_adopted = on_adopted
        self._skipped: dict[str, str] = {}  # VPN -> why it is not replicated (logged once)
        self._config_sync_failures: dict[str, str] = {}  # VPN -> why (logged once)
        #: VPN -> streamed changes a kept listing superseded, whose deletes
        #: the local broker has yet to carry out (at the next import)
        self._superseded: dict[str, list[TopologyChanged]] = {}

    async def config_sync(self, resource: VpnResource, peer_site: str) -> bool:
        """Enable the VPN here as standby if it is new, follow the active's
        settings and keep its definitions (:meth:`adopt`), and import them,
        users and permissions included, into the local broker; False when it
        must not be replicated here (enabled as active, or disabled by the
        admin)."""
        vpn = resource.name
        why = await self.adopt(resource, peer_site)
        if why is not None:
            if self._skipped.get(vpn) != why:
                log.error("bridge: VPN %s is not replicated here: %s", vpn, why)
            self._skipped[vpn] = why
            return False
        self._skipped.pop(vpn, None)
        if self._api is None:
            return True
        if not resource.definitions_json:
            self._config_sync_failed(vpn, "the active sent no definitions")
            return True
        try:
            created = await asyncio.to_thread(
                import_vpn_definitions, self._api, vpn, resource.definitions_json
            )
        except ConfigSyncError as e:
            self._config_sync_failed(vpn, str(e))
            return True
        if created:
            log.info("bridge: VPN %s: vhost created on the local broker", vpn)
        superseded = self._superseded.pop(vpn, [])
        if superseded:
            try:
                deleted = await asyncio.to_thread(
                    carry_out_deletions, self._api, vpn, superseded, resource.definitions_json
                )
            except ConfigSyncError as e:
                # tried again at the next listing (a delete done already is skipped)
                self._superseded.setdefault(vpn, [])[:0] = superseded
                self._config_sync_failed(vpn, f"streamed deletes not carried out: {e}")
                return True
            if deleted:
                log.info("bridge: VPN %s: %d objects deleted on the active removed", vpn, deleted)
        if self._config_sync_failures.pop(vpn, None) is not None:
            log.info("bridge: VPN %s: config-sync works again", vpn)
        return True

    def _config_sync_failed(self, vpn: str, why: str) -> None:
        """Log once per cause: the same failure comes back at every relist."""
        if self._config_sync_failures.get(vpn) != why:
            log.warning("bridge: VPN %s: broker config not synced: %s", vpn, why)
        self._config_sync_failures[vpn] = why

    async def adopt(self, resource: VpnResource, peer_site: str) -> str | None:
        """Settle the VPN's row for the listing of site ``peer_site``;
        returns why the VPN is not replicated from it (None: it is)."""
        vpn = resource.name
        async with self._pool.connection() as conn, conn.transaction():
            found = await lock_vpn_config(vpn).run_async(conn)
            if found is None:
                listed = FollowedSettings.of(resource)
                await add_standby_vpn(vpn, resource.epoch, listed).run_async(conn)
                await add_vpn_state(vpn).run_async(conn)
                log.info("bridge: VPN %s enabled here as standby (epoch %d)", vpn, resource.epoch)
                await self._follow_active(conn, resource)
            else:
                return await self._adopted_before(conn, resource, found, peer_site)
        if self._on_adopted is not None:  # committed: the listener must refuse its clients now
            self._on_adopted(vpn)
        return None

    async def _follow_active(
        self, conn: psycopg.AsyncConnection[Any], resource: VpnResource
    ) -> None:
        """Make a standby VPN's stored settings the active's (a change is
        logged once, when it arrives) and keep the definitions it sent last,
        so a promotion can import them again with the active gone."""
        vpn = resource.name
        listed = FollowedSettings.of(resource)
        stored = await read_followed_settings(vpn).run_async(conn)
        changes = (stored or listed).changes(listed)
        if changes:
            await save_followed_settings(vpn, listed).run_async(conn)
            log.info("bridge: VPN %s: settings follow the active: %s", vpn, ", ".join(changes))
        if resource.definitions_json:
            superseded = await keep_definitions(
                vpn, resource.definitions_json, resource.definitions_index
            ).run_async(conn)
            if superseded and self._api is not None:
                self._superseded.setdefault(vpn, []).extend(superseded)

    async def _adopted_before(
        self,
        conn: psycopg.AsyncConnection[Any],
        resource: VpnResource,
        found: ConfigLock,
        site: str,
    ) -> str | None:
        """:meth:`adopt` of a VPN this site has a row for."""
        if found.role is Role.ACTIVE and found.enabled:
            return await self._active_here(conn, resource, found.epoch, site)
        if not found.enabled:
            return "replication of it is disabled on this site"
        await raise_epoch(resource.name, resource.epoch).run_async(conn)
        await self._follow_active(conn, resource)
        return None

    async def _active_here(
        self, conn: psycopg.AsyncConnection[Any], resource: VpnResource, epoch: int, site: str
    ) -> str:
        """The peer lists a VPN that is active on this site too: the higher
        epoch wins (module docstring). Returns why the VPN is not replicated
        from the peer."""
        vpn = resource.name
        if resource.epoch > epoch:
            fence = fence_vpn(vpn, resource.epoch, site, resource.taken_over_at)
            fenced = await fence.run_async(conn)
            if fenced and self._on_fenced is not None:
                asyncio.get_running_loop().call_soon(self._on_fenced, vpn, resource.epoch, site)
            return (
                f"site {site!r} holds it active at epoch {resource.epoch}, newer than this "
                f"site's {epoch}: this site's VPN is fenced (`vpnrepl demote {vpn}` makes it "
                "a standby)"
            )
        if resource.epoch < epoch:
            return (
                f"this site took it over at epoch {epoch}; site {site!r} still lists epoch "
                f"{resource.epoch} and is fenced as soon as it lists this site's VPNs"
            )
        await conn.execute(SPLIT_BRAIN_SQL, (vpn,))
        return "it is enabled as active on this site too, at the same epoch (demote one of the two)"
