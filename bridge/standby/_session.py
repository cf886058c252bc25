"""One session of the standby with the active: after the greeting, each
frame read from the link goes where it belongs.

A listing settles each VPN it names here (adoption) before a node admits
clients, starts a worker for a VPN new to the session and stops the worker
of one no longer listed; a VPN's stream frames are queued to its worker in
arrival order (a ``TxnCommit`` too: it is applied in stream order); the
transaction link's frames go to the transaction link. A refusal or a stale
epoch ends that VPN's stream only; a connection-level ``Error`` ends the
session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from bridge._errors import BridgeError, Gap, PeerFailure, RemoteProtocolError, StaleEpoch
from bridge._settings import HostPort
from bridge.link import Link, LinkClosed, describe_error
from bridge.store import DISCONNECTED
from bridge.wire import (
    Checkpoint,
    Error,
    Events,
    Repair,
    ResourceList,
    SyncAccepted,
    SyncFinished,
    TxnCommit,
    TxnOutcome,
    TxnPrepare,
)

from ._worker import Relisted, Resync, SiteParts, VpnWorker

__all__ = ["StandbySession"]

log = logging.getLogger(__name__)


class StandbySession:
    """One link to the active at ``peer``: its workers, whether a listing
    established it (``on_established`` is called then, once), and why it
    failed. ``listed`` is set once a listing was settled here."""

    def __init__(
        self,
        link: Link,
        parts: SiteParts,
        *,
        peer: HostPort,
        listed: asyncio.Event,
        on_established: Callable[[], None],
    ) -> None:
        self.link = link
        self.workers: dict[str, VpnWorker] = {}
        self.established = False
        self.failure: BaseException | None = None
        self._parts = parts
        self._peer = peer
        self._peer_site = ""
        self._listed = listed
        self._on_established = on_established

    def fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        reason = exc if isinstance(exc, BridgeError) else PeerFailure(describe_error(exc))
        self.link.fail(reason)

    async def converse(self, peer_site: str) -> None:
        """Serve the link after the greeting with the active ``peer_site``
        until it ends; raises a connection-level refusal."""
        self._peer_site = peer_site
        link = self.link
        while True:
            item = await link.next_frame()
            if item is None:
                if self.failure is None:
                    self.failure = LinkClosed("the active closed the link")
                return
            if isinstance(item, RemoteProtocolError):
                await self._vpn_fault(item)
            elif isinstance(item, ResourceList):
                if not self.established:
                    self.established = True
                    self._on_established()
                await self._listing(item)
            elif isinstance(
                item, SyncAccepted | Checkpoint | Events | SyncFinished | TxnCommit | Repair
            ):
                worker = self.workers.get(item.vpn)
                if worker is not None:
                    await worker.queue.put(item)
            elif isinstance(item, TxnPrepare | TxnOutcome):
                txn_link = self._parts.txn_link
                txn_link.spawn(txn_link.received(link, item))
            elif isinstance(item, Error):
                if item.closes_connection:
                    raise item.exception()
                self._refused(item)

    async def _vpn_fault(self, fault: RemoteProtocolError) -> None:
        worker = self.workers.get(fault.vpn)
        if isinstance(fault, Gap) and worker is not None:
            log.warning("bridge: %s; resyncing from the applied index", fault)
            # Queued behind what was received before the gap: the request
            # goes out once that is applied, from the index it reached.
            await worker.queue.put(Resync(str(fault)))
        elif isinstance(fault, StaleEpoch):
            log.error(
                "bridge: VPN %s: refused a frame from the active at %s: %s; "
                "waiting for an active with a current epoch",
                fault.vpn,
                self._peer,
                fault,
            )
            self.link.try_send(Error.from_exception(fault))
            if worker is not None:
                worker.stream.refused(stale_at=fault.known or 0)
            self._parts.set_state(fault.vpn, DISCONNECTED)
        else:
            log.debug("bridge: %s", fault)

    def _refused(self, error: Error) -> None:
        exc = error.exception()
        worker = self.workers.get(error.vpn)
        stale_at = None
        if isinstance(exc, StaleEpoch):
            log.error(
                "bridge: VPN %s: the active at %s is fenced (%s); not replicating from it",
                error.vpn,
                self._peer,
                exc.text,
            )
            stale_at = self.link.conn.known_epoch(error.vpn)
        else:
            log.warning("bridge: VPN %s: the active refused to sync: %s", error.vpn, exc)
        if worker is not None:
            worker.stream.refused(stale_at)
        self._parts.set_state(error.vpn, DISCONNECTED)

    async def _listing(self, listing: ResourceList) -> None:
        listed = {r.name: r for r in listing.vpns}
        for vpn in [v for v in self.workers if v not in listed]:
            gone = self.workers.pop(vpn)
            if gone.task is not None:
                gone.task.cancel()
            log.info("bridge: VPN %s is no longer replicated by the active", vpn)
            self._parts.set_state(vpn, DISCONNECTED)
        # Settled here, not only in the VPNs' workers: which VPNs are standby
        # here and which active ones are fenced. A starting node waits for
        # this (``listed``) before it admits clients.
        for resource in listing.vpns:
            await self._parts.adoption.adopt(resource, self._peer_site)
        self._listed.set()
        for resource in listing.vpns:
            worker = self.workers.get(resource.name)
            if worker is None:
                worker = VpnWorker(
                    resource.name, self.link, self._parts, self._peer_site, self.fail
                )
                worker.start()
                self.workers[resource.name] = worker
            await worker.queue.put(Relisted(resource))
