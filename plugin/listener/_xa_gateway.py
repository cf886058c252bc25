"""Where the listener meets client XA: requests in, answers out.

A client's XA request (:class:`~plugin.session._actions.XaCall`) is handed to
:class:`~txn.XaCoordinator` with the channel it came on
(:class:`ChannelBranch`), and its answer published through the node's own
broker connection (:class:`~plugin.node._xa_publish.ReplyPublisher`). An
answer may only go to an exclusive queue the requesting connection
declared: the node publishes with its own broker user, which may write where
the client's may not, and only that connection reads such a queue. A request
naming any other ``reply_to`` has its channel closed (406).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from bridge import LocalTransaction
from bridge.amqp import PreconditionFailed
from plugin.session import Channel, Output, Session, XaCall
from txn.branches import BranchChannel, XaCoordinator
from txn.xa import XaError, XaReply, XaRequest, XaResourceError, XaResourceFailure

__all__ = ["ChannelBranch", "Connection", "ReplySender", "XaGateway"]

log = logging.getLogger(__name__)


class Connection(Protocol):
    """A client connection of the listener, as the gateway uses it."""

    session: Session

    @property
    def closed(self) -> bool: ...

    def apply(self, out: Output) -> None: ...


class ReplySender(Protocol):
    async def send(self, vhost: str, queue: str, correlation_id: str, body: bytes) -> None: ...


class ChannelBranch:
    """One client channel as :class:`txn.BranchChannel`: its broker
    transaction holds an XA branch's work."""

    def __init__(self, conn: Connection, channel: Channel) -> None:
        self.conn = conn
        self.channel = channel

    @property
    def alive(self) -> bool:
        conn = self.conn
        return not conn.closed and conn.session.xa_channel(self.channel.number) is self.channel

    @property
    def transactional(self) -> bool:
        return self.channel.tx

    @property
    def bound(self) -> str | None:
        return self.channel.xa

    def bind(self, xid: str | None) -> None:
        if xid is None:
            self.channel.xa_unbind()
        else:
            self.channel.xa = xid

    def take_work(self, xid: str) -> LocalTransaction | None:
        return self.channel.xa_take_work(xid)

    async def broker_commit(self, txid: str | None) -> bool:
        return await self._ask(lambda answer: self.channel.xa_broker_commit(txid, answer))

    async def broker_rollback(self) -> None:
        await self._ask(self.channel.xa_broker_rollback)

    async def _ask(self, frames_for: Callable[[Callable[[bool], None]], bytes]) -> bool:
        """Send our own frames upstream on the channel; True once the broker
        answered them, False when the channel ended first."""
        if not self.alive:
            return False
        answered: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def answer(ok: bool) -> None:
            if not answered.done():
                answered.set_result(ok)

        self.conn.apply(Output(to_broker=[frames_for(answer)]))
        return await answered


class XaGateway:
    """Answers the XA requests of the listener's connections."""

    def __init__(self, xa: XaCoordinator | None, replies: ReplySender) -> None:
        self.xa = xa
        self.replies = replies
        self._branches: dict[tuple[int, int], ChannelBranch] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def requested(self, conn: Connection, call: XaCall) -> None:
        """``conn``'s client published XA request ``call``."""
        session = conn.session
        vhost = session.vhost or ""
        if not call.reply_to or not session.owns_queue(call.reply_to):
            ch = session.xa_channel(call.channel)
            if ch is not None:
                conn.apply(
                    session.refuse_channel(
                        ch,
                        PreconditionFailed.reply_code,
                        "an XA request's reply_to must name an exclusive queue this"
                        f" connection declared (got {(call.reply_to or '')[:60]!r})",
                    )
                )
            return
        task = asyncio.ensure_future(self._answer(conn, vhost, call, call.reply_to))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def channel_gone(self, conn: Connection, number: int) -> None:
        """A channel of ``conn`` that held an XA branch closed."""
        branch = self._branches.pop((id(conn), number), None)
        if branch is not None and self.xa is not None:
            self.xa.channel_gone(branch)

    def connection_gone(self, conn: Connection) -> None:
        for key in [k for k in self._branches if k[0] == id(conn)]:
            self.channel_gone(conn, key[1])

    def _branch(self, conn: Connection, number: int) -> BranchChannel | None:
        ch = conn.session.xa_channel(number)
        if ch is None:
            return None
        key = (id(conn), number)
        branch = self._branches.get(key)
        if branch is None or branch.channel is not ch:
            branch = self._branches[key] = ChannelBranch(conn, ch)
        return branch

    async def _answer(self, conn: Connection, vhost: str, call: XaCall, reply_to: str) -> None:
        try:
            request = XaRequest.decode(call.verb, call.correlation_id, reply_to, call.body)
            if self.xa is None:
                raise XaResourceFailure("client XA is not available on this node")
            branch = self._branch(conn, call.channel)
            reply = await self.xa.call(vhost, request, branch, conn.session.user)
        except XaError as e:
            reply = XaReply.of_error(e)
        except Exception as e:  # a bug: the client hears of it, the log has it
            log.exception("VPN %s: XA %s failed unexpectedly", vhost, call.verb[:40])
            reply = XaReply.of_error(XaResourceError(f"the node failed: {type(e).__name__}"))
        try:
            await self.replies.send(vhost, reply_to, call.correlation_id or "", reply.encode())
        except Exception as e:  # the client times out: its resource reports it
            log.warning("VPN %s: an XA answer could not be sent: %s", vhost, e)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
