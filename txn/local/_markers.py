"""Commit markers in the broker: how recovery learns whether RabbitMQ committed.

The listener publishes a transaction's id to :data:`~bridge.MARKER_QUEUE`
inside the client's own broker transaction, so the marker exists exactly
when the broker committed it. That queue is a **stream**: it lives on every
node of a RabbitMQ cluster (a replicated log, like a quorum queue), and
reading it is no delivery, so a lookup counts against no delivery limit and
takes nothing away from another reader. Nothing removes a marker; the
stream's retention (:data:`MARKER_ARGUMENTS`, two days) drops old segments.

A lookup reads from a time (the transaction's ``txn_log`` row, less
:data:`CLOCK_SLACK_SECONDS` for the clocks of PostgreSQL and the broker)
to the end: it first publishes a probe (a marker of its own, confirmed),
then reads until the probe comes back, so every marker the broker held
before the lookup began is seen. A probe that does not come (PostgreSQL's
clock ahead of the broker's by more than the slack) makes it read the
whole stream instead, with a warning: slower, never wrong. A marker's body is its name and
a :class:`~txn._marker_key.MarkerKey` tag, so a message a client routed
there is no marker (:data:`MarkerStore.forged`); ``<txid>#restored``
(:func:`restored_marker`) goes with the messages a promoted site puts back
at an XA rollback (README, "Client XA transactions"). This module uses pika
in a worker thread, never on a client's path.

Releases before the stream kept markers in the classic queue
:data:`LEGACY_MARKER_QUEUE`; while a vhost still has it, lookups read it too
(browsing: delivered, then requeued), recovery acks the markers no prepared
transaction needs (:meth:`MarkerStore.retire_legacy`), the sweep acks those
of transactions decided since, and the queue is deleted once empty.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from datetime import UTC, datetime
from typing import Any, Final, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import pika
import pika.exceptions
import psycopg

from bridge import MARKER_QUEUE
from txn._marker_key import MarkerKey

__all__ = [
    "CLOCK_SLACK_SECONDS",
    "LEGACY_MARKER_QUEUE",
    "MARKER_ARGUMENTS",
    "MARKER_RETENTION_SECONDS",
    "MarkerError",
    "MarkerStore",
    "load_marker_key",
    "marker_txid",
    "restored_marker",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: how long the stream keeps a marker (``x-max-age``; RabbitMQ drops whole
#: segments, so a marker may stay up to a segment longer)
MARKER_RETENTION_SECONDS: Final = 2 * 86400
#: the marker stream's arguments (a redeclaration must repeat them exactly)
MARKER_ARGUMENTS: Final[dict[str, Any]] = {
    "x-queue-type": "stream",
    "x-max-age": "2D",
    "x-stream-max-segment-size-bytes": 8_000_000,
}
#: a lookup reads from this long before the transaction began: the
#: transaction's start is stamped by this node or by PostgreSQL, a marker's
#: place in the stream by the broker's clock
CLOCK_SLACK_SECONDS: Final = 120.0
#: the classic queue of releases before the stream
LEGACY_MARKER_QUEUE: Final = "vpnrepl.txn-markers"
#: a lookup gives up when the stream sends nothing for this long
READ_IDLE_SECONDS: Final = 10.0
#: a read from a time that has not met its probe after this long (the
#: start fell after the probe, on a stream busy enough never to go idle)
#: reads from the stream's start instead
READ_DEADLINE_SECONDS: Final = 60.0
#: markers in flight to a lookup (it acks every half of them)
READ_PREFETCH: Final = 2000

#: a promoted site's rollback of a branch whose acks it held publishes the
#: held messages with the marker ``<txid>#restored``: a repeated rollback
#: (after a crash) that finds it publishes nothing
_RESTORED = "#restored"
#: a lookup's own probe: a marker named ``#probe/<uuid>`` (no transaction's)
_PROBE = "#probe/"


def restored_marker(txid: str) -> str:
    """The marker of ``txid``'s held messages put back in the broker."""
    return txid + _RESTORED


def marker_txid(name: str) -> str:
    """The transaction a marker named ``name`` is for."""
    return name.removesuffix(_RESTORED)


async def load_marker_key(dsn: str) -> MarkerKey:
    """The site's marker key (table ``marker_key``, made by ``vpnrepl init``).

    Raises :class:`psycopg.errors.UndefinedTable` on a schema older than the
    key, and :class:`LookupError` when its row is gone."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT secret, signs_from FROM marker_key")
        row = await cur.fetchone()
    if row is None:
        raise LookupError("table marker_key has no row")
    return MarkerKey(bytes(row[0]), int(row[1]))


class MarkerError(RuntimeError):
    """The broker could not be asked about markers (recovery waits and retries)."""


class MarkerStore:
    """Markers of every vhost of the site's broker (``amqp_url`` without a
    vhost path; a cluster's nodes, tried in order, the next when one cannot
    be reached)."""

    def __init__(
        self,
        amqp_url: str | Sequence[str],
        ssl_context: ssl.SSLContext | None = None,
        key: MarkerKey | None = None,
    ) -> None:
        self.amqp_urls = (amqp_url,) if isinstance(amqp_url, str) else tuple(amqp_url)
        #: verifies an ``amqps://`` broker (None: pika's default, the system's CAs)
        self.ssl_context = ssl_context
        #: tags and checks the markers (the node sets its site's at start;
        #: without one, a key of this process alone)
        self.key = key or MarkerKey.new()
        #: vhost -> messages in its marker stream (or legacy queue) that were
        #: no marker of this site (forged), each counted once
        self.forged: Counter[str] = Counter()
        self._forged_upto: dict[str, int] = {}  # vhost -> stream offset counted up to
        self._declared: set[str] = set()
        self._legacy: set[str] = set()  # vhosts whose legacy queue is still there
        self._looked: set[str] = set()  # vhosts whose legacy queue was looked for
        self._lock = threading.Lock()  # one legacy browse at a time; the forged offsets
        self._count_lock = threading.Lock()  # the forged counts, added from worker threads

    def _params(self, vhost: str) -> list[pika.URLParameters]:
        """Each broker node's connection parameters (pika tries them in turn)."""
        nodes = []
        for amqp_url in self.amqp_urls:
            parts = urlsplit(amqp_url)
            url = urlunsplit(parts._replace(path="/" + quote(vhost, safe="")))
            params = pika.URLParameters(url)
            if params.ssl_options is not None and self.ssl_context is not None:
                params.ssl_options = pika.SSLOptions(self.ssl_context, parts.hostname)
            params.connection_attempts = 2 if len(self.amqp_urls) == 1 else 1
            params.socket_timeout = 10
            # a resource alarm blocks publishers: a probe waits this long at most
            params.blocked_connection_timeout = 30
            nodes.append(params)
        return nodes

    def _run(self, vhost: str, what: str, work: Callable[[Any], T], stream: bool = True) -> T:
        """``work`` on a connection to ``vhost``, the stream declared first
        (unless not ``stream``: work on the legacy queue alone)."""
        try:
            with pika.BlockingConnection(self._params(vhost)) as conn:
                if stream:
                    conn.channel().queue_declare(
                        MARKER_QUEUE, durable=True, arguments=MARKER_ARGUMENTS
                    )
                return work(conn)
        except (pika.exceptions.AMQPError, OSError, TimeoutError) as e:
            raise MarkerError(f"vhost {vhost!r}: cannot {what} commit markers: {e!r}") from e

    def declared(self, vhost: str) -> bool:
        """Whether :meth:`declare` made sure of ``vhost``'s stream already."""
        return vhost in self._declared

    async def declare(self, vhost: str) -> None:
        """Make sure the marker stream exists, and learn whether the legacy
        queue does (once per vhost and process)."""
        if vhost in self._declared:
            return
        legacy = await asyncio.to_thread(self._run, vhost, "declare", _has_legacy)
        self._learn_legacy(vhost, legacy)
        self._declared.add(vhost)

    def _learn_legacy(self, vhost: str, there: bool) -> None:
        if vhost not in self._looked:
            self._looked.add(vhost)
            if there:
                self._legacy.add(vhost)

    def body(self, vhost: str, name: str) -> bytes:
        """The message body of marker ``name`` in ``vhost``'s marker stream."""
        return self.key.body(vhost, name)

    async def present(
        self, vhost: str, since: float, wanted: Collection[str] | None = None
    ) -> set[str]:
        """The markers published since ``since`` (seconds since the epoch;
        read from :data:`CLOCK_SLACK_SECONDS` earlier), and every one in the
        legacy queue; forged ones are not markers. With ``wanted``, only
        those of its names (kept in memory, and the read ends once it found
        them all)."""
        await self.declare(vhost)
        only = None if wanted is None else frozenset(wanted)
        names = await asyncio.to_thread(
            self._run, vhost, "read", lambda conn: self._read(conn, vhost, since, only)
        )
        if vhost in self._legacy:
            read = self._reader(vhost)
            names |= await asyncio.to_thread(
                self._run, vhost, "read", lambda conn: self._browse_legacy(conn, vhost, read)
            )
        return names if only is None else names & only

    def _reader(self, vhost: str) -> Callable[[bytes], str | None]:
        return lambda body: self.key.name_of(vhost, body)

    def _read(self, conn: Any, vhost: str, since: float, wanted: frozenset[str] | None) -> set[str]:
        """Every marker from ``since`` (less the slack) up to a probe this
        lookup published first; from the stream's start if the probe does
        not come (the transaction's time is ahead of the broker's clock)."""
        probe = self.body(vhost, f"{_PROBE}{uuid.uuid4()}")
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", MARKER_QUEUE, probe, pika.BasicProperties(delivery_mode=2))
        start = datetime.fromtimestamp(since - CLOCK_SLACK_SECONDS, UTC)
        found = self._scan(conn, ch, vhost, start, probe, wanted)
        if found is None:
            log.warning(
                "vhost %r: a commit-marker lookup from %s saw nothing for %.0f s, not even "
                "its probe: the site's PostgreSQL clock is ahead of RabbitMQ's by more than "
                "%.0f s; reading the markers' stream from its start instead",
                vhost,
                start.isoformat(),
                READ_IDLE_SECONDS,
                CLOCK_SLACK_SECONDS,
            )
            found = self._scan(conn, conn.channel(), vhost, "first", probe, wanted)
        if found is None:
            raise TimeoutError(f"the probe never came back from {MARKER_QUEUE}")
        names, forged = found
        with self._lock:  # each forged message counted once, by whichever read saw it first
            upto = self._forged_upto.get(vhost, -1)
            new = sum(offset > upto for offset in forged)
            if new:
                self._forged_upto[vhost] = max(forged)
        if new:
            self._count_forged(vhost, new, "found")
        return names

    def _scan(
        self,
        conn: Any,
        ch: Any,
        vhost: str,
        offset: datetime | str,
        probe: bytes,
        wanted: frozenset[str] | None,
    ) -> tuple[set[str], list[int]] | None:
        """The markers from ``offset`` to ``probe``, and the stream offsets
        of the messages there that are no marker; None when the stream
        sends nothing for :data:`READ_IDLE_SECONDS` before the probe, or a
        read from a time does not meet it within :data:`READ_DEADLINE_SECONDS`."""
        deadline = None if offset == "first" else time.monotonic() + READ_DEADLINE_SECONDS
        ch.basic_qos(prefetch_count=READ_PREFETCH)
        names: set[str] = set()
        forged: list[int] = []
        unacked = 0
        try:
            for method, props, body in ch.consume(
                MARKER_QUEUE,
                arguments={"x-stream-offset": offset},
                inactivity_timeout=READ_IDLE_SECONDS,
            ):
                if method is None:
                    return None
                unacked += 1
                if unacked >= READ_PREFETCH // 2:
                    ch.basic_ack(method.delivery_tag, multiple=True)
                    unacked = 0
                if body == probe:
                    return names, forged
                if deadline is not None and time.monotonic() > deadline:
                    return None
                name = self.key.name_of(vhost, body)
                if name is None:
                    forged.append(int((props.headers or {}).get("x-stream-offset", -1)))
                elif not name.startswith(_PROBE) and (wanted is None or name in wanted):
                    names.add(name)
                    if wanted is not None and len(names) == len(wanted):
                        return names, forged  # all found: the rest cannot change the answer
            return None  # the consumer was cancelled
        finally:
            _abandon(conn, ch)

    def _count_forged(self, vhost: str, forged: int, how: str) -> None:
        with self._count_lock:
            self.forged[vhost] += forged
        log.warning(
            "vhost %r: %s %d message(s) among the commit markers that were no marker of "
            "this site (routed there by a client?)",
            vhost,
            how,
            forged,
        )

    def _browse_legacy(
        self, conn: Any, vhost: str, read: Callable[[bytes], str | None]
    ) -> set[str]:
        with self._lock:
            ch = conn.channel()
            try:
                got = _drain(ch)
            except pika.exceptions.ChannelClosedByBroker as e:
                if e.reply_code != 404:
                    raise
                self._legacy.discard(vhost)  # retired meanwhile: nothing in it
                return set()
            if got:
                _give_back(ch, got[-1][0])  # every marker back to the queue
        return {name for _, body in got if (name := read(body)) is not None}

    async def retire_legacy(self, vhost: str, keep: Collection[str]) -> bool:
        """Ack the legacy queue's markers but those of transactions in
        ``keep`` (still prepared: their markers still prove a commit), and
        delete the queue once it is empty. True when ``vhost`` has no legacy
        queue any more."""
        if vhost not in self._looked:  # a VPN with no transaction yet gets no stream here
            there = await asyncio.to_thread(self._run, vhost, "read", _has_legacy, False)
            self._learn_legacy(vhost, there)
        if vhost not in self._legacy:
            return True
        read = self._reader(vhost)

        def needless(body: bytes) -> bool:
            name = read(body)
            return name is None or marker_txid(name) not in keep

        await asyncio.to_thread(
            self._run, vhost, "remove", lambda c: self._sweep(c, vhost, needless), False
        )
        return vhost not in self._legacy

    async def remove(self, vhost: str, txids: Collection[str]) -> int:
        """Ack the legacy queue's markers of ``txids`` and every forged one
        (a stream's markers stay until its retention drops them); returns
        how many markers of ``txids`` were removed."""
        if not txids or vhost not in self._legacy:
            return 0
        wanted, read = set(txids), self._reader(vhost)
        removed = 0

        def needless(body: bytes) -> bool:
            nonlocal removed
            name = read(body)
            removed += name in wanted
            return name is None or name in wanted

        await asyncio.to_thread(
            self._run, vhost, "remove", lambda c: self._sweep(c, vhost, needless), False
        )
        return removed

    def _sweep(self, conn: Any, vhost: str, needless: Callable[[bytes], bool]) -> None:
        """Ack the legacy markers ``needless`` names (and count the forged
        ones), requeue the others, and delete the queue if that emptied it."""
        read = self._reader(vhost)
        with self._lock:
            ch = conn.channel()
            forged = _sweep(ch, needless, read)
            try:
                ch.queue_delete(LEGACY_MARKER_QUEUE, if_empty=True, if_unused=True)
            except pika.exceptions.ChannelClosedByBroker as e:
                if e.reply_code != 406:  # PRECONDITION_FAILED: not empty or in use yet
                    raise
            else:
                self._legacy.discard(vhost)
                log.info("vhost %r: the classic queue %s is retired", vhost, LEGACY_MARKER_QUEUE)
        if forged:
            self._count_forged(vhost, forged, "removed")


def _abandon(conn: Any, ch: Any) -> None:
    """Close a stream reader's channel, dropping the deliveries in flight.

    pika's ``BlockingChannel.cancel`` and ``close`` first reject what they
    hold (``basic.reject``, requeue), which a stream answers by closing the
    whole connection (540 NOT_IMPLEMENTED); the underlying channel is closed
    directly instead: it cancels the consumer and rejects nothing while it
    closes, and a stream has nothing to requeue."""
    impl = ch._impl  # noqa: SLF001 - see above
    impl.close()
    deadline = time.monotonic() + READ_IDLE_SECONDS
    while not impl.is_closed:
        if time.monotonic() > deadline:
            raise TimeoutError("the marker stream's channel did not close")
        conn.process_data_events(time_limit=0.1)


def _has_legacy(conn: Any) -> bool:
    try:
        conn.channel().queue_declare(LEGACY_MARKER_QUEUE, passive=True)
    except pika.exceptions.ChannelClosedByBroker as e:
        if e.reply_code == 404:
            return False
        raise
    return True


#: markers one sweep takes at most (the rest wait for the next sweep)
SWEEP_LIMIT = 10_000
#: a drain stops waiting for the markers it counted after this long
DRAIN_IDLE_SECONDS = 5.0


def _drain(ch: Any, limit: int | None = None) -> list[tuple[int, bytes]]:
    """The legacy queue's messages now (at most ``limit``), delivered and
    not acked: (delivery tag, body)."""
    depth = ch.queue_declare(LEGACY_MARKER_QUEUE, passive=True).method.message_count
    wanted = depth if limit is None else min(depth, limit)
    got: list[tuple[int, bytes]] = []
    if wanted == 0:
        return got
    ch.basic_qos(prefetch_count=0 if limit is None else wanted)
    for method, _props, body in ch.consume(
        LEGACY_MARKER_QUEUE, inactivity_timeout=DRAIN_IDLE_SECONDS
    ):
        if method is None:
            break
        got.append((method.delivery_tag, body))
        if len(got) >= wanted:
            break
    ch.cancel()  # deliveries beyond ``wanted`` go back to the queue
    return got


def _give_back(ch: Any, tag: int) -> None:
    """Requeue every marker up to ``tag`` still held, and return once the
    classic queue has them back (it answers the depth after the requeue)."""
    ch.basic_nack(delivery_tag=tag, multiple=True, requeue=True)
    ch.queue_declare(LEGACY_MARKER_QUEUE, passive=True)


def _sweep(ch: Any, needless: Callable[[bytes], bool], read: Callable[[bytes], str | None]) -> int:
    """Ack the drained markers ``needless`` names, requeue the others: one
    ``multiple`` ack or nack per run of like markers (the drained tags
    ascend and the earlier runs are settled, so ``multiple`` at a run's
    last tag settles exactly that run). Returns how many were forged."""
    forged = 0
    run: tuple[bool, int] | None = None  # (remove?, last tag) of the run unsettled
    for tag, body in _drain(ch, SWEEP_LIMIT):
        remove = needless(body)
        forged += read(body) is None
        if run is not None and run[0] != remove:
            _settle(ch, *run)
        run = (remove, tag)
    if run is not None:
        _settle(ch, *run)
    ch.queue_declare(LEGACY_MARKER_QUEUE, passive=True)  # the requeued ones are back
    return forged


def _settle(ch: Any, remove: bool, tag: int) -> None:
    if remove:
        ch.basic_ack(tag, multiple=True)
    else:
        ch.basic_nack(tag, multiple=True, requeue=True)
