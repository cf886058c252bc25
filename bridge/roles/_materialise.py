"""Promotion's materialisation: a VPN's live messages into the site's broker.

:func:`materialise` publishes every ``live_message`` row of the VPN into its
queue, as docs/behaviour.md, "Failover: the active site is lost", step 4,
says, ``window`` confirms in flight; one reader, on a connection of its own,
reads batches of about 4 MiB through a server-side cursor, up to two
batches ahead, so the next queue's sort overlaps the end of the last.

Invariant: a queue marked ``done`` in ``promotion_queue`` holds exactly its
live rows, each once, in order, however often a run stopped. It is marked
done, with its count added to ``promotion.materialised``, only once the
broker confirmed every message and a passive declare checked its depth; a
queue not done is purged and published again; the totals are set at the
start from this epoch's rows; one run per VPN at a time (an advisory lock).
The caller (``vpnrepl promote``) has raised the epoch, keeps clients out
and imported the definitions (``bridge.broker._configsync.reimport``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import psycopg

from bridge._errors import BridgeError
from bridge.amqp import (
    AccessRefused,
    AmqpEndpoint,
    AMQPError,
    NotAllowed,
    NotFound,
    persistent_properties,
)
from bridge.broker import BrokerPublisher, ManagementAPI

__all__ = ["MaterialiseError", "MaterialiseResult", "materialise"]

log = logging.getLogger(__name__)

OnProgress = Callable[[int, int], None]
_Batch = list[tuple[bytes, bytes]]
#: what the reader hands the publisher: a batch of the current queue, None
#: at the end of a queue, or the error that stopped the reader
_Item = _Batch | BaseException | None

#: the class id of the session advisory lock (the second key is the VPN
#: name's hash); two-key locks never collide with single-bigint ones
_LOCK_CLASS = 0x766D_6174  # "vmat"
_LOCK_WAIT_SECONDS = 10.0
#: database reads: the first fetch, then as many rows as fill this many bytes
_FIRST_FETCH = 500
_FETCH_BYTES = 4 << 20
_MAX_FETCH = 10_000
#: read-ahead batches between the database reader and the publisher; the
#: reader runs into the next queue while the publisher finishes one, so
#: the next queue's first fetch (its sort: ~50 ms for 25,000 1 KiB rows
#: here) overlaps publishing instead of stalling it
_READ_AHEAD = 2
_ATTEMPTS = 3

_LOCK = "SELECT pg_try_advisory_lock(%s, hashtext(%s))"
_PROMOTION = "SELECT epoch FROM promotion WHERE vpn = %s FOR UPDATE"
# a message a prepared XA branch acked waits for the branch (xa_held)
_LIVE_COUNTS = """
SELECT queue, count(*) FROM live_message m
WHERE vpn = %s AND NOT EXISTS (SELECT 1 FROM xa_held h
    WHERE h.vpn = m.vpn AND h.repl_id = m.repl_id AND h.queue = m.queue)
GROUP BY queue
"""
_FORGET_OLDER = "DELETE FROM promotion_queue WHERE vpn = %s AND epoch <> %s"
# a queue not done yet is recorded with its current count; a done one stays
_RECORD = """
INSERT INTO promotion_queue AS p (vpn, queue, epoch, messages)
SELECT %s, q, %s, n FROM unnest(%s::text[], %s::bigint[]) AS t(q, n)
ON CONFLICT (vpn, queue) DO UPDATE SET messages = EXCLUDED.messages WHERE NOT p.done
"""
# a queue an interrupted run started whose rows are gone: emptied, then done
_EMPTIED = """
UPDATE promotion_queue SET messages = 0
WHERE vpn = %s AND NOT done AND NOT (queue = ANY(%s::text[]))
"""
_QUEUES = "SELECT queue, messages, done FROM promotion_queue WHERE vpn = %s ORDER BY queue"
_TOTALS = "UPDATE promotion SET total = %s, materialised = %s WHERE vpn = %s AND epoch = %s"
_ROWS = """
SELECT repl_id, properties, body FROM live_message m
WHERE vpn = %s AND queue = %s AND NOT EXISTS (SELECT 1 FROM xa_held h
    WHERE h.vpn = m.vpn AND h.repl_id = m.repl_id AND h.queue = m.queue)
ORDER BY publish_index, repl_id
"""
_MARK_DONE = """
UPDATE promotion_queue SET done = true, messages = %s
WHERE vpn = %s AND queue = %s AND epoch = %s AND NOT done
"""
_ADD_DONE = """
UPDATE promotion SET materialised = materialised + %s, total = total + %s
WHERE vpn = %s AND epoch = %s
"""


class MaterialiseError(BridgeError):
    """Materialisation stopped; the text names the queue (``queue``, None
    when the fault is not one queue's) and the cause. Nothing is lost: a
    re-run continues with the queues not done."""

    def __init__(self, text: str, vpn: str = "", *, queue: str | None = None) -> None:
        super().__init__(text, vpn)
        self.queue = queue


@dataclass(frozen=True, slots=True)
class MaterialiseResult:
    """What one :func:`materialise` call did."""

    #: messages published and confirmed by this call
    messages: int
    #: queues materialised by this call
    queues: int
    seconds: float
    #: the VPN's live messages, every queue's (done before or now)
    total: int = 0
    #: queues an earlier run of this epoch had finished (skipped now)
    skipped_queues: tuple[str, ...] = ()
    #: messages an interrupted run had left in the queues, purged first
    purged: int = 0


def _empty_stream(api: ManagementAPI, vpn: str, queue: str) -> int | None:
    """If ``queue`` is a stream: delete it and declare it again, with its
    arguments and bindings (always: the API's message count may be seconds
    old), and return how many it held; None for any other queue, which the
    caller purges."""
    path = f"queues/{quote(vpn, safe='')}/{quote(queue, safe='')}"
    found = api.get(path)
    if not isinstance(found, dict) or found.get("type") != "stream":
        return None
    held = int(found.get("messages") or 0)
    bindings = api.get(f"{path}/bindings")
    api.delete(path)
    body = {"durable": True, "auto_delete": False, "arguments": found.get("arguments") or {}}
    api.put(path, json.dumps(body).encode())
    for b in bindings if isinstance(bindings, list) else []:
        if b.get("source"):  # not the default exchange's implicit one
            api.post(
                f"bindings/{quote(vpn, safe='')}/e/{quote(b['source'], safe='')}"
                f"/q/{quote(queue, safe='')}",
                json.dumps({"routing_key": b["routing_key"], "arguments": b["arguments"]}).encode(),
            )
    log.info("VPN %r stream %r declared again (it held %d messages)", vpn, queue, held)
    return held


@dataclass(frozen=True, slots=True)
class _QueuePlan:
    name: str
    messages: int
    done: bool


async def materialise(
    dsn: str,
    amqp_url: str | Sequence[str],
    vpn: str,
    epoch: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    window: int = 1000,
    progress: OnProgress | None = None,
    api: ManagementAPI | None = None,
) -> MaterialiseResult:
    """Publish the live messages of ``vpn`` into the site's broker (vhost
    ``vpn`` at ``amqp_url``, or the first of a cluster's nodes that answers)
    for the promotion to ``epoch``; see the module
    docstring for what is guaranteed and what the caller must have done.

    ``progress(done, total)`` is called at the start, as confirms arrive
    (about every ``window`` messages) and at the end. Every failure is a
    :class:`MaterialiseError`; running again continues where it stopped.

    ``api``: the site's management API, through which a stream queue is
    emptied before it is filled (a stream cannot be purged: it is deleted
    and declared again with its arguments and bindings). Without it, every
    queue is purged, which a stream refuses.
    """
    if window < 1:
        raise ValueError(f"the confirm window must be at least 1, got {window}")
    try:
        urls = [amqp_url] if isinstance(amqp_url, str) else list(amqp_url)
        endpoint = [AmqpEndpoint.from_url(url) for url in urls]
    except ValueError as e:
        raise MaterialiseError(f"broker URL: {e}", vpn) from e
    run = _Materialisation(dsn, vpn, epoch, window, progress, api)
    try:
        return await run.run(endpoint, ssl_context)
    except psycopg.Error as e:
        raise MaterialiseError(f"site store: {_pg_reason(e)}", vpn, queue=run.queue) from e
    except AMQPError as e:
        where = f"queue {run.queue!r}: " if run.queue else ""
        raise MaterialiseError(f"{where}{e}", vpn, queue=run.queue) from e


class _Materialisation:
    """One run: the database connection, the broker connection, the counts."""

    def __init__(
        self,
        dsn: str,
        vpn: str,
        epoch: int,
        window: int,
        progress: OnProgress | None,
        api: ManagementAPI | None,
    ) -> None:
        self.dsn = dsn
        self.vpn = vpn
        self.epoch = epoch
        self.window = window
        self.progress = progress
        self.queue: str | None = None  # the queue being worked on, for errors
        self.total = 0
        self.done = 0  # messages in queues done (before or by this run)
        self._reported = -1
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._publisher: BrokerPublisher | None = None
        #: the site's management API (streams are emptied through it)
        self.api = api

    @property
    def conn(self) -> psycopg.AsyncConnection[Any]:
        assert self._conn is not None  # noqa: S101 - set by run()
        return self._conn

    @property
    def publisher(self) -> BrokerPublisher:
        assert self._publisher is not None  # noqa: S101 - set by run()
        return self._publisher

    async def run(
        self, endpoint: Sequence[AmqpEndpoint], ssl_context: ssl.SSLContext | None
    ) -> MaterialiseResult:
        t0 = time.monotonic()
        self._conn = await self._connect_store()
        reader: _Reader | None = None
        try:
            await self._lock()
            plan = await self._plan()
            todo = [q for q in plan if not q.done]
            skipped = tuple(q.name for q in plan if q.done)
            self._report(force=True)
            messages = purged = 0
            if todo:
                self._publisher = await self._connect(endpoint, ssl_context)
                await self._check_queues(todo)
                reader = _Reader(self._read, [q.name for q in todo])
                for q in todo:
                    self.queue = q.name
                    published, emptied = await self._materialise_queue(q, reader.batches)
                    messages += published
                    purged += emptied
                self.queue = None
            seconds = time.monotonic() - t0
            log.info(
                "VPN %r: %d messages materialised into %d queues in %.1f s "
                "(%d queues done before, %d messages of an interrupted run purged)",
                self.vpn,
                messages,
                len(todo),
                seconds,
                len(skipped),
                purged,
            )
            return MaterialiseResult(messages, len(todo), seconds, self.total, skipped, purged)
        finally:
            if reader is not None:
                await _stop(reader)
            if self._publisher is not None:
                await self._publisher.close()
            await self._conn.close()

    # ------------------------------------------------------------ database

    async def _connect_store(self) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(self.dsn, autocommit=True, connect_timeout=10)

    async def _lock(self) -> None:
        deadline = time.monotonic() + _LOCK_WAIT_SECONDS
        while True:
            row = await (await self.conn.execute(_LOCK, (_LOCK_CLASS, self.vpn))).fetchone()
            if row is not None and row[0]:
                return
            if time.monotonic() > deadline:
                raise MaterialiseError(
                    "another materialisation of this VPN is running (its advisory lock is held)",
                    self.vpn,
                )
            await asyncio.sleep(0.2)

    async def _plan(self) -> list[_QueuePlan]:
        """Record this epoch's queues and counts; set the promotion's totals."""
        conn, vpn, epoch = self.conn, self.vpn, self.epoch
        async with conn.transaction():
            row = await (await conn.execute(_PROMOTION, (vpn,))).fetchone()
            if row is None or row[0] != epoch:
                found = "none" if row is None else f"one of epoch {row[0]}"
                raise MaterialiseError(
                    f"no promotion of epoch {epoch} is recorded ({found}): the promotion "
                    "row must be written before materialising",
                    vpn,
                )
            counts = await (await conn.execute(_LIVE_COUNTS, (vpn,))).fetchall()
            names = [str(q) for q, _ in counts]
            await conn.execute(_FORGET_OLDER, (vpn, epoch))
            await conn.execute(_RECORD, (vpn, epoch, names, [int(n) for _, n in counts]))
            await conn.execute(_EMPTIED, (vpn, names))
            rows = await (await conn.execute(_QUEUES, (vpn,))).fetchall()
            plan = [_QueuePlan(str(q), int(n), bool(d)) for q, n, d in rows]
            self.total = sum(q.messages for q in plan)
            self.done = sum(q.messages for q in plan if q.done)
            await conn.execute(_TOTALS, (self.total, self.done, vpn, epoch))
        return plan

    async def _mark_done(self, q: _QueuePlan, published: int) -> None:
        """The queue is complete: done, and its count in the promotion's, at once."""
        if published != q.messages:
            log.warning(
                "VPN %r queue %r: %d live messages published, %d counted at the start",
                self.vpn,
                q.name,
                published,
                q.messages,
            )
        conn, vpn, epoch = self.conn, self.vpn, self.epoch
        async with conn.transaction():
            cur = await conn.execute(_MARK_DONE, (published, vpn, q.name, epoch))
            moved = cur.rowcount
            cur = await conn.execute(_ADD_DONE, (published, published - q.messages, vpn, epoch))
            if moved != 1 or cur.rowcount != 1:
                raise MaterialiseError(
                    f"queue {q.name!r}: the promotion of epoch {epoch} changed under this run "
                    "(superseded, or another run finished the queue)",
                    vpn,
                    queue=q.name,
                )
        self.total += published - q.messages
        self.done += published

    async def _read(
        self, queues: list[str], out: asyncio.Queue[_Item], stop: asyncio.Event
    ) -> None:
        """Feed ``out`` with each queue's rows in publish order, in batches of
        about ``_FETCH_BYTES``, and None after each queue; on its own
        connection, one transaction per queue. Ends with the error that
        stopped it, if one did, or early once ``stop`` is set (checked
        between batches: a task cancelled inside a psycopg call could leave
        its server cursor open, see :func:`_stop`)."""
        try:
            async with await self._connect_store() as conn:
                for queue in queues:
                    async with conn.transaction():
                        async with conn.cursor(name="vpnrepl_materialise", binary=True) as cur:
                            await cur.execute(_ROWS, (self.vpn, queue))
                            fetch = _FIRST_FETCH
                            while not stop.is_set() and (rows := await cur.fetchmany(fetch)):
                                batch, size = self._batch(queue, rows)
                                await out.put(batch)
                                fetch = max(1, min(_MAX_FETCH, _FETCH_BYTES * len(rows) // size))
                    if stop.is_set():
                        return
                    await out.put(None)
        except Exception as e:  # handed to the publishing side, raised there
            await out.put(e)

    def _batch(self, queue: str, rows: list[tuple[Any, ...]]) -> tuple[_Batch, int]:
        """(properties, body) pairs, persistent, and their size in bytes."""
        batch: _Batch = []
        size = 1
        for repl_id, properties, body in rows:
            try:
                properties = persistent_properties(properties)
            except ValueError as e:
                raise MaterialiseError(
                    f"queue {queue!r}: message {bytes(repl_id).hex()}: {e}",
                    self.vpn,
                    queue=queue,
                ) from e
            batch.append((properties, body))
            size += len(properties) + len(body)
        return batch, size

    # ------------------------------------------------------------ broker

    async def _connect(
        self, endpoint: Sequence[AmqpEndpoint], ssl_context: ssl.SSLContext | None
    ) -> BrokerPublisher:
        try:
            return await BrokerPublisher.connect(
                endpoint,
                self.vpn,
                ssl_context=ssl_context,
                connection_name=f"vpnrepl materialise {self.vpn}",
            )
        except NotAllowed as e:
            raise MaterialiseError(
                f"the broker at {endpoint[0]} refused vhost {self.vpn!r} ({e.reply_text}): the "
                "VPN's vhost and topology must be imported before promotion, with permissions "
                f"for {endpoint[0].username!r}",
                self.vpn,
            ) from e
        except AccessRefused as e:
            raise MaterialiseError(
                f"the broker at {endpoint[0]} refused the login ({e.reply_text})", self.vpn
            ) from e

    async def _empty(self, queue: str) -> int:
        """Empty ``queue`` before it is filled; returns what it held. A
        stream cannot be purged: it is declared again (through the API)."""
        if self.api is not None:
            held = await asyncio.to_thread(_empty_stream, self.api, self.vpn, queue)
            if held is not None:
                return held
        return await self.publisher.purge(queue)

    async def _check_queues(self, todo: list[_QueuePlan]) -> None:
        """Every queue to fill exists, before anything is purged or published."""
        missing = []
        for q in todo:
            try:
                await self.publisher.declare_passive(q.name)
            except NotFound:
                missing.append(q.name)
        if missing:
            names = ", ".join(repr(n) for n in missing)
            raise MaterialiseError(
                f"queue{'s' if len(missing) > 1 else ''} {names} hold live messages but are "
                f"not in vhost {self.vpn!r} and not in the definitions this site holds "
                "(declared at the active's broker directly, bypassing the listener, after its "
                "last listing): declare them on this site's broker with the type and arguments "
                "the clients use",
                self.vpn,
                queue=missing[0],
            )

    async def _materialise_queue(
        self, q: _QueuePlan, batches: asyncio.Queue[_Item]
    ) -> tuple[int, int]:
        """Purge, publish the rows (from ``batches``, the reader's), check the
        depth, mark done; returns (messages published, messages purged)."""
        t0 = time.monotonic()
        purged = await self._empty(q.name)  # what an interrupted run left
        for attempt in range(1, _ATTEMPTS + 1):
            if attempt == 1:
                published = await self._publish_rows(q.name, batches)
            else:  # the reader is past this queue: read it again on the side
                await self._empty(q.name)
                reread = _Reader(self._read, [q.name])
                try:
                    published = await self._publish_rows(q.name, reread.batches)
                finally:
                    await _stop(reread)
            depth = await self.publisher.declare_passive(q.name)
            if depth <= published:
                break
            log.warning(
                "VPN %r queue %r holds %d messages after %d were published: something else "
                "published to it (an interrupted run's connection?); purging it again "
                "(attempt %d of %d)",
                self.vpn,
                q.name,
                depth,
                published,
                attempt,
                _ATTEMPTS,
            )
        else:
            raise MaterialiseError(
                f"queue {q.name!r} holds {depth} messages after {published} were published, "
                f"{_ATTEMPTS} times: something else publishes to it; admit no clients before "
                "the promotion finishes",
                self.vpn,
                queue=q.name,
            )
        if depth < published:
            log.warning(
                "VPN %r queue %r holds %d of the %d messages published: the broker dropped "
                "the rest (message TTL or expiration, a length limit)",
                self.vpn,
                q.name,
                depth,
                published,
            )
        if purged:
            log.info("VPN %r queue %r: purged %d messages first", self.vpn, q.name, purged)
        await self._mark_done(q, published)
        self._report(force=True)
        log.info(
            "VPN %r queue %r: %d messages materialised in %.2f s",
            self.vpn,
            q.name,
            published,
            time.monotonic() - t0,
        )
        return published, purged

    async def _publish_rows(self, queue: str, batches: asyncio.Queue[_Item]) -> int:
        """Publish the queue's batches until its end marker; returns once
        every one is confirmed."""
        publisher = self.publisher
        published = 0
        while (batch := await batches.get()) is not None:
            if isinstance(batch, BaseException):
                raise batch
            await publisher.publish(queue, batch, self.window)
            published += len(batch)
            self._report(self.done + published - publisher.unconfirmed)
        await publisher.wait_confirmed()
        return published

    # ------------------------------------------------------------ progress

    def _report(self, done: int | None = None, *, force: bool = False) -> None:
        if self.progress is None:
            return
        done = self.done if done is None else done
        if force or done - self._reported >= self.window:
            self._reported = done
            self.progress(done, self.total)


class _Reader:
    """A :meth:`Materialiser._read` task with the means to stop it."""

    def __init__(self, read: Callable[..., Coroutine[Any, Any, None]], queues: list[str]) -> None:
        self.batches: asyncio.Queue[_Item] = asyncio.Queue(_READ_AHEAD)
        self.stopping = asyncio.Event()
        self.task = asyncio.create_task(read(queues, self.batches, self.stopping))


async def _stop(reader: _Reader) -> None:
    """Stop the reader without cancelling it inside a psycopg call (where
    psycopg cancels the query and the cursor can be left unclosed): set its
    flag and make room in its queue until it returns on its own."""
    reader.stopping.set()
    while not reader.task.done():
        with contextlib.suppress(asyncio.QueueEmpty):
            reader.batches.get_nowait()
        await asyncio.wait([reader.task], timeout=0.05)


def _pg_reason(e: psycopg.Error) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
