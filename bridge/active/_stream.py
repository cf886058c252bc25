"""One VPN's stream from the active to one standby: replay, checkpoint, live.

Invariant: the standby receives every ledger entry after its applied state
exactly once and in index order, from the replay or the live feed. The
replay starts after the standby's applied index when that entry is in the
retained ledger at the same epoch (:meth:`ActiveStream.follows`), else after
a checkpoint: the ``live_message`` rows and the ``vpn_live_state.live_index``
they reflect, read in one snapshot (the ledger is never pruned past
``live_index``). The switch to live is one loop step: ``durable_index`` is
checked and the stream marked live with no ``await`` between, and the ledger
calls its subscribers in the step it advances ``durable_index``. A group
committed early waits for the standby's answer (:data:`ANSWER_WAIT`;
docs/behaviour.md, "Local transactions", step 4); reconcile repairs go when
no live entry waits (docs/behaviour.md, "Reconciliation"); a live feed too
far behind drops the standby (:class:`ConnectedStandby`), which resyncs.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
from psycopg.rows import tuple_row

from bridge import REFLECTED_INDEX, ROWS_OF_KEYS, LiveKey, touched
from bridge._entry import LedgerEntry, decode_event
from bridge._errors import BridgeError, PeerFailure
from bridge._events import Published
from bridge._ids import ReplicationId
from bridge.ledger import LedgerError, LedgerPruned, LedgerWriter, VpnNotOpen
from bridge.link import Link, LinkError, describe_error
from bridge.store import CONNECTED, SYNCING, Pool
from bridge.wire import (
    Checkpoint,
    CheckpointRow,
    Events,
    Repair,
    SyncAccepted,
    SyncFinished,
    SyncRequest,
)

__all__ = [
    "ANSWER_WAIT",
    "ActiveStream",
    "RepairSent",
    "ConnectedStandby",
    "StreamLimits",
]

log = logging.getLogger(__name__)

#: how long the live feed holds a group for the standby's answer to its early commit
ANSWER_WAIT = 1.0
_MIB: Final = 2**20

_LEDGER_BETWEEN = "SELECT event FROM ledger WHERE vpn = %s AND idx > %s AND idx <= %s ORDER BY idx"


@dataclass(frozen=True, slots=True)
class RepairSent:
    """What one repair request put on the stream."""

    #: rows and absent keys sent
    sent: int
    #: keys left to the stream: entries near the repair's point changed them
    skipped: int


@dataclass(eq=False)
class RepairJob:
    keys: list[LiveKey]
    done: asyncio.Future[RepairSent]


_LIVE_ROWS = """
SELECT queue, repl_id, publish_index, exchange, routing_key, properties, body
FROM live_message WHERE vpn = %s ORDER BY queue, publish_index
"""


def _entry_size(entry: LedgerEntry) -> int:
    event = entry.event
    if isinstance(event, Published):
        return 64 + len(event.body) + len(event.properties)
    return 64


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """How a stream cuts what it sends."""

    batch_size: int = 500  # ledger entries per Events frame, and per replay read
    checkpoint_chunk_bytes: int = 4 * _MIB  # a Checkpoint frame's rows, about


@dataclass(eq=False)
class ActiveStream:
    """One VPN's stream to one standby, on the active."""

    vpn: str
    epoch: int
    task: asyncio.Task[None] | None = None
    state: str = SYNCING
    live: bool = False  # the ledger subscriber queues entries for it
    next_index: int = 0  # the next index to send once live
    pending: deque[tuple[list[LedgerEntry], int]] = field(default_factory=deque)
    queued_bytes: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: first index of a group the standby was asked to commit early -> its
    #: answer (TxnApplied); the group's copy is held until then
    answers: dict[int, asyncio.Future[bool]] = field(default_factory=dict)
    #: reconcile repairs to send when no live entry waits (module docstring)
    repairs: deque[RepairJob] = field(default_factory=deque)

    def repair(self, keys: Sequence[LiveKey]) -> asyncio.Future[RepairSent]:
        """Queue a repair of ``keys``; the future says what was sent."""
        job = RepairJob(list(keys), asyncio.get_running_loop().create_future())
        self.repairs.append(job)
        self.wake.set()
        return job.done

    def push(self, entries: list[LedgerEntry]) -> None:
        """Queue live entries (the ledger subscriber; never blocks)."""
        size = sum(_entry_size(e) for e in entries)
        self.pending.append((entries, size))
        self.queued_bytes += size
        self.wake.set()

    async def serve(
        self,
        link: Link,
        request: SyncRequest,
        ledger: LedgerWriter,
        pool: Pool,
        limits: StreamLimits,
        on_synced: Callable[[str, int, int], None],
        on_live: Callable[[str], None],
    ) -> None:
        """Catch the standby up from ``request``, then stream live entries
        until cancelled. ``on_synced(vpn, index, epoch)``: the standby's
        state at the request is durable there (as good as an Ack);
        ``on_live(vpn)``: the replay is over."""
        await self._catch_up(link, request, ledger, pool, limits, on_synced)
        self.state = CONNECTED
        on_live(self.vpn)
        await self._pump(link, limits, pool)

    # -- the replay ------------------------------------------------------------

    async def follows(self, ledger: LedgerWriter, last_index: int, last_epoch: int) -> bool:
        """Whether the standby's state is a prefix of this ledger that a
        replay can continue (else it needs a checkpoint)."""
        if last_index == 0:
            return await ledger.reader.oldest_retained(self.vpn) <= 1
        if last_index > ledger.durable_index(self.vpn):
            return False
        try:
            found = await ledger.reader.read_range(self.vpn, last_index, 1)
        except LedgerPruned:
            return False
        return bool(found) and found[0].index == last_index and found[0].epoch == last_epoch

    async def _catch_up(
        self,
        link: Link,
        request: SyncRequest,
        ledger: LedgerWriter,
        pool: Pool,
        limits: StreamLimits,
        on_synced: Callable[[str, int, int], None],
    ) -> None:
        vpn = self.vpn
        try:
            ledger.durable_index(vpn)
        except VpnNotOpen:
            await ledger.open_vpn(vpn)
        last = request.last_applied_index
        if await self.follows(ledger, last, request.last_applied_epoch):
            link.send(SyncAccepted(vpn, self.epoch, last + 1))
            if last:  # durable on the standby: as good as an Ack
                on_synced(vpn, last, request.last_applied_epoch)
            next_index = last + 1
            log.info("bridge: VPN %s: replaying to %s from index %d", vpn, link.peer, next_index)
        else:
            next_index = await self._send_checkpoint(link, pool, limits)
        while True:
            durable = ledger.durable_index(vpn)
            if next_index > durable:
                # No await between the check and going live: see the module docstring.
                self.live, self.next_index = True, next_index
                link.send(SyncFinished(vpn, self.epoch, next_index - 1))
                log.info("bridge: VPN %s: %s caught up at index %d", vpn, link.peer, next_index - 1)
                return
            limit = min(limits.batch_size, durable - next_index + 1)
            entries = await ledger.reader.read_range(vpn, next_index, limit)
            if not entries:
                raise LedgerError(f"durable index {durable} but no entry {next_index}", vpn)
            self._send_events(link, entries)
            next_index = entries[-1].index + 1
            await link.flush()

    def _send_events(self, link: Link, entries: Sequence[LedgerEntry]) -> None:
        epoch = max(self.epoch, entries[-1].epoch)
        link.send(Events(self.vpn, epoch, tuple(entries)))

    async def _send_checkpoint(self, link: Link, pool: Pool, limits: StreamLimits) -> int:
        """Send SyncAccepted and the VPN's live messages as of one snapshot;
        returns the index the replay continues from."""
        vpn, count = self.vpn, 0
        async with pool.connection() as conn, conn.transaction():
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            # The index live_message reflects (the ledger may be further on:
            # the replay after the checkpoint covers the difference).
            at = await _live_index(conn, vpn)
            link.send(SyncAccepted(vpn, self.epoch, at + 1))
            ready: list[CheckpointRow] | None = None
            chunk: list[CheckpointRow] = []
            size = 0
            async with conn.cursor(name="bridge_checkpoint", row_factory=tuple_row) as rows:
                rows.itersize = 500
                await rows.execute(_LIVE_ROWS, (vpn,))
                async for queue, rid, index, exchange, key, props, body in rows:
                    row = CheckpointRow(
                        queue,
                        ReplicationId(bytes(rid)),
                        index,
                        exchange,
                        key,
                        bytes(props),
                        bytes(body),
                    )
                    chunk.append(row)
                    count += 1
                    size += 64 + len(row.body) + len(row.properties)
                    if size >= limits.checkpoint_chunk_bytes or len(chunk) >= 10_000:
                        if ready is not None:
                            link.send(Checkpoint(vpn, self.epoch, at, tuple(ready), False))
                            await link.flush()
                        ready, chunk, size = chunk, [], 0
            if ready is not None and chunk:
                link.send(Checkpoint(vpn, self.epoch, at, tuple(ready), False))
                link.send(Checkpoint(vpn, self.epoch, at, tuple(chunk), True))
            else:
                link.send(Checkpoint(vpn, self.epoch, at, tuple(ready or chunk), True))
        await link.flush()
        log.info(
            "bridge: VPN %s: sent %s a checkpoint of %d live messages at index %d",
            vpn,
            link.peer,
            count,
            at,
        )
        return at + 1

    # -- the live feed ---------------------------------------------------------

    async def _pump(self, link: Link, limits: StreamLimits, pool: Pool) -> None:
        """Live phase: send what the ledger subscriber queued, in order; a
        group whose early commit is unanswered waits; repairs go when no
        entry waits (module docstring)."""
        while True:
            if not self.pending:
                if self.repairs:  # every version this node speaks has Repair frames
                    await self._send_repair(link, pool, limits, self.repairs.popleft())
                    continue
                self.wake.clear()
                await self.wake.wait()
                continue
            batch: list[LedgerEntry] = []
            while self.pending and len(batch) < limits.batch_size:
                entries, size = self.pending.popleft()
                self.queued_bytes -= size
                batch.extend(e for e in entries if e.index >= self.next_index)
            if not batch:
                continue
            if batch[0].index != self.next_index:
                raise LedgerError(
                    f"live entries jump from {self.next_index} to {batch[0].index}", self.vpn
                )
            while batch:
                held = self._held_at(batch)
                ready, batch = batch[:held], batch[held:]
                for i in range(0, len(ready), limits.batch_size):
                    self._send_events(link, ready[i : i + limits.batch_size])
                if ready:
                    self.next_index = ready[-1].index + 1
                    await link.flush()
                if batch:
                    await self._await_answer(self.answers.pop(batch[0].index))

    def _held_at(self, batch: list[LedgerEntry]) -> int:
        """How many entries of ``batch`` go before the first group whose
        early commit is still unanswered (``len(batch)``: none is)."""
        first, last = batch[0].index, batch[-1].index
        for at in sorted(self.answers):
            if at > last:
                break
            if at < first or self.answers[at].done():
                del self.answers[at]  # answered, or sent already: nothing to hold
                continue
            return at - first
        return len(batch)

    async def _await_answer(self, answer: asyncio.Future[bool]) -> None:
        """Wait for the standby's answer to an early commit; after
        :data:`ANSWER_WAIT` the group goes without it (a standby that went
        silent is dropped by the heartbeats, not here)."""
        try:
            async with asyncio.timeout(ANSWER_WAIT):
                await asyncio.shield(answer)
        except TimeoutError:
            log.warning(
                "bridge: VPN %s: no answer to an early commit in %.1f s; streaming the group",
                self.vpn,
                ANSWER_WAIT,
            )

    def unanswered(self) -> None:
        """The standby is gone: its early commits will not be answered, its
        repairs not sent."""
        for answer in self.answers.values():
            if not answer.done():
                answer.set_result(False)
        self.failed_repairs("the standby disconnected")

    def failed_repairs(self, why: str) -> None:
        """Fail every queued repair (none can be sent on this stream)."""
        while self.repairs:
            job = self.repairs.popleft()
            if not job.done.done():
                job.done.set_exception(BridgeError(f"repair not sent: {why}", self.vpn))

    # -- reconcile repairs -----------------------------------------------------

    async def _send_repair(
        self, link: Link, pool: Pool, limits: StreamLimits, job: RepairJob
    ) -> None:
        """Read the active's rows of the job's keys and send them as a
        Repair at this point of the stream; keys that ledger entries between
        that point and the rows' snapshot touched are left to the stream."""
        try:
            rows, absent, skipped = await self._repair_rows(pool, job.keys)
        except Exception as e:  # the caller hears why; the stream goes on
            if not job.done.done():
                job.done.set_exception(e)
            return
        sent = 0
        chunk: list[CheckpointRow] = []
        size = 0
        try:
            for row in rows:
                chunk.append(row)
                size += 64 + len(row.body) + len(row.properties)
                if size >= limits.checkpoint_chunk_bytes:
                    link.send(Repair(self.vpn, self.epoch, tuple(chunk), ()))
                    sent, chunk, size = sent + len(chunk), [], 0
            if chunk or absent:
                link.send(Repair(self.vpn, self.epoch, tuple(chunk), tuple(absent)))
                sent += len(chunk) + len(absent)
            await link.flush()
        except BaseException as e:  # the stream ends: its caller hears why too
            if not job.done.done():
                job.done.set_exception(BridgeError(f"repair not sent: {e}", self.vpn))
            raise
        log.info(
            "bridge: VPN %s: reconcile repair sent to %s: %d rows, %d absent; %d keys "
            "left to the stream (changed by it meanwhile)",
            self.vpn,
            link.peer,
            len(rows),
            len(absent),
            len(skipped),
        )
        if not job.done.done():
            job.done.set_result(RepairSent(sent, len(skipped)))

    async def _repair_rows(
        self, pool: Pool, keys: list[LiveKey]
    ) -> tuple[list[CheckpointRow], list[tuple[str, ReplicationId]], set[LiveKey]]:
        """The rows to send for ``keys`` (those the active holds, those it
        does not) and the keys skipped. Nothing is sent on this stream while
        it runs (the pump awaits it), so ``next_index - 1`` is where the
        Repair will be."""
        at = self.next_index - 1
        async with pool.connection() as conn, conn.transaction():
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            live = await _live_index(conn, self.vpn)
            low, high = min(live, at), max(live, at)
            events = []
            if high > low:
                cur = await conn.execute(_LEDGER_BETWEEN, (self.vpn, low, high))
                for (data,) in await cur.fetchall():
                    events.append(decode_event(bytes(data), self.vpn))
            cur = await conn.execute(
                ROWS_OF_KEYS, ([q for q, _ in keys], [rid for _, rid in keys], self.vpn)
            )
            held = await cur.fetchall()
        changed, purged = touched(events)
        skipped = {k for k in keys if k in changed or k[0] in purged}
        rows = []
        have = set()
        for queue, rid, index, exchange, key, props, body in held:
            k = (queue, bytes(rid))
            if k in skipped:
                continue
            have.add(k)
            rows.append(
                CheckpointRow(
                    queue, ReplicationId(k[1]), index, exchange, key, bytes(props), bytes(body)
                )
            )
        absent = [
            (q, ReplicationId(r)) for q, r in keys if (q, r) not in have and (q, r) not in skipped
        ]
        return rows, absent, skipped


async def _live_index(conn: psycopg.AsyncConnection[Any], vpn: str) -> int:
    """The index the active's ``live_message`` reflects, in ``conn``'s
    snapshot (the ledger may be further on)."""
    cur = await conn.execute(REFLECTED_INDEX["active"], (vpn,))
    found = await cur.fetchone()
    if found is None:
        raise LedgerError("no vpn_live_state row", vpn)
    return int(found[0])


@dataclass(eq=False)
class ConnectedStandby:
    """One connected standby, as the active sees it."""

    link: Link
    streams: dict[str, ActiveStream] = field(default_factory=dict)
    epochs: dict[str, int] = field(default_factory=dict)  # listed epoch per VPN
    failure: BaseException | None = None
    #: the names its verified certificate carries (None: no certificate)
    certificate_names: frozenset[str] | None = None

    @property
    def name(self) -> str:
        site = self.link.conn.peer_site
        return f"{site!r} at {self.link.peer}" if site else self.link.peer

    def fail(self, exc: BaseException) -> None:
        """End the link from a stream task; the reader reports ``exc``."""
        if self.failure is None:
            self.failure = exc
        reason = exc if isinstance(exc, BridgeError) else PeerFailure(describe_error(exc))
        self.link.fail(reason)

    def stream_live(self, vpn: str) -> ActiveStream | None:
        """The VPN's stream to this standby if it is in the live phase."""
        out = self.streams.get(vpn)
        return out if out is not None and out.live else None

    def push_live(self, by_vpn: Mapping[str, list[LedgerEntry]], max_queued_bytes: int) -> None:
        """Queue newly durable entries (per VPN) on the live streams; drop
        this standby when one holds over ``max_queued_bytes`` (it resyncs)."""
        if self.failure is not None:
            return
        for vpn, items in by_vpn.items():
            out = self.stream_live(vpn)
            if out is None:
                continue
            out.push(items)
            if out.queued_bytes > max_queued_bytes:
                log.warning(
                    "bridge: standby %s is too slow (%d MiB of VPN %s queued); "
                    "dropping it, it will resync from its applied index",
                    self.name,
                    out.queued_bytes // _MIB,
                    vpn,
                )
                self.failure = LinkError(
                    f"too slow: over {max_queued_bytes // _MIB} MiB of VPN {vpn} queued"
                )
                self.link.abort()
                break
