"""The client's XA resource: replicated broker work in a global transaction.

:class:`XAResource` speaks :mod:`txn.xa._wire` over a pika
``BlockingConnection`` opened through the listener, with the verbs of X/Open
XA and DB-API's TPC, so a transaction manager can drive it next to a
database (README, "Client XA transactions", shows how). An answer that does
not come within ``timeout`` raises :class:`~txn.xa._wire.XaResourceFailure`:
the manager then treats the branch as in doubt and asks
:meth:`XAResource.recover` later, from any connection to the VPN.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pika
import pika.channel
from pika.adapters.blocking_connection import BlockingChannel

from txn.xa import XA_EXCHANGE, Verb, XaReply, XaRequest, XaResourceFailure, Xid

__all__ = ["XA_OK", "XA_RDONLY", "XAResource"]

#: prepare's votes, as X/Open XA numbers them
XA_OK, XA_RDONLY = 0, 3


class XAResource:
    """XA verbs for the VPN of ``connection`` (a pika ``BlockingConnection``
    to the listener). Answers come to an exclusive queue of that
    connection, read on a channel of its own."""

    def __init__(self, connection: pika.BlockingConnection, *, timeout: float = 30.0) -> None:
        self.connection = connection
        self.timeout = timeout
        self._control = connection.channel()
        declared = self._control.queue_declare("", exclusive=True, auto_delete=True)
        self.reply_queue: str = declared.method.queue
        self._answers: dict[str, bytes] = {}
        self._control.basic_consume(self.reply_queue, self._answered, auto_ack=True)
        self._transactional: set[int] = set()
        self._channels: dict[Xid, BlockingChannel] = {}

    def _answered(
        self, _ch: Any, _method: Any, properties: pika.BasicProperties, body: bytes
    ) -> None:
        if properties.correlation_id:
            self._answers[properties.correlation_id] = body

    def _call(
        self,
        verb: Verb,
        xid: Xid | None = None,
        *,
        channel: BlockingChannel | None = None,
        one_phase: bool = False,
        fail: bool = False,
    ) -> XaReply:
        correlation = uuid.uuid4().hex
        request = XaRequest(verb, xid, correlation, self.reply_queue, one_phase, fail)
        on = channel if channel is not None else self._control
        on.basic_publish(
            XA_EXCHANGE,
            verb.value,
            request.body(),
            pika.BasicProperties(correlation_id=correlation, reply_to=self.reply_queue),
        )
        deadline = time.monotonic() + self.timeout
        while correlation not in self._answers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise XaResourceFailure(f"no answer to XA {verb.value} within {self.timeout} s")
            self.connection.process_data_events(time_limit=min(left, 1.0))
        reply = XaReply.decode(self._answers.pop(correlation))
        reply.raise_for_code()
        return reply

    def start(self, xid: Xid, channel: BlockingChannel) -> None:
        """Branch ``xid``'s work is what ``channel`` publishes and acks from
        now on (the channel is put in transaction mode if it is not)."""
        if channel.channel_number not in self._transactional:
            channel.tx_select()
            self._transactional.add(channel.channel_number)
        self._call(Verb.START, xid, channel=channel)
        self._channels[xid] = channel

    def end(self, xid: Xid, *, fail: bool = False) -> None:
        """No more work in ``xid`` (``fail``: roll it back now)."""
        self._call(Verb.END, xid, fail=fail)

    def prepare(self, xid: Xid) -> int:
        """Persist ``xid`` on both sites: :data:`XA_OK`, or :data:`XA_RDONLY`
        when it replicated nothing (then it is over: no commit follows).
        A no vote raises :class:`~txn.xa._wire.XaRolledBack`."""
        reply = self._call(Verb.PREPARE, xid)
        if reply.code == "XA_RDONLY":
            self._channels.pop(xid, None)
            return XA_RDONLY
        return XA_OK

    def commit(self, xid: Xid, *, one_phase: bool = False) -> None:
        """Commit ``xid`` (prepared, or ``one_phase`` after end)."""
        self._call(Verb.COMMIT, xid, one_phase=one_phase)
        self._channels.pop(xid, None)

    def rollback(self, xid: Xid) -> None:
        self._call(Verb.ROLLBACK, xid)
        self._channels.pop(xid, None)

    def recover(self) -> list[Xid]:
        """The VPN's branches prepared (or ended heuristically) and not yet
        resolved, from any connection."""
        reply = self._call(Verb.RECOVER)
        return [Xid.from_string(b.xid) for b in reply.branches]

    def forget(self, xid: Xid) -> None:
        """Forget a branch that ended heuristically."""
        self._call(Verb.FORGET, xid)

    def close(self) -> None:
        if self._control.is_open:
            self._control.close()
