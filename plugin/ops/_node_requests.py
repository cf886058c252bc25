"""The running node's side of the operator's requests: promote, demote,
the switchover's steps, repair and retiring uncertain publishes, and
deciding XA branches (:class:`NodeRequests`, served by
:class:`~plugin.ops._requests.RequestServer`).

Each changes the database and the node's listener, bridge and ledger in
step. The node is reached through :class:`RunningNode`, since ops sits
below the node and never imports it.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import psycopg

from bridge import BridgeError, Consumed, ReplicationId, future_callback
from bridge.roles import TakeoverUnknown
from bridge.store import ledger_progress
from plugin._errors import StateError, UsageError
from plugin.config import SiteConfig

from ._demote import DemotionSummary, demote, export_tail
from ._promote import promote
from ._requests import Handler, Progress
from ._switchover import switchover
from ._xa_admin import decide_branch

if TYPE_CHECKING:  # the node's parts, typed only: the CLI imports ops without them
    from bridge.active import ActiveBridge, Replicator
    from bridge.ledger import LedgerWriter
    from bridge.standby import StandbyBridge
    from plugin.listener import DirectoryRefresher, Listener
    from txn.branches import XaCoordinator

__all__ = ["NodeRequests", "RunningNode"]

# the node's own log: these run inside it
log = logging.getLogger("vpnrepl.node")

#: how long a switchover waits for the standby to acknowledge everything
SWITCHOVER_DRAIN = 60.0
#: how long a repair request may wait for the live stream to leave room
REPAIR_SECONDS = 120.0

_FORGET_UNCERTAIN = """
DELETE FROM uncertain_publish u USING unnest(%s::text[], %s::bytea[]) AS k(q, r)
WHERE u.vpn = %s AND u.queue = k.q AND u.repl_id = k.r
"""


class RunningNode(Protocol):
    """What the requests need of the running node."""

    cfg: SiteConfig
    broker_ssl: ssl.SSLContext | None
    writer: LedgerWriter
    replicator: Replicator
    xa: XaCoordinator
    listener: Listener | None
    refresher: DirectoryRefresher | None
    bridge_server: ActiveBridge | None
    bridge_client: StandbyBridge | None
    #: VPN -> why its clients are refused although it is active here
    refusals: dict[str, str]
    #: VPN -> the refusal of a switchover under way (kept across refreshes)
    switching: dict[str, str]

    def serves(self, vpn: str) -> bool:
        """``vpn`` is active here, admits clients and confirms publishes."""

    def refuse(self, vpn: str, text: str | None) -> None:
        """Refuse ``vpn``'s new clients with ``text`` (None: admit them again)."""

    async def take_incarnation(self) -> None:
        """Record a new incarnation; replication ids continue with it."""


class NodeRequests:
    """The request handlers, by request name (:meth:`handlers`)."""

    def __init__(self, node: RunningNode) -> None:
        self.node = node

    def handlers(self) -> dict[str, Handler]:
        return {
            "promote": self.promote,
            "demote": self.demote,
            "switchover-prepare": self.switchover_prepare,
            "switchover-finish": self.switchover_finish,
            "switchover-abort": self.switchover_abort,
            "switchover": self.switchover,
            "repair": self.repair,
            "xa-decide": lambda vpn, args, _progress: decide_branch(self.node.xa, vpn, args),
            "retire-uncertain": self.retire_uncertain,
        }

    async def promote(
        self, vpn: str, args: Mapping[str, Any], progress: Progress
    ) -> dict[str, Any]:
        """The ``promote`` operator request, on the running node: refused
        while the peer still serves the VPN as active (split brain), unless
        ``force`` or it is a switchover's own promotion."""
        node = self.node
        if not (args.get("force") or args.get("switchover")):
            await self._peer_not_serving(vpn)
        summary = await promote(node.cfg, vpn, progress, node.broker_ssl)
        # the promoted VPN's ids must not repeat any the old active made
        await node.take_incarnation()
        if node.refresher is not None:
            await node.refresher.refresh()  # opens its ledger; the listener admits clients
        return summary.as_dict()

    async def _peer_not_serving(self, vpn: str) -> None:
        """Raise when the peer still serves ``vpn`` as active to this site.
        A link that is up is given the heartbeat timeout to prove it is
        alive (an active killed a moment ago leaves a link that has not
        noticed yet)."""
        client = self.node.bridge_client
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

    async def demote(self, vpn: str, args: Mapping[str, Any], progress: Progress) -> dict[str, Any]:
        """The ``demote`` operator request, on the running node: the CLI has
        exported the tail; from the admin endpoint (``export``) the node
        writes it first, next to the config file, before anything is purged."""
        node = self.node
        exported = None
        if args.get("export"):
            tail_dir = Path(node.cfg.path).parent
            _, path = await asyncio.to_thread(export_tail, node.cfg, vpn, None, tail_dir)
            exported = str(path)
        summary = await demote(node.cfg, vpn)
        node.replicator.fenced.discard(vpn)
        node.refusals.pop(vpn, None)
        node.writer.forget_vpn(vpn)
        if node.refresher is not None:
            await node.refresher.refresh()  # a standby now: clients refused as for any standby
        if node.bridge_client is not None:
            node.bridge_client.relist_now()  # and the new active's checkpoint asked for
        result = summary.as_dict()
        if exported is not None:
            result["tail"] = exported
        return result

    async def switchover(
        self, vpn: str, args: Mapping[str, Any], progress: Progress
    ) -> dict[str, Any]:
        """``POST /vpns/VPN/switchover`` on the standby: this node runs the
        switchover's steps (plugin/ops/_switchover.py), promoting with its own
        handler."""

        async def promote_here(p: Progress) -> dict[str, Any]:
            return await self.promote(vpn, {"switchover": True}, p)

        lines = await switchover(self.node.cfg, vpn, progress, promote_here)
        return {"lines": lines, "line": "; ".join(lines)}

    async def switchover_prepare(
        self, vpn: str, args: Mapping[str, Any], progress: Progress
    ) -> dict[str, Any]:
        """Switchover, on the active: close and refuse the VPN's clients, then
        wait until the standby acknowledged the whole ledger."""
        node = self.node
        if not node.serves(vpn):
            raise StateError(f"VPN {vpn!r} is not served by this site's node")
        text = f"switchover to site {args.get('to', '?')!r}: connect to that site"
        node.switching[vpn] = text
        node.refuse(vpn, text)
        if node.listener is not None:
            node.listener.close_vpn(vpn, text)
        try:
            index = await self._drained(vpn)
        except StateError:
            node.switching.pop(vpn, None)
            node.refuse(vpn, None)
            raise
        log.info("VPN %s: drained to index %d for a switchover", vpn, index)
        return {"ledger_index": index}

    async def _drained(self, vpn: str) -> int:
        """The ledger index once every entry is durable and acknowledged."""
        deadline = asyncio.get_running_loop().time() + SWITCHOVER_DRAIN
        steady = 0
        while True:
            async with await psycopg.AsyncConnection.connect(
                self.node.cfg.store_dsn, autocommit=True, connect_timeout=10
            ) as conn:
                found = await ledger_progress(vpn).run_async(conn)
            ledger, applied = found if found is not None else (0, -1)
            steady = steady + 1 if ledger == applied and not self.node.writer.pending else 0
            if steady >= 2:
                return ledger
            if asyncio.get_running_loop().time() > deadline:
                raise StateError(
                    f"VPN {vpn!r}: the standby acknowledged index {applied} of {ledger} within "
                    f"{SWITCHOVER_DRAIN:.0f} s; switchover abandoned, clients admitted again"
                )
            await asyncio.sleep(0.1)

    async def switchover_finish(
        self, vpn: str, args: Mapping[str, Any], progress: Progress
    ) -> dict[str, Any]:
        """Switchover, on the former active: once fenced by the promoted
        standby's epoch, become its standby (the tail is empty: drained)."""
        node = self.node
        deadline = asyncio.get_running_loop().time() + SWITCHOVER_DRAIN
        while vpn not in node.replicator.fenced:
            if asyncio.get_running_loop().time() > deadline:
                raise StateError(f"VPN {vpn!r}: the promoted site's epoch did not arrive here")
            await asyncio.sleep(0.1)
        while True:  # fenced by the standby's report: where the epoch took over comes next
            try:
                tail, path = await asyncio.to_thread(export_tail, node.cfg, vpn)
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
        node.switching.pop(vpn, None)
        summary = await self.demote(vpn, args, progress)
        return {"line": DemotionSummary.from_dict(summary).line(), "tail": len(tail.messages)}

    async def switchover_abort(
        self, vpn: str, args: Mapping[str, Any], progress: Progress
    ) -> dict[str, Any]:
        self.node.switching.pop(vpn, None)
        self.node.refuse(vpn, None)
        log.warning("VPN %s: switchover abandoned; clients admitted again", vpn)
        return {}

    async def repair(self, vpn: str, args: Mapping[str, Any], progress: Progress) -> dict[str, Any]:
        """The ``repair`` request of ``vpnrepl reconcile --repair``: the keys
        go to the standby as Repair frames, below the live stream."""
        server = self.node.bridge_server
        if server is None:
            raise StateError("the node is not serving its bridge yet")
        try:
            keys = [(str(q), bytes.fromhex(str(r))) for q, r in args["keys"]]
        except (KeyError, TypeError, ValueError) as e:
            raise UsageError(f"a repair request needs keys as [queue, hex id] pairs: {e}") from e
        try:
            async with asyncio.timeout(REPAIR_SECONDS):
                sent = await server.repair(vpn, keys)
        except TimeoutError:
            raise StateError(
                f"VPN {vpn!r}: the repair was not sent in {REPAIR_SECONDS:g} s "
                "(the live stream kept the bridge busy): run reconcile again"
            ) from None
        except BridgeError as e:
            raise StateError(f"VPN {vpn!r}: repair not sent: {e}") from e
        return {"sent": sent.sent, "skipped": sent.skipped}

    async def retire_uncertain(
        self, vpn: str, args: Mapping[str, Any], progress: Progress
    ) -> dict[str, Any]:
        """``reconcile --repair``: uncertain publishes the broker does not hold
        are consumed through the ledger (:func:`retire`)."""
        try:
            keys = [(str(q), bytes.fromhex(str(r))) for q, r in args["keys"]]
        except (KeyError, TypeError, ValueError) as e:
            raise UsageError(f"a retire request needs keys as [queue, hex id] pairs: {e}") from e
        node = self.node
        return {"retired": await retire(node.writer, node.cfg.store_dsn, vpn, keys)}


async def retire(
    writer: LedgerWriter, dsn: str, vpn: str, keys: Sequence[tuple[str, bytes]]
) -> int:
    """Phantoms found by reconcile: their consumption goes into the ledger
    (both sites drop them) and their rows go. Returns how many."""
    if not keys:
        return 0
    events = [Consumed(vpn, ReplicationId(rid), queue) for queue, rid in keys]
    durable: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    writer.append_group(events, future_callback(durable))
    if not await durable:
        raise RuntimeError("the retirement of uncertain publishes was not made durable")
    params: Any = ([q for q, _ in keys], [r for _, r in keys], vpn)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(_FORGET_UNCERTAIN, params)
    return len(keys)
