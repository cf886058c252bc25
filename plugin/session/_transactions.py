"""A client channel's transactions and XA branches.

A part of :class:`~plugin.session._channel.Channel`: ``tx.select``,
``tx.commit`` and ``tx.rollback``, held and answered so that the sink and the
broker agree (docs/behaviour.md, "Local transactions": the events buffered,
``tx.commit`` held until the sink prepared them and sent behind a commit
marker, :func:`commit_marker`; ``tx.commit-ok`` until it committed them), and
the XA branch a channel's transaction can be (driven by ``txn.branches``
through ``plugin.listener._xa_gateway``). A channel holding a branch takes
no ``tx.commit`` or ``tx.rollback`` of the client's, nor work once the branch
is being prepared (406), since its broker transaction is what the prepared
row holds; our own (``xa_broker_commit``, ``xa_broker_rollback``) are
answered to the branch, their ``-ok`` never reaching the client.
"""

from __future__ import annotations

from collections.abc import Callable

from pamqp import commands, frame, header
from pamqp.body import ContentBody

from bridge import MARKER_QUEUE, LocalTransaction, amqp
from bridge.amqp import FrameSpan

from ._channel_state import ChannelState

__all__ = ["ChannelTransactions", "commit_marker"]


class ChannelTransactions(ChannelState):
    """A channel's transaction, and the XA branch it may be."""

    __slots__ = ()

    def on_tx_select(self, buf: bytes, f: FrameSpan) -> bytes | None:
        self.tx = True
        return None

    def on_tx_commit(self, buf: bytes, f: FrameSpan) -> bytes | None:
        """tx.commit: held until the sink has prepared the transaction (see
        ``Session.transaction_prepared``); passed at once if it replicates
        nothing."""
        if self.xa is not None:
            return self._refuse_tx("tx.commit")
        ctx = self.ctx
        if not self.tx_events or ctx.vpn is None:
            self._forget_tx_acks()
            return None
        self.tx_sequence += 1
        txn = LocalTransaction(
            vpn=ctx.vpn.name,
            connection=ctx.connection_id,
            channel=self.number,
            sequence=self.tx_sequence,
            events=tuple(self.tx_events),
            incarnation=ctx.ids.incarnation,
        )
        self.tx_events.clear()
        self._forget_tx_acks()
        self.tx_prepared = txn
        self.held_commit = buf[f.start : f.end]
        ctx.out.prepare.append(txn)
        return b""

    def on_tx_rollback(self, buf: bytes, f: FrameSpan) -> bytes | None:
        if self.xa is not None:
            return self._refuse_tx("tx.rollback")
        self.tx_events.clear()
        self.deliveries.update(self.tx_acked)  # rolled-back acks: still unacked
        self.tx_acked.clear()
        return None

    def _forget_tx_acks(self) -> None:
        """The transaction's acks are committed: their deliveries are settled."""
        for tag in self.tx_acked:
            self.routing_keys.pop(tag, None)
        self.tx_acked.clear()

    def prepared(self) -> tuple[LocalTransaction, bytes] | None:
        """The transaction the sink has answered for, and its held
        tx.commit (None: no commit is held)."""
        txn, self.tx_prepared = self.tx_prepared, None
        held, self.held_commit = self.held_commit, b""
        return None if txn is None else (txn, held)

    def commit(self, txn: LocalTransaction, held: bytes) -> bytes:
        """The frames that commit the prepared ``txn`` at the broker: the
        commit marker, then the client's held tx.commit."""
        self.tx_committing = txn
        return self._marker(txn.txid) + held

    def commit_ok(self) -> LocalTransaction | None:
        """The broker's tx.commit-ok: the transaction it committed (None:
        not one of ours)."""
        txn, self.tx_committing = self.tx_committing, None
        return txn

    # -- XA branches (txn.branches drives them through plugin.listener._xa_gateway) --

    def xa_take_work(self, xid: str) -> LocalTransaction | None:
        """The replicated events of the channel's transaction, as XA branch
        ``xid``'s transaction (None: nothing replicated); the channel takes
        no more work until the branch ends."""
        self.xa_frozen = True
        ctx = self.ctx
        if not self.tx_events or ctx.vpn is None:
            return None
        self.tx_sequence += 1
        txn = LocalTransaction(
            vpn=ctx.vpn.name,
            connection=ctx.connection_id,
            channel=self.number,
            sequence=self.tx_sequence,
            events=tuple(self.tx_events),
            incarnation=ctx.ids.incarnation,
            xid=xid,
        )
        self.tx_events.clear()
        self.xa_acked = dict(self.tx_acked)
        self._forget_tx_acks()
        return txn

    def xa_unbind(self) -> None:
        """The branch is over: the channel's next transaction is its own."""
        self.xa, self.xa_frozen, self.xa_waiter = None, False, None
        self.xa_acked = {}

    def xa_broker_commit(self, txid: str | None, answer: Callable[[bool], None]) -> bytes:
        """The frames committing the branch's broker transaction (behind
        ``txid``'s marker); ``answer`` hears of the commit-ok."""
        self.xa_waiter = answer
        commit = amqp.marshal_method(commands.Tx.Commit(), self.number)
        return commit if txid is None else self._marker(txid) + commit

    def _marker(self, txid: str) -> bytes:
        vpn = self.ctx.vpn
        assert vpn is not None  # noqa: S101 - only a replicated VPN's transactions have markers
        return commit_marker(self.number, self.ctx.marker_key.body(vpn.name, txid))

    def xa_broker_rollback(self, answer: Callable[[bool], None]) -> bytes:
        """The frame rolling the branch's broker transaction back."""
        self.xa_waiter = answer
        return amqp.marshal_method(commands.Tx.Rollback(), self.number)

    def _xa_answered(self, ok: bool) -> bytes | None:
        """The broker's answer to our tx.commit or tx.rollback: swallowed."""
        waiter, self.xa_waiter = self.xa_waiter, None
        if waiter is None:
            return None
        if ok:
            self.tx_events.clear()
        waiter(True)
        return b""

    def on_tx_rollback_ok(self, buf: bytes, f: FrameSpan) -> bytes | None:
        if self.xa_waiter is None:
            return None
        # the rolled-back acks: their deliveries are unacked again
        self.deliveries.update(self.xa_acked)
        self.deliveries.update(self.tx_acked)
        self.tx_acked.clear()
        self.xa_acked = {}
        return self._xa_answered(True)

    def on_tx_commit_ok(self, buf: bytes, f: FrameSpan) -> bytes | None:
        if self.xa_waiter is not None:
            self._forget_tx_acks()
            return self._xa_answered(True)
        txn = self.commit_ok()
        if txn is None:
            return None
        self.ctx.out.commit.append(txn)
        return b""  # held until the sink has committed


def commit_marker(channel: int, body: bytes) -> bytes:
    """A persistent publish of a marker's ``body`` to
    :data:`~bridge.MARKER_QUEUE`: method, content header and body frames."""
    return b"".join(
        (
            amqp.marshal_method(
                commands.Basic.Publish(exchange="", routing_key=MARKER_QUEUE), channel
            ),
            frame.marshal(
                header.ContentHeader(
                    body_size=len(body),
                    properties=commands.Basic.Properties(delivery_mode=2),
                ),
                channel,
            ),
            frame.marshal(ContentBody(body), channel),
        )
    )
