"""One VPN's apply worker on the standby: its stream's frames, in arrival
order, applied and acknowledged.

Invariant: nothing confirmed on the active is lost or applied twice here,
whatever the link does. The worker applies every batch with
:meth:`~bridge.standby._applier.StandbyApplier.apply_batch`, which stores
the applied index in the same transaction as the effects, and acknowledges
only after that commit. Every (re)synchronisation starts from that stored
index, never from what was merely received, so a link cut at any byte, a
standby killed mid-apply, or a gap resumes right after the last durable
entry; replayed duplicates are skipped by index. What the worker follows of
its stream is the sans-IO :class:`~bridge.standby._stream.StandbyStream`.
Limits: a checkpoint's rows are held in memory until its last chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from bridge._errors import BridgeError, Gap, LocalProtocolError, StaleEpoch, UnknownVpn
from bridge._failpoints import failpoint
from bridge.link import Link
from bridge.store import CONNECTED, DISCONNECTED, SYNCING, Pool, applied_position, epoch_taken
from bridge.wire import (
    Ack,
    Checkpoint,
    Error,
    Events,
    GetAllResources,
    Repair,
    SyncAccepted,
    SyncFinished,
    SyncRequest,
    TxnCommit,
    VpnResource,
)

from ._adoption import VpnAdoption
from ._applier import NotStandby, StandbyApplier
from ._stream import StandbyStream
from ._txnlink import StandbyTxnLink

__all__ = ["Relisted", "Resync", "SiteParts", "VpnWorker", "WorkItem"]

log = logging.getLogger(__name__)

#: items a VPN's worker queue holds before the reader waits for it
_QUEUE_SIZE: Final = 64


@dataclass(frozen=True, slots=True)
class Relisted:
    """Worker item: the active (re)listed the VPN."""

    resource: VpnResource


@dataclass(frozen=True, slots=True)
class Resync:
    """Worker item: resynchronise from the applied index (after a Gap)."""

    reason: str


WorkItem = (
    Relisted | Resync | SyncAccepted | Checkpoint | Events | SyncFinished | TxnCommit | Repair
)


@dataclass(frozen=True, slots=True)
class SiteParts:
    """The parts of this site a session's workers use, for one run of the
    standby's bridge: its database, applier, adoption of listed VPNs and
    transaction link, and where a VPN's bridge state is recorded."""

    pool: Pool
    applier: StandbyApplier
    adoption: VpnAdoption
    txn_link: StandbyTxnLink
    set_state: Callable[[str, str], None]
    max_apply_batch: int


class VpnWorker:
    """One VPN's apply worker: its queue, its task, and its view of the
    stream. ``fail`` ends the session over ``link`` (a worker that cannot go on)."""

    def __init__(
        self,
        vpn: str,
        link: Link,
        parts: SiteParts,
        peer_site: str,
        fail: Callable[[BaseException], None],
    ) -> None:
        self.stream = StandbyStream(vpn)
        self.queue: asyncio.Queue[WorkItem] = asyncio.Queue(_QUEUE_SIZE)
        self.task: asyncio.Task[None] | None = None
        self._link = link
        self._parts = parts
        self._peer_site = peer_site
        self._fail = fail

    @property
    def vpn(self) -> str:
        return self.stream.vpn

    def start(self) -> None:
        self.task = asyncio.create_task(self._work(), name=f"bridge-apply-{self.vpn}")

    async def _work(self) -> None:
        try:
            held: WorkItem | None = None
            while True:
                item = held if held is not None else await self.queue.get()
                held = await self._handle_item(item)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._fail(e)

    async def _handle_item(self, item: WorkItem) -> WorkItem | None:
        """Apply one item; returns an item taken from the queue but not used."""
        stream = self.stream
        if isinstance(item, Relisted):
            await self._relisted(item.resource)
        elif isinstance(item, Resync):
            await self._request_sync()
        elif stream.drops(item):
            pass  # the tail of a stream this side left
        elif isinstance(item, SyncAccepted):
            stream.accepted()
        elif isinstance(item, Checkpoint):
            stream.rows.extend(item.rows)
            if item.last:
                await self._install(item)
        elif isinstance(item, Events):
            return await self._apply(item)
        elif isinstance(item, TxnCommit):
            # in line with the stream: after what came before it, before what comes after
            await self._parts.txn_link.commit_early(self._link, stream, item)
        elif isinstance(item, Repair):
            await self._repair(item)
        elif stream.finished():  # the SyncFinished of a stream not refused meanwhile
            self._parts.set_state(self.vpn, CONNECTED)
            txn_link = self._parts.txn_link
            txn_link.spawn(txn_link.ask_in_doubt(self._link, self.vpn))
        return None

    async def _relisted(self, resource: VpnResource) -> None:
        if not await self._parts.adoption.config_sync(resource, self._peer_site):
            self._parts.set_state(resource.name, DISCONNECTED)
            return
        known = self._link.conn.known_epoch(resource.name)
        if not self.stream.wants_sync(resource.epoch, known):
            return
        await self._request_sync()

    async def _request_sync(self) -> None:
        vpn = self.vpn
        async with self._parts.pool.connection() as conn:
            found = await applied_position(vpn).run_async(conn)
            applied, applied_epoch = found if found is not None else (0, 0)
            if applied == 0:
                applied_epoch = 0
            epoch = max(self._link.conn.known_epoch(vpn), applied_epoch, 1)
            # who took the epoch and where: an active it fences records them
            taken = await epoch_taken(vpn, epoch).run_async(conn)
        by, at = taken if taken is not None else ("", 0)
        try:
            self._link.send(SyncRequest(vpn, epoch, applied, applied_epoch, by, at))
        except LocalProtocolError as e:
            log.debug("bridge: VPN %s: no sync request now: %s", vpn, e)
            return
        self.stream.requested()
        log.info("bridge: VPN %s: sync requested from index %d", vpn, applied + 1)
        self._parts.set_state(vpn, SYNCING)

    async def _install(self, last: Checkpoint) -> None:
        rows = self.stream.take_checkpoint()
        try:
            await asyncio.to_thread(
                self._parts.applier.install_checkpoint, self.vpn, last.epoch, last.index, rows
            )
        except (NotStandby, UnknownVpn) as e:
            self._abandon(e)
            return
        self.stream.early = 0  # the checkpoint holds what was committed early
        # The replay goes on after the checkpoint: the topology changes
        # between this site's last listing and it come with a new listing.
        self._link.try_send(GetAllResources())
        log.info(
            "bridge: VPN %s: installed a checkpoint of %d live messages at index %d",
            self.vpn,
            len(rows),
            last.index,
        )
        self._ack(last.index)

    async def _apply(self, first: Events) -> WorkItem | None:
        entries = list(first.entries)
        held: WorkItem | None = None
        while len(entries) < self._parts.max_apply_batch and not self.queue.empty():
            more = self.queue.get_nowait()
            if not isinstance(more, Events):
                held = more
                break
            entries.extend(more.entries)
        vpn = self.vpn
        try:
            applied = await self._parts.txn_link.skip_committed(vpn, entries)
            if applied is None:
                applied = await asyncio.to_thread(self._parts.applier.apply_batch, vpn, entries)
        except Gap as e:
            log.warning("bridge: %s; resyncing from the applied index", e)
            await self._request_sync()
            return held
        except (StaleEpoch, NotStandby, UnknownVpn) as e:
            self._abandon(e)
            return held
        failpoint("participant.after-apply")
        self._ack(applied)
        return held

    async def _repair(self, frame: Repair) -> None:
        """A reconcile repair, in stream order (after what came before it)."""
        try:
            await asyncio.to_thread(
                self._parts.applier.apply_repair, self.vpn, frame.rows, frame.absent
            )
        except (NotStandby, UnknownVpn) as e:
            self._abandon(e)
            return
        log.info(
            "bridge: VPN %s: reconcile repair applied: %d rows set, %d removed",
            self.vpn,
            len(frame.rows),
            len(frame.absent),
        )

    def _abandon(self, why: BridgeError) -> None:
        """Stop applying this VPN's stream and tell the active why."""
        log.error("bridge: VPN %s: not applying the stream: %s", self.vpn, why.text)
        self._link.try_send(Error.from_exception(why, vpn=self.vpn))
        self.stream.abandoned(stale_at=(why.known or 0) if isinstance(why, StaleEpoch) else None)
        self._parts.set_state(self.vpn, DISCONNECTED)

    def _ack(self, index: int) -> None:
        conn = self._link.conn
        following = conn.next_index(self.vpn)
        if following is None:
            return
        index = min(index, following - 1)
        stream = self.stream
        if index <= stream.acked:
            return
        if self._link.try_send(Ack(self.vpn, conn.known_epoch(self.vpn), index)):
            stream.acked = index
