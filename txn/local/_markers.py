"""Commit markers in the broker: how recovery learns whether RabbitMQ committed.

The listener publishes a transaction's id to :data:`MARKER_QUEUE` inside the
client's own broker transaction, so the marker exists exactly when the broker
committed it. This module declares the queue, reads which markers are there
and removes those of transactions that are over, with pika in a worker
thread, never on a client's path. A read browses (delivered unacked, then
requeued), a sweep acks what it removes; both consume, since a ``basic.get``
per marker cost about a twelfth of a transactional active's busy CPU.

A marker one reader holds is invisible to another, and a missed marker
aborts its transaction, so reads never overlap (a lock) and each gives back
what it held before it ends: ``basic.nack`` to requeue, then the queue's
depth asked on the same channel, which the queue answers only once it took
the markers back (it takes one channel's messages in order; a channel close
alone would requeue later). A marker's body is its name and a
:class:`~txn._marker_key.MarkerKey` tag, so a message a client routed there
is no marker (:data:`MarkerStore.forged`); ``<txid>#restored``
(:func:`restored_marker`) goes with the messages a promoted site puts back
at an XA rollback (README, "Client XA transactions").
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import pika
import pika.exceptions
import psycopg

from bridge import MARKER_QUEUE
from txn._marker_key import MarkerKey

__all__ = ["MarkerError", "MarkerStore", "load_marker_key", "marker_txid", "restored_marker"]

log = logging.getLogger(__name__)

T = TypeVar("T")


#: a promoted site's rollback of a branch whose acks it held publishes the
#: held messages with the marker ``<txid>#restored``: a repeated rollback
#: (after a crash) that finds it publishes nothing
_RESTORED = "#restored"


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
        #: vhost -> messages in its marker queue that were no marker of this
        #: site (forged), removed by a sweep
        self.forged: Counter[str] = Counter()
        self._declared: set[str] = set()
        self._lock = threading.Lock()  # one read of the markers at a time

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
            nodes.append(params)
        return nodes

    def _run(self, vhost: str, what: str, work: Callable[[Any], T]) -> T:
        try:
            with self._lock, pika.BlockingConnection(self._params(vhost)) as conn:
                ch = conn.channel()
                ch.queue_declare(MARKER_QUEUE, durable=True, arguments={"x-queue-type": "classic"})
                return work(ch)
        except (pika.exceptions.AMQPError, OSError) as e:
            raise MarkerError(f"vhost {vhost!r}: cannot {what} commit markers: {e!r}") from e

    def declared(self, vhost: str) -> bool:
        """Whether :meth:`declare` made sure of ``vhost``'s queue already."""
        return vhost in self._declared

    async def declare(self, vhost: str) -> None:
        """Make sure the marker queue exists (once per vhost and process)."""
        if vhost in self._declared:
            return
        await asyncio.to_thread(self._run, vhost, "declare", lambda ch: None)
        self._declared.add(vhost)

    def body(self, vhost: str, name: str) -> bytes:
        """The message body of marker ``name`` in ``vhost``'s marker queue."""
        return self.key.body(vhost, name)

    def _reader(self, vhost: str) -> Callable[[bytes], str | None]:
        return lambda body: self.key.name_of(vhost, body)

    async def present(self, vhost: str) -> set[str]:
        """The markers in the queue (nothing removed); forged ones are not."""
        read = self._reader(vhost)
        return await asyncio.to_thread(self._run, vhost, "read", lambda ch: _browse(ch, read))

    async def remove(self, vhost: str, txids: Collection[str]) -> int:
        """Ack the markers of ``txids`` and every forged one; requeue every
        other one. Returns how many markers of ``txids`` were removed."""
        if not txids:
            return 0
        wanted, read = set(txids), self._reader(vhost)
        removed, forged = await asyncio.to_thread(
            self._run, vhost, "remove", lambda ch: _sweep(ch, wanted, read)
        )
        if forged:
            self.forged[vhost] += forged
            log.warning(
                "vhost %r: removed %d message(s) from %s that were no commit marker of "
                "this site (routed there by a client?)",
                vhost,
                forged,
                MARKER_QUEUE,
            )
        return removed


#: markers one sweep takes at most (the rest wait for the next sweep)
SWEEP_LIMIT = 10_000
#: a drain stops waiting for the markers it counted after this long
DRAIN_IDLE_SECONDS = 5.0


def _drain(ch: Any, limit: int | None = None) -> list[tuple[int, bytes]]:
    """The messages in the queue now (at most ``limit``), delivered and not
    acked: (delivery tag, body). A marker another reader holds meanwhile is
    simply not seen (the drain stops when the deliveries pause)."""
    depth = ch.queue_declare(MARKER_QUEUE, passive=True).method.message_count
    wanted = depth if limit is None else min(depth, limit)
    got: list[tuple[int, bytes]] = []
    if wanted == 0:
        return got
    ch.basic_qos(prefetch_count=0 if limit is None else wanted)
    for method, _props, body in ch.consume(MARKER_QUEUE, inactivity_timeout=DRAIN_IDLE_SECONDS):
        if method is None:
            break
        got.append((method.delivery_tag, body))
        if len(got) >= wanted:
            break
    ch.cancel()  # deliveries beyond ``wanted`` go back to the queue
    return got


def _give_back(ch: Any, tag: int) -> None:
    """Requeue every marker up to ``tag`` still held, and return once the
    queue has them back (see the module docstring)."""
    ch.basic_nack(delivery_tag=tag, multiple=True, requeue=True)
    ch.queue_declare(MARKER_QUEUE, passive=True)


def _browse(ch: Any, read: Callable[[bytes], str | None]) -> set[str]:
    got = _drain(ch)
    if got:
        _give_back(ch, got[-1][0])  # every marker back to the queue
    return {name for _, body in got if (name := read(body)) is not None}


def _sweep(ch: Any, wanted: set[str], read: Callable[[bytes], str | None]) -> tuple[int, int]:
    """Ack the drained markers of ``wanted`` and the forged ones (``read``
    gives None), requeue the others: one
    ``multiple`` ack or nack per run of like markers (the drained tags
    ascend and the earlier runs are settled, so ``multiple`` at a run's
    last tag settles exactly that run), not a frame and a flush per marker."""
    removed = forged = 0
    run: tuple[bool, int] | None = None  # (remove?, last tag) of the run unsettled
    for tag, body in _drain(ch, SWEEP_LIMIT):
        name = read(body)
        remove = name is None or name in wanted
        removed += name is not None and remove
        forged += name is None
        if run is not None and run[0] != remove:
            _settle(ch, *run)
        run = (remove, tag)
    if run is not None:
        _settle(ch, *run)
    ch.queue_declare(MARKER_QUEUE, passive=True)  # the requeued ones are back
    return removed, forged


def _settle(ch: Any, remove: bool, tag: int) -> None:
    if remove:
        ch.basic_ack(tag, multiple=True)
    else:
        ch.basic_nack(tag, multiple=True, requeue=True)
