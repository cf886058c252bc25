"""What the active lists to a standby (``ResourceList``): its VPNs.

Every enabled, unfenced active VPN with its epoch and settings (database),
the index of the previous epoch's ledger it was taken over at, its
definitions with the users and permissions that let its clients log in
(management API), and the durable ledger index read just before them:
every change the listener made up to that index is in the definitions,
every later one comes in the stream. See docs/behaviour.md, "The bridge
between sites" (step 2, Config-sync, Topology in the stream).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

import psycopg

from bridge._settings import VpnSettings
from bridge.broker import ConfigSyncError, ManagementAPI, vpn_definitions
from bridge.ledger import LedgerError, LedgerWriter, VpnNotOpen
from bridge.link import describe_error
from bridge.store import Pool, active_vpns
from bridge.wire import ResourceList, VpnResource

__all__ = ["ResourceLister"]

log = logging.getLogger(__name__)


class ResourceLister:
    """Reads the active's listing; ``fenced``: the VPNs fenced here (not listed)."""

    def __init__(
        self, writer: LedgerWriter, api: ManagementAPI | None, fenced: Collection[str]
    ) -> None:
        self._writer = writer
        self._api = api
        self._fenced = fenced
        self._definitions_failures: dict[str, str] = {}
        #: VPN -> the index of the previous epoch's ledger it was taken over at
        self._taken_over: dict[str, int] = {}

    async def read(self, pool: Pool) -> ResourceList:
        """The listing as of now; :class:`LedgerError` when the site
        database is unavailable."""
        vpns = await self._load_vpns(pool)
        # Read before the definitions: every change the listener made up to
        # this index is in them, every later one comes in the stream.
        indexes = [self._durable_index(s.name) for s, _ in vpns]
        definitions = await asyncio.gather(*(self._definitions(s.name) for s, _ in vpns))
        return ResourceList(
            tuple(
                VpnResource.from_settings(
                    s, epoch, d, self._taken_over.get(s.name, 0), index if d else None
                )
                for (s, epoch), d, index in zip(vpns, definitions, indexes, strict=True)
            )
        )

    async def _load_vpns(self, pool: Pool) -> list[tuple[VpnSettings, int]]:
        try:
            async with pool.connection() as conn:
                rows = await active_vpns().run_async(conn)
        except psycopg.OperationalError as e:
            raise LedgerError(f"the site database is unavailable: {describe_error(e)}") from e
        out = []
        for row in rows:
            if row.settings.name in self._fenced:
                continue
            self._taken_over[row.settings.name] = row.taken_over_at
            out.append((row.settings, row.epoch))
        return out

    def _durable_index(self, vpn: str) -> int | None:
        """The VPN's last committed ledger index (None: its ledger is not
        open here yet, and the listing goes without one: the standby takes
        it whole, as from a protocol-5 active)."""
        try:
            return self._writer.durable_index(vpn)
        except VpnNotOpen:
            return None

    async def _definitions(self, vpn: str) -> bytes:
        """The VPN's definitions with the users and permissions that let its
        clients log in (``bridge.broker._configsync``), or b"" when not readable."""
        if self._api is None:
            return b""
        try:
            found = await asyncio.to_thread(vpn_definitions, self._api, vpn)
        except ConfigSyncError as e:
            if self._definitions_failures.get(vpn) != str(e):  # once per cause, not per relist
                log.warning("bridge: VPN %s: definitions not sent (no config-sync): %s", vpn, e)
            self._definitions_failures[vpn] = str(e)
            return b""
        self._definitions_failures.pop(vpn, None)
        return found
