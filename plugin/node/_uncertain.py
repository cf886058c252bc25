"""Uncertain publishes: replicated, but the broker died before confirming them.

A replicated publish is in the ledger (and soon in both sites' live state)
before the broker confirms it. When the broker connection of a client dies
without a close — the broker crashed, the network went — the listener
holds confirms the broker never sent: the client was told nothing, and the
broker may or may not have enqueued those messages. Where it did not, the
message lives on in the live state of both sites with no broker copy: a
*phantom*, which no consumer will ever ack and which a promotion would
publish.

The listener hands such publishes here (:meth:`UncertainLog.record`), one
row per message and queue in ``uncertain_publish``. ``status`` counts the
ones still live (``uncertain_publishes``), ``/metrics`` exports the count,
and ``vpnrepl reconcile`` sets them against the broker's drift: in a queue
whose broker holds exactly that many messages fewer than the live state in
both readings, every uncertain message is a phantom, and ``--repair``
retires them (the node's ``retire-uncertain`` request,
:func:`plugin.ops._node_requests.retire`): their consumption goes into the
ledger, so both sites drop them. Where the count does not match, which ones the
broker holds cannot be told, and they stay, counted, until consumed (a
message that is in the broker is consumed normally, and its row stops
counting).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import psycopg

from bridge import Published

__all__ = ["UncertainLog"]

log = logging.getLogger(__name__)

_RECORD = """
INSERT INTO uncertain_publish (vpn, queue, repl_id)
SELECT v, q, r FROM unnest(%s::text[], %s::text[], %s::bytea[]) AS t(v, q, r)
ON CONFLICT DO NOTHING
"""


class UncertainLog:
    """Writes uncertain publishes in the background (a client's broker dying
    is no moment to wait for a database)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._rows: list[tuple[str, str, bytes]] = []
        self._task: asyncio.Task[None] | None = None

    def record(self, events: Sequence[Published]) -> None:
        for event in events:
            for queue in event.queues:
                self._rows.append((event.vpn, queue, event.repl_id.value))
        if events:
            log.warning(
                "VPN %s: %d replicated publish(es) unconfirmed when the broker connection"
                " died: recorded as uncertain",
                events[0].vpn,
                len(events),
            )
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        while self._rows:
            rows, self._rows = self._rows, []
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.dsn, autocommit=True, connect_timeout=10
                ) as conn:
                    await conn.execute(_RECORD, tuple(list(c) for c in zip(*rows, strict=True)))
            except psycopg.Error as e:
                log.warning("%d uncertain publish(es) not recorded: %s", len(rows), e)
                return

    async def close(self) -> None:
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)
