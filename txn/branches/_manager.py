"""Client XA branches: the node is the resource manager.

RabbitMQ has no XA and AMQP 0-9-1 no XA verbs, so a branch is held here: its
work is the broker transaction of the client channel it started on;
``prepare`` is a local transaction's prepare (:class:`~txn.Coordinator`)
ending before the broker commit, with the standby's durable vote required
whatever the VPN's mode and policy; ``commit`` is the rest: the broker
commit behind a marker, the decision as one ledger group, the standby's
commit — through the channel while it is open, else from the prepared row
(:class:`LogPublisher`: publishes and marker in one broker transaction).
What is guaranteed and why (a yes vote can always be committed, heuristic
hazards are reported, recovery never decides a branch, a branch is its
broker user's, :data:`OPERATOR` may decide any): README, "Client XA
transactions"; each verb: docs/behaviour.md, "Client XA branches".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import psycopg
from opentelemetry import trace

from bridge import (
    BridgeError,
    Consumed,
    DeadLettered,
    LocalTransaction,
    Published,
    TransactionRefused,
    failpoint,
)
from txn.local import (
    CLOCK_SLACK_SECONDS,
    MARKER_RETENTION_SECONDS,
    RESOLVE_DELAY,
    Coordinator,
    MarkerError,
    TxnRow,
    restored_marker,
)
from txn.xa import (
    Branch,
    BranchState,
    Verb,
    XaDuplicate,
    XaError,
    XaHeuristic,
    XaNotFound,
    XaNotOwner,
    XaProtocolError,
    XaReply,
    XaRequest,
    XaResourceError,
    XaRolledBack,
    Xid,
    begin,
    settle,
)

__all__ = ["OPERATOR", "BranchChannel", "LogPublisher", "XaCoordinator", "XaStats"]

log = logging.getLogger(__name__)
tracer = trace.get_tracer("vpnrepl.txn")

#: branches rolled back with their channel, remembered for a late rollback
_TOMBSTONES = 4096
#: the user an operator's decision acts as: may act on any branch (no broker
#: user has this name: PLAIN separates its fields with NUL)
OPERATOR = "\0operator"


def _may(owner: str | None, user: str | None) -> bool:
    """Whether ``user`` may act on a branch ``owner`` started."""
    return owner is None or user == OPERATOR or owner == user


class BranchChannel(Protocol):
    """The client channel whose broker transaction holds a branch's work
    (the listener's side of it)."""

    @property
    def alive(self) -> bool:
        """The channel is open on both sides."""

    @property
    def transactional(self) -> bool:
        """``tx.select`` was sent on it."""

    @property
    def bound(self) -> str | None:
        """The XA id of the branch the channel holds, if any."""

    def bind(self, xid: str | None) -> None:
        """The channel's transaction is branch ``xid``'s (None: no more)."""

    def take_work(self, xid: str) -> LocalTransaction | None:
        """The replicated events of the channel's transaction so far, as the
        branch's transaction (None: nothing replicated); the channel takes
        no more work until it is unbound."""

    async def broker_commit(self, txid: str | None) -> bool:
        """Commit the channel's broker transaction, behind ``txid``'s commit
        marker (None: no marker); True on commit-ok, False when the channel
        closed first (the outcome is the marker's)."""

    async def broker_rollback(self) -> None:
        """Roll the channel's broker transaction back (its acks become
        unacked again); returns when the broker answered or the channel is
        gone."""


class LogPublisher(Protocol):
    """Publishes a prepared branch's work from its row (the node's own
    broker connection)."""

    async def publish(
        self, vpn: str, txid: str, messages: Sequence[Published], since: float
    ) -> None:
        """``messages`` into their queues and ``txid``'s commit marker in one
        broker transaction — nothing when the marker is there already (a
        marker is looked for from ``since``, the branch row's making)."""

    async def restore(
        self, vpn: str, txid: str, consumed: Sequence[Consumed | DeadLettered], since: float
    ) -> int:
        """Publish the live messages ``consumed`` names into their queues
        again (a promoted site held them back for branch ``txid``), with
        ``txid``'s restore marker in one broker transaction — nothing when
        the marker is there already."""


@dataclass
class XaStats:
    """Counters ``/metrics`` reads: ``(vpn, outcome)`` -> branches."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)


@dataclass
class _Branch:
    vpn: str
    xid: str
    state: BranchState
    channel: BranchChannel | None
    txn: LocalTransaction | None = None
    #: the broker user that started it
    owner: str | None = None


class XaCoordinator:
    """Answers XA requests for the VPNs active here (see the module docstring)."""

    def __init__(self, coordinator: Coordinator, publisher: LogPublisher | None = None) -> None:
        self.coordinator = coordinator
        self.log = coordinator.log
        self.publisher = publisher
        self.stats = XaStats()
        self._branches: dict[tuple[str, str], _Branch] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        #: (vpn, xid) -> (why a branch that never prepared was rolled back, its owner)
        self._rolled_back: dict[tuple[str, str], tuple[str, str | None]] = {}

    async def call(
        self,
        vpn: str,
        request: XaRequest,
        channel: BranchChannel | None,
        user: str | None = None,
    ) -> XaReply:
        """Answer ``request`` from a connection on ``vpn`` (its channel, for
        ``start``) logged in as broker user ``user``."""
        xid = None if request.xid is None else str(request.xid)
        with tracer.start_as_current_span(
            f"xa.{request.verb.value}", attributes={"vpn": vpn, "xid": xid or ""}
        ) as span:
            try:
                reply = await self._call(vpn, request, xid, channel, user)
            except XaError as e:
                reply = XaReply.of_error(e)
            except (psycopg.Error, MarkerError, BridgeError, TransactionRefused) as e:
                log.warning("VPN %s: XA %s of %s failed: %s", vpn, request.verb.value, xid, e)
                reply = XaReply.of_error(XaResourceError(f"{request.verb.value} failed: {e}"))
            span.set_attribute("xa.code", reply.code)
            return reply

    async def _call(
        self,
        vpn: str,
        request: XaRequest,
        xid: str | None,
        channel: BranchChannel | None,
        user: str | None,
    ) -> XaReply:
        if request.verb is Verb.RECOVER:
            rows = [r for r in await self.log.xa_branches(vpn) if _may(r.xa_owner, user)]
            return XaReply("XA_OK", f"{len(rows)} branch(es)", tuple(_listed(r) for r in rows))
        assert xid is not None  # noqa: S101 - every other verb names its branch (XaRequest)
        key = (vpn, xid)
        lock = self._locks.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                return await self._verb(vpn, request, xid, channel, user)
        finally:
            if not lock.locked() and key not in self._branches:
                self._locks.pop(key, None)

    async def _verb(
        self,
        vpn: str,
        request: XaRequest,
        xid: str,
        channel: BranchChannel | None,
        user: str | None,
    ) -> XaReply:
        verb = request.verb
        if verb is Verb.START:
            return await self._start(vpn, xid, channel, user)
        branch = self._branches.get((vpn, xid))
        if branch is None:
            return await self._unbound(vpn, request, xid, user)
        _check_owner(branch.owner, user, verb, xid)
        if verb is Verb.FORGET:
            raise XaProtocolError(f"XA branch {xid} did not end heuristically: nothing to forget")
        if verb is Verb.COMMIT and branch.state is BranchState.IDLE and not request.one_phase:
            raise XaProtocolError(f"XA branch {xid} is not prepared: prepare it, or one_phase")
        during = begin(branch.state, verb, xid)
        branch.state = during
        try:
            return await self._run(branch, verb, request.fail)
        finally:
            if branch.state is BranchState.ENDED or branch.channel is None:
                self._branches.pop((vpn, xid), None)
                if branch.channel is not None:
                    branch.channel.bind(None)

    async def _run(self, branch: _Branch, verb: Verb, fail: bool) -> XaReply:
        if verb is Verb.END:
            if fail:  # the transaction manager rolls it back: no more work is coming
                await self._rollback_bound(branch)
                return XaReply("XA_RBROLLBACK", f"XA branch {branch.xid} rolled back (end fail)")
            branch.state = settle(BranchState.IDLE, BranchState.IDLE)
            return XaReply("XA_OK")
        if verb is Verb.ROLLBACK:
            return await self._rollback_bound(branch)
        if branch.state is BranchState.PREPARING:
            vote = await self._prepare(branch)
            if verb is Verb.PREPARE or vote == "XA_RDONLY":
                return XaReply(vote)
            branch.state = settle(BranchState.PREPARING, BranchState.COMMITTING)
        return await self._commit_bound(branch)

    async def _start(
        self, vpn: str, xid: str, channel: BranchChannel | None, user: str | None
    ) -> XaReply:
        if channel is None or not channel.alive:
            raise XaProtocolError("start must be sent on the channel the branch's work goes on")
        if not channel.transactional:
            raise XaProtocolError(
                "start needs a channel in transaction mode: send tx.select on it first"
            )
        if channel.bound is not None:
            raise XaProtocolError(f"the channel holds XA branch {channel.bound} already")
        if (vpn, xid) in self._branches:
            raise XaDuplicate(f"XA branch {xid} exists already")
        row = await self.log.xa_branch(vpn, xid)
        if row is not None and row.state == "prepared":
            raise XaDuplicate(f"XA branch {xid} is prepared already")
        self._rolled_back.pop((vpn, xid), None)
        self._branches[(vpn, xid)] = _Branch(vpn, xid, BranchState.ACTIVE, channel, owner=user)
        channel.bind(xid)
        return XaReply("XA_OK")

    async def _prepare(self, branch: _Branch) -> str:
        """Persist the branch on both sites; its vote (or XaRolledBack)."""
        channel = branch.channel
        if channel is None or not channel.alive:
            branch.state = BranchState.ENDED
            self._count(branch.vpn, "rolled_back")
            raise XaRolledBack(
                f"XA branch {branch.xid}: its channel closed before prepare;"
                " the broker rolled its work back"
            )
        txn = channel.take_work(branch.xid)
        if txn is None:  # nothing replicated: its broker work commits now
            committed = await channel.broker_commit(None)
            branch.state = BranchState.ENDED
            if not committed:
                raise XaRolledBack(f"XA branch {branch.xid}: its channel closed before prepare")
            self._count(branch.vpn, "read_only")
            return "XA_RDONLY"
        try:
            await self.coordinator.prepare(txn, xid=branch.xid, owner=branch.owner)
        except TransactionRefused as e:
            await channel.broker_rollback()
            branch.state = BranchState.ENDED
            self._count(branch.vpn, "refused")
            raise XaRolledBack(f"XA branch {branch.xid} rolled back: {e}") from e
        branch.txn = txn
        branch.state = settle(BranchState.PREPARING, BranchState.PREPARED)
        return "XA_OK"

    async def _commit_bound(self, branch: _Branch) -> XaReply:
        txn, channel = branch.txn, branch.channel
        assert txn is not None  # noqa: S101 - committing means prepared
        if channel is not None and channel.alive:
            self.coordinator.xa_commit_sent(txn.txid)
            committed = await channel.broker_commit(txn.txid)
            if not committed:  # the channel closed under the commit: the marker tells
                await asyncio.sleep(RESOLVE_DELAY)
                committed = await self.coordinator.marker_found(branch.vpn, txn.txid)
            if committed:
                try:
                    await self.coordinator.commit(txn)
                except TransactionRefused as e:
                    branch.state, branch.channel = BranchState.PREPARED, None
                    raise XaResourceError(
                        f"XA branch {branch.xid}: the broker committed it, the decision was"
                        f" not recorded ({e}); commit it again"
                    ) from e
                branch.state = BranchState.ENDED
                self._count(branch.vpn, "committed")
                return XaReply("XA_OK")
        # the broker rolled the channel's transaction back: commit from the row
        self.coordinator.detach(txn.txid)
        branch.channel = None
        row = await self.log.xa_branch(branch.vpn, branch.xid)
        if row is None or row.state != "prepared":
            raise XaResourceError(f"XA branch {branch.xid}: its prepared row is gone")
        try:
            reply = await self._commit_logged(row)
        except BaseException:
            branch.state = BranchState.PREPARED
            raise
        branch.state = BranchState.ENDED
        return reply

    async def _rollback_bound(self, branch: _Branch) -> XaReply:
        channel, txn = branch.channel, branch.txn
        if channel is not None and channel.alive:
            await channel.broker_rollback()
        if txn is not None:
            if channel is not None and channel.alive:
                await self.coordinator.abort(txn)
            else:
                self.coordinator.detach(txn.txid)
                row = await self.log.xa_branch(branch.vpn, branch.xid)
                if row is not None and row.state == "prepared":
                    await self._rollback_logged(row)
                    branch.state = BranchState.ENDED
                    return XaReply("XA_OK")
                await self.coordinator.forget_branch(branch.vpn, txn.txid)
        branch.state = BranchState.ENDED
        self._count(branch.vpn, "rolled_back")
        return XaReply("XA_OK")

    # -- branches known only by their rows ------------------------------------

    async def _unbound(self, vpn: str, request: XaRequest, xid: str, user: str | None) -> XaReply:
        """A verb on a branch no channel here holds: its row decides."""
        verb = request.verb
        tombstone = self._rolled_back.get((vpn, xid))
        row = await self.log.xa_branch(vpn, xid)
        if row is None or (tombstone is not None and row.state != "prepared"):
            if tombstone is not None:
                gone, owner = tombstone
                _check_owner(owner, user, verb, xid)
                if verb is Verb.ROLLBACK:
                    self._rolled_back.pop((vpn, xid), None)
                    return XaReply("XA_OK", gone)
                raise XaRolledBack(f"XA branch {xid}: {gone}")
            raise XaNotFound(f"no XA branch {xid} on VPN {vpn!r} here")
        _check_owner(row.xa_owner, user, verb, xid)
        if row.heuristic is not None:
            return await self._heuristic(row, verb)
        if row.state != "prepared":
            raise XaNotFound(f"XA branch {xid} is over ({row.state})")
        if verb is Verb.COMMIT:
            return await self._commit_logged(row)
        if verb is Verb.ROLLBACK:
            await self._rollback_logged(row)
            return XaReply("XA_OK")
        if verb is Verb.PREPARE:
            raise XaProtocolError(f"XA branch {xid} is prepared already")
        if verb is Verb.FORGET:
            raise XaProtocolError(f"XA branch {xid} did not end heuristically: nothing to forget")
        raise XaProtocolError(f"XA branch {xid} is prepared: only commit or rollback")

    async def _heuristic(self, row: TxnRow, verb: Verb) -> XaReply:
        """A verb on a branch that ended heuristically (an operator's
        decision, or a hazard)."""
        xid = row.xid or ""
        if verb is Verb.FORGET:
            await self.log.mark_xa(row.txid, heuristic=None)
            return XaReply("XA_OK")
        code = {"commit": "XA_HEURCOM", "rollback": "XA_HEURRB"}.get(row.heuristic or "")
        if code is None:
            raise XaHeuristic(f"XA branch {xid}: {row.hazard or 'heuristic hazard'}", "XA_HEURHAZ")
        how = "committed" if code == "XA_HEURCOM" else "rolled back"
        raise XaHeuristic(f"XA branch {xid} was {how} by an operator", code)

    async def _commit_logged(self, row: TxnRow) -> XaReply:
        """Commit a prepared branch from its row (see the module docstring)."""
        acks = [e for e in row.events if not isinstance(e, Published)]
        hazard = None
        if acks and not row.acks_held:
            hazard = (
                f"{len(acks)} acknowledgement(s) of this branch were not applied: its channel"
                " closed before the commit and the broker requeued those messages"
            )
            await self.log.mark_xa(row.txid, heuristic="hazard", hazard=hazard)
            row = replace(row, heuristic="hazard", hazard=hazard)
        published = [e for e in row.events if isinstance(e, Published)]
        if published:
            if self.publisher is None:
                raise XaResourceError("this node cannot publish a branch from its log")
            _markers_kept(row)
            await self.publisher.publish(row.vpn, row.txid, published, row.created_at)
        try:
            acked = await self.coordinator.decide_logged(row)
        except TransactionRefused as e:
            raise XaResourceError(f"XA branch {row.xid}: {e}; commit it again") from e
        if not acked:
            log.warning(
                "VPN %s: XA branch %s committed; the standby did not acknowledge it in time",
                row.vpn,
                row.xid,
            )
        if row.acks_held:
            await self.log.release_held(row.txid)
        self._count(row.vpn, "committed")
        if hazard is not None:
            self._count(row.vpn, "hazard")
            log.warning(
                "VPN %s: XA branch %s committed with a hazard: %s", row.vpn, row.xid, hazard
            )
            raise XaHeuristic(f"XA branch {row.xid} committed; {hazard}", "XA_HEURHAZ")
        return XaReply("XA_OK")

    async def _rollback_logged(self, row: TxnRow) -> None:
        held = [e for e in row.events if isinstance(e, Consumed | DeadLettered)]
        if row.acks_held:
            if held:
                if self.publisher is None:
                    raise XaResourceError("this node cannot put held messages back")
                _markers_kept(row)
                await self.publisher.restore(row.vpn, row.txid, held, row.created_at)
                failpoint("xa.after-restore")
            await self.log.release_held(row.txid)
        await self.coordinator.forget_branch(row.vpn, row.txid)
        if row.acks_held and held:  # its restore marker is not needed any more
            self.coordinator.marker_done(row.vpn, restored_marker(row.txid))
        self._count(row.vpn, "rolled_back")

    # -- operators and the listener ------------------------------------------

    async def decide(self, vpn: str, xid: Xid, commit: bool) -> XaReply:
        """An operator's decision on a prepared branch (``vpnrepl xa
        commit|rollback``), recorded as heuristic."""
        verb = Verb.COMMIT if commit else Verb.ROLLBACK
        request = XaRequest(verb, xid, "operator", "operator")
        reply = await self.call(vpn, request, None, OPERATOR)
        if reply.code in ("XA_OK", "XA_HEURHAZ"):
            row = await self.log.xa_branch(vpn, str(xid))
            if row is not None and row.heuristic is None:
                await self.log.mark_xa(row.txid, heuristic="commit" if commit else "rollback")
            self._count(vpn, "heuristic_commit" if commit else "heuristic_rollback")
        return reply

    def channel_gone(self, channel: BranchChannel) -> None:
        """``channel`` closed: the broker rolled its transaction back. A
        branch not prepared is over; a prepared one lives on in its row (a
        verb under way finds out itself)."""
        xid = channel.bound
        if xid is None:
            return
        for key, branch in list(self._branches.items()):
            if branch.channel is not channel:
                continue
            if branch.state in (BranchState.ACTIVE, BranchState.IDLE):
                del self._branches[key]
                self._remember_rollback(key, "its channel closed before prepare", branch.owner)
                self._count(branch.vpn, "rolled_back")
            elif branch.state is BranchState.PREPARED:
                del self._branches[key]
                if branch.txn is not None:
                    self.coordinator.detach(branch.txn.txid)

    def _remember_rollback(self, key: tuple[str, str], why: str, owner: str | None) -> None:
        if len(self._rolled_back) >= _TOMBSTONES:
            with contextlib.suppress(StopIteration):
                del self._rolled_back[next(iter(self._rolled_back))]
        self._rolled_back[key] = (f"rolled back: {why}", owner)

    def _count(self, vpn: str, outcome: str) -> None:
        self.stats.outcomes[(vpn, outcome)] += 1


def _check_owner(owner: str | None, user: str | None, verb: Verb, xid: str) -> None:
    if not _may(owner, user):
        raise XaNotOwner(
            f"XA branch {xid} was started by another broker user: only that user may"
            f" {verb.value} it"
        )


def _listed(row: TxnRow) -> Branch:
    return Branch(row.xid or "", row.state, row.heuristic, row.hazard)


def _markers_kept(row: TxnRow) -> None:
    """Refuse to publish ``row``'s work from its log when the branch is
    older than the commit markers' retention: a marker of an earlier
    attempt may be gone, and publishing again would put the work in twice."""
    if row.age > MARKER_RETENTION_SECONDS - CLOCK_SLACK_SECONDS:
        raise XaResourceError(
            f"XA branch {row.xid} is older than the commit markers' retention "
            f"({MARKER_RETENTION_SECONDS // 86400:.0f} days): whether its work already "
            "reached the broker cannot be told; look at its queues and forget it "
            '(README, "Transactions left in doubt")'
        )
