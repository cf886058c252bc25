"""Commit markers in the broker: how recovery learns whether RabbitMQ committed.

The listener publishes a transaction's id to :data:`MARKER_QUEUE` (durable,
classic) inside the client's own broker transaction, so the marker exists
exactly when the broker committed that transaction. This module declares the
queue, reads which markers are present, and removes the markers of
transactions that are over. It talks to the site's broker with pika (a
blocking connection run in a worker thread: markers are read at start and
swept now and then, never on a client's path).

Reading markers is a browse: every message is fetched unacknowledged and
requeued when the channel closes, so a read removes nothing. A sweep acks
the markers it was told to remove and requeues the rest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import pika
import pika.exceptions

from plugin._session import MARKER_QUEUE

__all__ = ["MARKER_QUEUE", "MarkerError", "MarkerStore"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class MarkerError(RuntimeError):
    """The broker could not be asked about markers (recovery waits and retries)."""


class MarkerStore:
    """Markers of every vhost of one broker (``amqp_url`` without a vhost path)."""

    def __init__(self, amqp_url: str) -> None:
        self.amqp_url = amqp_url
        self._declared: set[str] = set()

    def _params(self, vhost: str) -> pika.URLParameters:
        parts = urlsplit(self.amqp_url)
        url = urlunsplit(parts._replace(path="/" + quote(vhost, safe="")))
        params = pika.URLParameters(url)
        params.connection_attempts = 2
        params.socket_timeout = 10
        return params

    def _run(self, vhost: str, what: str, work: Callable[[Any], T]) -> T:
        try:
            with pika.BlockingConnection(self._params(vhost)) as conn:
                ch = conn.channel()
                ch.queue_declare(MARKER_QUEUE, durable=True, arguments={"x-queue-type": "classic"})
                return work(ch)
        except (pika.exceptions.AMQPError, OSError) as e:
            raise MarkerError(f"vhost {vhost!r}: cannot {what} commit markers: {e!r}") from e

    async def declare(self, vhost: str) -> None:
        """Make sure the marker queue exists (once per vhost and process)."""
        if vhost in self._declared:
            return
        await asyncio.to_thread(self._run, vhost, "declare", lambda ch: None)
        self._declared.add(vhost)

    async def present(self, vhost: str) -> set[str]:
        """The transaction ids whose markers are in the queue (nothing removed)."""
        return await asyncio.to_thread(self._run, vhost, "read", _browse)

    async def remove(self, vhost: str, txids: Collection[str]) -> int:
        """Ack the markers of ``txids``; requeue every other one. Returns how
        many were removed."""
        if not txids:
            return 0
        wanted = set(txids)
        return await asyncio.to_thread(self._run, vhost, "remove", lambda ch: _sweep(ch, wanted))


def _drain(ch: Any) -> list[tuple[int, str]]:
    """Every marker in the queue now, unacked: (delivery tag, txid)."""
    depth = ch.queue_declare(MARKER_QUEUE, passive=True).method.message_count
    got = []
    for _ in range(depth):
        method, _props, body = ch.basic_get(MARKER_QUEUE, auto_ack=False)
        if method is None:
            break
        got.append((method.delivery_tag, body.decode(errors="replace")))
    return got


def _browse(ch: Any) -> set[str]:
    found = {txid for _, txid in _drain(ch)}
    ch.close()  # every marker back to the queue
    return found


def _sweep(ch: Any, wanted: set[str]) -> int:
    removed = 0
    for tag, txid in _drain(ch):
        if txid in wanted:
            ch.basic_ack(tag)
            removed += 1
        else:
            ch.basic_nack(tag, requeue=True)
    return removed
