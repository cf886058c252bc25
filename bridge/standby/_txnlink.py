"""The transaction link's standby end: local transactions' frames from the active.

:class:`StandbyTxnLink` hands prepares and outcomes to the participant,
commits transactions early when asked (docs/behaviour.md, "Local
transactions", step 4) and settles the stream's copies of groups committed
early; the active's end is :mod:`bridge.active._txnlink`. Invariants: a
vote, an answer or an outcome is keyed by its transaction id and dropped
once nobody waits for it; an early commit is applied once — in the VPN's
stream order (its ``TxnCommit`` shares the events' queue), on a connection
of its own, and when its outcome is unknown the applier reads back what was
committed early before the next batch; a standby that is gone counts its
pending early commits as declined (the live feed stops holding their
groups) and its votes as no (the sync-timeout policy applies).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import psycopg

from bridge._entry import LedgerEntry
from bridge._errors import BridgeError
from bridge._events import Voted
from bridge._failpoints import failpoint
from bridge._tasks import BackgroundTasks
from bridge.ledger import GuardedApply, run_guarded_async
from bridge.link import Link, describe_error
from bridge.wire import TxnApplied, TxnCommit, TxnOutcome, TxnPrepare, TxnQuery, TxnVote

from ._applier import StandbyApplier, StandbyUnavailable
from ._early import ReadyEarlyCommit
from ._stream import StandbyStream

log = logging.getLogger(__name__)

__all__ = ["StandbyTxnLink", "TxnParticipant"]


_T = TypeVar("_T")

#: voted transactions kept ready to commit early on the standby (the oldest go
#: first; one whose commit comes later takes the checked path, reading its row)
READY_KEPT = 1024


class TxnParticipant(Protocol):
    """The standby's part of a local transaction: ``txn``'s participant."""

    async def prepare(
        self,
        vpn: str,
        txid: str,
        events: bytes,
        meanwhile: Callable[[Voted], object] | None = None,
        *,
        owner: str | None = None,
    ) -> Voted | None: ...

    async def outcome(self, vpn: str, txid: str, commit: bool) -> None: ...

    async def settle(self, vpn: str, txid: str, last: int) -> None: ...

    async def in_doubt(self, vpn: str) -> list[str]: ...


class StandbyTxnLink:
    """The standby's end: the participant's prepares and outcomes, and early
    commits with the applier."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        #: the standby's side of local transactions (set by the node)
        self.participant: TxnParticipant | None = None
        self.applier: StandbyApplier | None = None
        #: txid -> its voted events made ready to commit early, until the commit or the outcome
        self._ready: OrderedDict[str, ReadyEarlyCommit] = OrderedDict()
        #: the connection early commits (and the stream's copies of them) run on
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._tasks = BackgroundTasks()

    def spawn(self, work: Awaitable[None]) -> None:
        self._tasks.spawn(work)

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def received(self, link: Link, frame: TxnPrepare | TxnOutcome) -> None:
        """The participant's part of a local transaction."""
        if self.participant is None:
            return
        if isinstance(frame, TxnOutcome):
            self._ready.pop(frame.txid, None)
            await self.participant.outcome(frame.vpn, frame.txid, frame.commit)
            if not frame.commit and self.applier is not None:
                self.applier.forget_prepared(frame.txid)
            return
        voted = await self.participant.prepare(
            frame.vpn,
            frame.txid,
            frame.events,
            functools.partial(self._get_ready, frame),
            owner=frame.owner or None,
        )
        if not voted:
            self._ready.pop(frame.txid, None)
            if self.applier is not None:
                self.applier.forget_prepared(frame.txid)
        elif self.applier is not None:
            # a late prepare: the active went on without the vote, and the
            # stream applied the group before the row was written
            index = self.applier.arrived_before_its_row(frame.txid)
            if index is not None:
                await self.participant.settle(frame.vpn, frame.txid, index)
        epoch = link.conn.known_epoch(frame.vpn)
        link.try_send(TxnVote(frame.vpn, epoch, frame.txid, voted is not None))

    def _get_ready(self, frame: TxnPrepare, voted: Voted) -> None:
        """The early commit's statement, built while the participant's row
        is written (for a yes vote; a no drops it), so the active's broker
        commit is not kept waiting for it; and the applier learns the
        events by which the stream's copy of the group settles the row."""
        if not voted or self.applier is None:
            return
        self.applier.expect(frame.vpn, frame.txid, voted)
        self._ready[frame.txid] = self.applier.ready_early_commit(frame.vpn, frame.txid, voted)
        if len(self._ready) > READY_KEPT:
            self._ready.popitem(last=False)

    async def ask_in_doubt(self, link: Link, vpn: str) -> None:
        """After a (re)sync: ask the active how our prepared transactions ended."""
        if self.participant is None:
            return
        try:
            txids = await self.participant.in_doubt(vpn)
        except psycopg.Error as e:
            log.warning("bridge: VPN %s: in-doubt transactions not read: %s", vpn, e)
            return
        if txids:
            log.info(
                "bridge: VPN %s: asking the active about %d prepared transaction(s)",
                vpn,
                len(txids),
            )
            epoch = link.conn.known_epoch(vpn)
            link.try_send(TxnQuery(vpn, epoch, tuple(txids[:1000])))

    async def commit_early(self, link: Link, stream: StandbyStream, frame: TxnCommit) -> None:
        """Commit a transaction from its prepared row before its group comes
        with the stream (``bridge.standby._early``) and say so; if that is not
        possible now, say that: the group comes with the stream (the active
        holds it until this answer), and its ``Ack`` is what the active
        waits for then."""
        applier = self.applier
        assert applier is not None  # noqa: S101 - the standby's bridge set it
        vpn, txid = stream.vpn, frame.txid
        ready = self._ready.pop(txid, None)
        last: int | None = None
        try:
            statement = None
            if ready is not None:
                statement = applier.early_commit_statement(vpn, ready, frame.first, stream.early)
            if ready is not None and statement is not None:
                # the usual case: one statement, on this loop (no thread hop)
                if await self._run_early(statement):
                    last = applier.committed_early(vpn, ready, frame.first)
            else:
                last = await asyncio.to_thread(
                    applier.apply_prepared, vpn, txid, frame.epoch, frame.first, stream.early
                )
        except (BridgeError, psycopg.Error, ValueError) as e:
            if isinstance(e, StandbyUnavailable):
                applier.forget_early(vpn)  # it may have committed
            why = describe_error(e)
            log.warning("bridge: VPN %s: transaction %s left to the stream: %s", vpn, txid, why)
        if last is not None:
            stream.early = last
            failpoint("participant.after-early-commit")
        epoch = link.conn.known_epoch(vpn)
        link.try_send(TxnApplied(vpn, epoch, txid, last is not None))

    async def _run_early(self, statement: GuardedApply) -> bool:
        """Run an early commit's one statement on this loop; True if its
        guard let it apply."""
        found = await self._on_own_conn(
            statement.vpn, lambda conn: run_guarded_async(conn, statement)
        )
        return found is not None

    async def skip_committed(self, vpn: str, entries: list[LedgerEntry]) -> int | None:
        """The stream's copy of groups committed early, settled by one
        statement on this loop (no thread hop); returns the new applied
        index. None when ``entries`` are anything else, or the statement's
        gate did not hold, or it failed: :meth:`StandbyApplier.apply_batch`
        then checks them against what is stored and applies them as usual."""
        applier = self.applier
        assert applier is not None  # noqa: S101 - the standby's bridge set it
        statement = applier.skip_early_statement(vpn, entries)
        if statement is None:
            return None

        async def run(conn: psycopg.AsyncConnection[Any]) -> Any:
            cur = await conn.execute(*statement)
            return await cur.fetchone()

        try:
            if await self._on_own_conn(vpn, run) is None:
                return None
        except psycopg.Error as e:
            log.debug("bridge: VPN %s: early-committed groups left to the batch: %s", vpn, e)
            return None
        applier.skipped_early(vpn, entries)
        return entries[-1].index

    async def _on_own_conn(
        self, vpn: str, run: Callable[[psycopg.AsyncConnection[Any]], Awaitable[_T]]
    ) -> _T:
        """``run`` on the standby's own connection for the statements it
        runs on this loop (early commits, and the stream's copies of them),
        connected at first use. When the outcome is unknown (a lost
        connection, or cancelled mid-statement) the connection is dropped
        and the VPN's early-committed events are read from the database
        again before its next batch, so nothing is applied twice."""
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            self._conn = None
            conn = await psycopg.AsyncConnection.connect(
                self._dsn, autocommit=True, connect_timeout=10
            )
            self._conn = conn
        try:
            return await run(conn)
        except BaseException as e:
            if isinstance(e, psycopg.Error) and not isinstance(e, psycopg.OperationalError):
                raise  # refused by the database: nothing committed, the connection is fine
            self._conn = None
            if self.applier is not None:
                self.applier.forget_early(vpn)
            with contextlib.suppress(Exception):
                await conn.close()
            raise
