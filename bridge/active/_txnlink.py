"""The transaction link's active end: local transactions' frames to the standby.

:class:`ActiveTxnLink` is the coordinator's ``ParticipantLink`` (``txn``): it
asks the standby to prepare (``TxnPrepare`` → ``TxnVote``), to commit early
(``TxnCommit`` → ``TxnApplied``), tells it outcomes (``TxnOutcome``) and
answers its questions about prepared transactions (``TxnQuery``). Early
commit and the link's invariants: :mod:`bridge.standby._txnlink`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from bridge._tasks import BackgroundTasks
from bridge.wire import TxnApplied, TxnCommit, TxnOutcome, TxnPrepare, TxnQuery, TxnVote

from ._stream import ConnectedStandby

__all__ = ["ActiveTxnLink", "TxnOutcomes"]


class TxnOutcomes(Protocol):
    """How the active answers a standby's question about its prepared
    transactions: ``txn``'s coordinator."""

    async def outcomes_for(self, txids: Sequence[str]) -> dict[str, bool | None]: ...


def _nothing() -> None:
    """An ``on_applied`` that no one waits for any more."""


class ActiveTxnLink:
    """The active's end: the coordinator's ``ParticipantLink``.

    ``standby_of(vpn)`` is the connected standby that the VPN is listed to
    (None: none is); the server owns the connections."""

    def __init__(self, standby_of: Callable[[str], ConnectedStandby | None]) -> None:
        self._standby_of = standby_of
        #: answers standbys' questions about transactions (set by the node)
        self.coordinator: TxnOutcomes | None = None
        self._votes: dict[str, asyncio.Future[bool]] = {}
        #: txid -> (called if the standby committed it early, the answer the
        #: live feed holds the group for)
        self._early: dict[str, tuple[Callable[[], None], asyncio.Future[bool]]] = {}
        self._tasks = BackgroundTasks()

    def prepare(
        self, vpn: str, txid: str, events: bytes, within: float, owner: str | None = None
    ) -> Awaitable[bool]:
        """Ask the standby to prepare ``txid`` (``owner``: an XA branch's
        broker user, kept in its row there): the request is sent before
        this returns (so the caller's own prepare starts after it, the
        standby's round being the longer); the awaitable is True once it
        voted yes within ``within`` seconds. A standby that is not connected
        cannot prepare: False at once (the VPN's on-sync-timeout policy then
        applies). The awaitable is a plain future, resolved by the vote or
        the timer: the caller wakes one event-loop turn after the vote, not
        two (as behind a task of its own)."""
        peer = self._standby_of(vpn)
        loop = asyncio.get_running_loop()
        vote: asyncio.Future[bool] = loop.create_future()
        ask = TxnPrepare(vpn, peer.epochs[vpn], txid, events, owner or "") if peer else None
        if peer is None or ask is None or not peer.link.try_send(ask):
            vote.set_result(False)
            return vote
        self._votes[txid] = vote
        timer = loop.call_later(within, self._no_vote, txid, vote)
        vote.add_done_callback(lambda _: timer.cancel())
        return vote

    def _no_vote(self, txid: str, vote: asyncio.Future[bool]) -> None:
        """The standby did not vote in time: the vote counts as no."""
        if self._votes.get(txid) is vote:
            del self._votes[txid]
        if not vote.done():
            vote.set_result(False)

    def commit_early(self, vpn: str, txid: str, first: int, on_applied: Callable[[], None]) -> bool:
        """Tell the standby the broker committed ``txid`` (its group at
        ``first`` onwards) so it may commit it early; ``on_applied()`` runs
        if it says it did. The group's copy in the live feed waits for the
        answer (``bridge.active._stream``). False when no standby streams the
        VPN live (nothing sent)."""
        peer = self._standby_of(vpn)
        out = peer.stream_live(vpn) if peer is not None else None
        if peer is None or out is None or first < out.next_index:
            return False
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._early[txid] = (on_applied, answer)
        out.answers[first] = answer
        if not peer.link.try_send(TxnCommit(vpn, peer.epochs[vpn], txid, first)):
            self._early.pop(txid, None)
            del out.answers[first]
            return False
        return True

    def outcome(self, vpn: str, txid: str, commit: bool) -> None:
        """Tell the standby how ``txid`` ended (if one is connected: else it
        asks when it reconnects)."""
        early = self._early.pop(txid, None)
        if early is not None and not early[1].done():
            # settled without the answer (timed out): the live feed still waits for it
            self._early[txid] = (_nothing, early[1])
        self._votes.pop(txid, None)  # a vote no one waits for any more
        peer = self._standby_of(vpn)
        if peer is not None:
            peer.link.try_send(TxnOutcome(vpn, peer.epochs[vpn], txid, commit))

    def received(self, peer: ConnectedStandby, frame: TxnVote | TxnApplied | TxnQuery) -> None:
        """A vote, an answer to an early commit, or a question from ``peer``."""
        if isinstance(frame, TxnVote):
            vote = self._votes.pop(frame.txid, None)
            if vote is not None and not vote.done():
                vote.set_result(frame.ok)
        elif isinstance(frame, TxnApplied):
            early = self._early.pop(frame.txid, None)
            if early is not None:
                on_applied, answer = early
                if not answer.done():
                    answer.set_result(frame.applied)
                if frame.applied:
                    on_applied()
        else:
            self._tasks.spawn(self._answer(peer, frame))

    async def _answer(self, peer: ConnectedStandby, query: TxnQuery) -> None:
        if self.coordinator is None:
            return
        outcomes = await self.coordinator.outcomes_for(query.txids)
        epoch = peer.epochs.get(query.vpn)
        if epoch is None:
            return
        for txid, commit in outcomes.items():
            if commit is not None:  # in flight here: its outcome follows when decided
                peer.link.try_send(TxnOutcome(query.vpn, epoch, txid, commit))

    def gone(self, peer: ConnectedStandby) -> None:
        """``peer`` is gone: its early commits will not be answered."""
        for out in peer.streams.values():
            out.unanswered()
        self._early = {t: e for t, e in self._early.items() if not e[1].done()}
