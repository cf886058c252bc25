"""The node's own publishes for client XA: answers, and branches from their rows.

:class:`ReplyPublisher` sends XA answers to the requesting connection's
reply queue: one connection per vhost with the node's broker user, kept
open, a confirm channel whose confirms are not awaited (an answer that is
lost makes the client's call time out, which its transaction manager
treats as a failure and recovers from).

:class:`BranchPublisher` is ``txn``'s :class:`~txn.LogPublisher`: it
publishes a prepared branch's messages from its row, byte for byte as the
client published them (stored properties, replication id included), into
their queues and the branch's commit marker into the marker queue, in one
broker transaction: the marker is there exactly when the messages are, so
a repeated commit that finds it publishes nothing. On a promoted site it
also puts back the messages a rolled-back branch had acked, with the
branch's restore marker in the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Sequence

import psycopg
from pamqp import commands
from psycopg.rows import tuple_row

from bridge import MARKER_QUEUE, Consumed, DeadLettered, Published
from bridge.amqp import AmqpEndpoint, AMQPError, persistent_properties
from bridge.broker import BrokerPublisher
from txn.local import MarkerStore, restored_marker

__all__ = ["BranchPublisher", "ReplyPublisher"]

log = logging.getLogger(__name__)

#: no window on a transactional channel: nothing is confirmed there
_NO_WINDOW = 1 << 30
_MARKER_PROPERTIES = commands.Basic.Properties(delivery_mode=2).marshal()
_LIVE = """
SELECT queue, properties, body FROM live_message
WHERE vpn = %s AND repl_id = %s AND queue = %s
"""


class ReplyPublisher:
    """XA answers, one kept connection per vhost."""

    def __init__(self, amqp_urls: Sequence[str], ssl_context: ssl.SSLContext | None = None) -> None:
        self.endpoint = [AmqpEndpoint.from_url(url) for url in amqp_urls]
        self.ssl_context = ssl_context
        self._publishers: dict[str, BrokerPublisher] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def send(self, vhost: str, queue: str, correlation_id: str, body: bytes) -> None:
        properties = commands.Basic.Properties(
            correlation_id=correlation_id, content_type="application/json"
        ).marshal()
        lock = self._locks.setdefault(vhost, asyncio.Lock())
        async with lock:
            for attempt in (1, 2):  # a kept connection may have died meanwhile
                publisher = await self._publisher(vhost)
                try:
                    await publisher.publish(queue, [(properties, body)], _NO_WINDOW)
                    return
                except AMQPError:
                    self._publishers.pop(vhost, None)
                    publisher.abort()
                    if attempt == 2:
                        raise

    async def _publisher(self, vhost: str) -> BrokerPublisher:
        publisher = self._publishers.get(vhost)
        if publisher is None:
            publisher = await BrokerPublisher.connect(
                self.endpoint,
                vhost,
                ssl_context=self.ssl_context,
                connect_timeout=10,
                connection_name="vpnrepl xa answers",
            )
            self._publishers[vhost] = publisher
        return publisher

    async def close(self) -> None:
        publishers, self._publishers = self._publishers, {}
        for publisher in publishers.values():
            with contextlib.suppress(AMQPError, OSError):
                await publisher.close()


class BranchPublisher:
    """Publishes prepared branches from their rows (``txn.LogPublisher``)."""

    def __init__(
        self,
        amqp_urls: Sequence[str],
        store_dsn: str,
        markers: MarkerStore,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.endpoint = [AmqpEndpoint.from_url(url) for url in amqp_urls]
        self.store_dsn = store_dsn
        self.markers = markers
        self.ssl_context = ssl_context

    async def _connect(self, vhost: str, transactional: bool) -> BrokerPublisher:
        return await BrokerPublisher.connect(
            self.endpoint,
            vhost,
            ssl_context=self.ssl_context,
            connect_timeout=10,
            connection_name="vpnrepl xa commit",
            transactional=transactional,
        )

    async def publish(
        self, vpn: str, txid: str, messages: Sequence[Published], since: float
    ) -> None:
        published = await self._with_marker(
            vpn,
            txid,
            since,
            [
                (queue, persistent_properties(message.properties), message.body)
                for message in messages
                for queue in message.queues
            ],
        )
        if not published:
            log.info("VPN %s: XA branch %s reached the broker already", vpn, txid)
            return
        log.info(
            "VPN %s: XA branch %s: %d message(s) published from its prepared row",
            vpn,
            txid,
            len(messages),
        )

    async def restore(
        self, vpn: str, txid: str, consumed: Sequence[Consumed | DeadLettered], since: float
    ) -> int:
        rows: list[tuple[str, bytes, bytes]] = []
        async with await psycopg.AsyncConnection.connect(self.store_dsn) as conn:
            cur = conn.cursor(row_factory=tuple_row)
            for event in consumed:
                await cur.execute(_LIVE, (vpn, event.repl_id.value, event.queue))
                rows.extend(
                    (str(queue), persistent_properties(bytes(properties)), bytes(body))
                    for queue, properties, body in await cur.fetchall()
                )
        if not await self._with_marker(vpn, restored_marker(txid), since, rows):
            log.info("VPN %s: XA branch %s: its held messages were put back already", vpn, txid)
            return 0
        return len(rows)

    async def _with_marker(
        self, vpn: str, marker: str, since: float, messages: Sequence[tuple[str, bytes, bytes]]
    ) -> bool:
        """``messages`` (queue, properties, body) and the marker ``marker``
        in one broker transaction; nothing (False) when ``marker`` is there
        already (published after ``since``)."""
        if marker in await self.markers.present(vpn, since, {marker}):
            return False
        async with await self._connect(vpn, transactional=True) as publisher:
            for queue, properties, body in messages:
                await publisher.publish(queue, [(properties, body)], _NO_WINDOW)
            marked = [(_MARKER_PROPERTIES, self.markers.body(vpn, marker))]
            await publisher.publish(MARKER_QUEUE, marked, _NO_WINDOW)
            await publisher.commit()
        return True
