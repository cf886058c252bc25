"""Local transactions as an internal two-phase commit over both sites.

A client's ``tx.commit`` on a channel that published or acked replicated
messages runs this protocol (the steps are :mod:`txn.local._machine`'s table):

1. **Prepare.** The transaction's events are written as a ``prepared``
   ``txn_log`` row on the active site (coordinator) and — for a sync-mode
   VPN — sent to the standby, which writes its own ``prepared`` row
   (participant) and votes. Both writes run at once, the standby's
   request sent first (its round, a bridge trip each way, is the longer). The VPN's
   ``on-sync-timeout`` applies when the standby does not vote in time:
   ``reject`` refuses the commit (the client's channel is closed with 406;
   the broker rolls back; both rows are marked aborted: nothing is applied
   anywhere), ``degrade`` goes on without it (the row is marked degraded and
   the standby gets the transaction asynchronously, with the ledger).
2. **Broker commit.** The listener sends the held ``tx.commit`` behind a
   commit marker: a persistent publish of the transaction id to the VPN's
   ``vpnrepl.txn-markers`` queue in the same broker transaction. The broker
   is the last resource: it cannot prepare, but its outcome stays
   discoverable — the marker exists exactly when the broker committed.
3. **Decision.** On ``tx.commit-ok`` the transaction's events are appended
   to the active's ledger as one group (one database transaction: all or
   none). That group *is* the commit record; the coordinator's row moves
   ``prepared`` → ``committed`` in the same statement
   (``LedgerWriter.append_group(decision=...)``), so the row says committed
   exactly when the group is in the ledger, at no extra commit. A delivery
   of a message the transaction published also proves the broker
   committed, and the decision is recorded at once then, so the ledger
   never holds an ack before the publish it acks.
4. **Standby commit and reply.** For a sync-mode VPN the coordinator
   sends ``TxnCommit`` (the group's first index) as it appends the group,
   and the standby commits the transaction from its prepared row while the
   active's ledger write runs, answering ``TxnApplied`` yes — when its state
   is exactly what precedes the group; otherwise it answers no and applies
   the group when the stream brings it (the stream holds the group until
   the answer), like any ledger entries (messages inserted, acked ones
   removed, applied index in the same database transaction), and
   acknowledges. A group committed early is skipped when the stream brings
   it, recognised by its events, not by its index (``bridge.standby._early``).
   The client's ``tx.commit-ok`` waits for the durable group here and for
   ``TxnApplied`` or the acknowledgement, so it is sent only when prepare
   and commit are durable on both sites. (A group durable here before the
   answer waits in the VPN's sync gate; a yes takes it out again, so the
   stream's later acknowledgement is never counted as a sync timeout.)
   Then the
   bookkeeping, in batches rather than a database commit per transaction
   on the client's path: a participant's row is marked committed in the
   standby's transaction that applies its group (early, or the stream's
   copy), never by an outcome (:class:`txn.local._participant.Participant`);
   ``TxnOutcome`` aborts rows; the coordinator's rows end in the sweep
   once the standby's acknowledged index has passed their groups, and the
   markers are removed.

**Confirmed without the standby.** A transaction degraded — the standby's
vote late under ``degrade``, or its acknowledgement late after the broker
committed (either policy) — has its ledger group recorded as a
sync-ineligible window (``sync_window``, through the sink's
``confirmed_without_standby``) before the client is told: the machine's
``Answer`` and the actions after it are performed once that row is
durable, in the order the machine gave them. A group released by a
``degrade`` sync gate's timeout is inside the gate's own window (the gate
holds the answer until that is recorded).

**Recovery** (either node, at start, before clients are accepted): every
coordinator row still ``prepared`` is resolved — its group in the ledger
after ``ledger_floor`` means the decision was made (mark committed); else
its marker in the broker means the broker committed (record the decision
now); else the broker did not commit (abort on both sites). A standby
resolves its own prepared rows by asking the active when the bridge
connects (``TxnQuery``): aborted or unknown → aborted (presumed abort: the
broker commit waits for the coordinator's row to be durable, so no row
means no commit); committed or ended → the row waits for its group, which
the resync brings and which settles it.

**Why a client's confirmed transaction is never lost or half-applied:** the
client gets ``tx.commit-ok`` only after the group is durable in the active's
ledger (and, sync mode, applied by the standby). The ledger group is one
database transaction, the standby applies with its applied index in the
same transaction, and a lagging or restarted standby replays the ledger, so
both sites end with all of the group or none of it. A standby that
committed early a group the active then lost in a crash holds a
transaction whose marker exists (``TxnCommit`` is sent only once the broker
committed), so the active's recovery re-appends the group, and the standby
recognises it wherever it lands. A crash before the
decision leaves a prepared row whose outcome the marker decides, with the
broker's own transaction as the source of truth; the client never got
``tx.commit-ok`` in that case, and both sites follow the broker.

**Residual risk, left to reconciliation:** RabbitMQ does not promise that a
transaction spanning several queues is all-or-nothing when the *broker*
crashes in the middle of its commit (the marker may survive while a message
in another queue does not, or the reverse). A standby promoted while the
active site is lost resolves its in-doubt rows by presumed abort, although
the lost broker may have committed them (the clients never got
``tx.commit-ok``). A transaction's broker commit racing the node's crash
is resolved by the marker read at the next start, which assumes the broker
has finished with the dead connection by then (it has, within milliseconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from bridge import (
    Consumed,
    DeadLettered,
    Event,
    LocalTransaction,
    Mode,
    Published,
    SyncTimeoutPolicy,
    TransactionRefused,
    VpnSettings,
    failpoint,
    future_callback,
)
from bridge.ledger import LedgerError

from ._log import COORDINATOR, TxnLog, TxnRow, encode_events
from ._machine import (
    Action,
    Answer,
    AwaitStandbyAck,
    CommitEarly,
    Forget,
    Input,
    MarkDegraded,
    OpenStandbyPhase,
    Phase,
    RecordDecision,
    Refuse,
    RetireMarker,
    SendBrokerCommit,
    SendOutcome,
    StandbySettled,
    TxnMachine,
    TxnProtocolError,
    WithdrawStandbyWait,
)
from ._markers import MarkerError, MarkerStore, marker_txid

__all__ = ["Coordinator", "GroupLedger", "StandbyLink", "TxnStats"]

log = logging.getLogger(__name__)
tracer = trace.get_tracer("vpnrepl.txn")

#: how long after a broken connection a transaction is settled by its marker
RESOLVE_DELAY = 1.0
#: how long a transaction waits for its prepared row in the site's own
#: database before it is refused (as long as a plain publish waits for its
#: ledger entry before its nack)
PREPARE_BOUND_SECONDS = 10.0
#: how long a client waits for its commit decision to be durable in the
#: site's own database after the broker committed; then its connection is
#: closed, the outcome unknown to it (the decision still commits once the
#: database answers)
DECISION_BOUND_SECONDS = 10.0
#: markers of ended transactions are removed in sweeps this often
SWEEP_SECONDS = 5.0
#: how long a transaction's row stays in ``txn_log`` after it is over on
#: both sites (kept for an operator to look at; pruned by the sweep)
TXN_RETAIN_SECONDS = 3600.0
#: every how many sweeps the over rows are pruned
PRUNE_EVERY = 12


class GroupLedger(Protocol):
    """What the coordinator needs of the ledger writer."""

    def append_group(
        self,
        events: Sequence[Event],
        on_durable: Callable[[bool], None] | None,
        *,
        decision: str | None = None,
    ) -> int:
        """Append ``events`` as one all-or-nothing group, moving ``decision``'s
        ``txn_log`` row to committed in the same transaction; returns the
        last index."""

    def durable_index(self, vpn: str) -> int: ...


class StandbyLink(Protocol):
    """The active's side of the bridge, as the coordinator uses it."""

    def prepare(
        self, vpn: str, txid: str, events: bytes, within: float, owner: str | None = None
    ) -> Awaitable[bool]:
        """Send the standby ``txid``'s prepare now (``owner``: an XA
        branch's broker user, for its row there); the awaitable is True
        once its participant voted yes within ``within`` seconds. ``events``
        in :func:`txn.local._log.encode_events` form."""

    def commit_early(self, vpn: str, txid: str, first: int, on_applied: Callable[[], None]) -> bool:
        """Tell the standby the broker committed ``txid`` (its group at
        ``first`` onwards); ``on_applied()`` runs if it applies it before
        the group comes with the stream. False if nothing was sent."""

    def outcome(self, vpn: str, txid: str, commit: bool) -> None:
        """Tell the standby how ``txid`` ended (best effort: it asks again)."""


class SyncWait(Protocol):
    """Waits for the standby to acknowledge a ledger index (the sync gate),
    and records what was confirmed without it."""

    def wait_standby(
        self, vpn: str, index: int, resolve: Callable[[bool], None], first: int | None = None
    ) -> bool:
        """Call ``resolve(acked)`` once the standby acknowledged ``index`` or the
        sync timeout passed; False when the VPN has no sync gate. ``first``:
        the first index of the group waiting at ``index``. Called in the
        ledger's durable callback of ``index``."""

    def withdraw(self, vpn: str, index: int) -> None:
        """Stop a :meth:`wait_standby` for ``index``; ``resolve`` is never called."""

    def confirmed_without_standby(
        self, vpn: str, first: int, last: int, then: Callable[[], None]
    ) -> bool:
        """Record ``first``..``last`` as a sync-ineligible window and call
        ``then()`` once that is durable; False (no call) when windows are
        not recorded."""


@dataclass
class TxnStats:
    """Counters the coordinator bumps inline; ``/metrics`` reads them."""

    #: (vpn, outcome) -> transactions that ended so (the ``txn.outcome`` span attribute)
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: vpn -> transactions the standby committed early (ahead of the ledger stream)
    committed_early: Counter[str] = field(default_factory=Counter)


@dataclass
class _Live:
    txn: LocalTransaction
    machine: TxnMachine
    done: asyncio.Future[bool]
    span: Span  # the transaction's span, parent of one span per phase
    stats: TxnStats
    published: tuple[bytes, ...] = ()
    #: a client's XA branch: its id (the broker commit waits for its commit)
    xid: str | None = None
    #: an XA branch's broker user
    owner: str | None = None
    phase: Span | None = None  # the phase under way
    finished: bool = False  # its outcome is counted and its span ended
    #: the listener's answer to call once the commit is recorded (commit_soon)
    on_done: Callable[[BaseException | None], None] | None = None
    #: a degraded transaction's group was handed over to be recorded as a
    #: sync-ineligible window (its answer waits for that)
    window_asked: bool = False
    #: closes the client's wait if the decision is not durable in time
    late_answer: asyncio.TimerHandle | None = None
    #: the client was told the outcome is unknown (the decision was late)
    answered_late: bool = False

    def enter(self, phase: str | None) -> None:
        """End the phase under way and start ``phase`` (None: no next phase)."""
        if self.phase is not None:
            self.phase.end()
            self.phase = None
        if phase is not None:
            self.phase = tracer.start_span(phase, context=trace.set_span_in_context(self.span))

    def finish(self, outcome: str, error: str | None = None) -> None:
        """End the transaction's spans (once) with its outcome."""
        if self.finished:
            return
        self.finished = True
        if self.xid is None:  # a client's XA branch is counted as such (txn.branches._manager)
            self.stats.outcomes[(self.txn.vpn, outcome)] += 1
        self.enter(None)
        self.span.set_attribute("txn.outcome", outcome)
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()


class Coordinator:
    """Drives :class:`~txn.local._machine.TxnMachine` with the database, the
    ledger, the bridge and the broker's markers (see the module docstring)."""

    def __init__(
        self,
        txn_log: TxnLog,
        markers: MarkerStore,
        ledger: GroupLedger,
        sync: SyncWait,
        link: StandbyLink | None = None,
    ) -> None:
        self.log = txn_log
        self.markers = markers
        self.ledger = ledger
        self.sync = sync
        self.link = link
        self.settings: dict[str, VpnSettings] = {}
        self.stats = TxnStats()
        self._live: dict[str, _Live] = {}
        #: replication id of a message a committing transaction published -> txid
        self._committing_ids: dict[bytes, str] = {}
        self._decided: dict[str, set[str]] = {}  # vpn -> txids whose markers can go
        self._tasks: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        #: how each action after the broker commit is performed
        self._performers: dict[type[Action], Callable[[_Live, Any], None]] = {
            RecordDecision: self._record_decision,
            CommitEarly: self._commit_early,
            OpenStandbyPhase: self._open_standby_phase,
            AwaitStandbyAck: self._await_standby_ack,
            WithdrawStandbyWait: self._withdraw_standby_wait,
            StandbySettled: self._standby_settled,
            MarkDegraded: self._mark_degraded,
            RetireMarker: self._retire_marker,
            Answer: self._answer,
            SendOutcome: self._send_outcome,
        }

    def configure(self, settings: VpnSettings) -> None:
        self.settings[settings.name] = settings

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="txn-marker-sweep")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for live in self._live.values():
            live.finish("interrupted", "the node stopped before the transaction ended")

    # -- the listener's side (through the Replicator sink) -------------------

    def prepare(
        self, txn: LocalTransaction, xid: str | None = None, owner: str | None = None
    ) -> Awaitable[None]:
        """Start ``txn``'s prepare now and return what finishes it (raises
        :class:`TransactionRefused` from the awaitable, or at once for a VPN
        not replicated here). The standby's request goes out before this
        returns when the VPN's marker queue is known to exist: the
        standby's round is the longer one, and the caller's task that
        awaits the rest starts an event-loop turn later.

        With ``xid`` it is a client's XA branch: the standby's durable vote
        is needed whatever the VPN's mode and policy (a late vote is a no),
        and the prepare ends there: the broker commit waits for the
        transaction manager's commit (:meth:`xa_commit_sent`); ``owner`` is
        the broker user that started the branch, kept in its rows on both
        sites."""
        settings = self.settings.get(txn.vpn)
        if settings is None:
            raise TransactionRefused(f"VPN {txn.vpn!r} is not replicated as active here")
        if xid is not None and self.link is None:
            raise TransactionRefused("no standby site is linked: an XA branch needs its vote")
        machine = TxnMachine(
            txn.txid,
            needs_standby=(settings.mode is Mode.SYNC or xid is not None) and self.link is not None,
            reject=settings.on_sync_timeout is SyncTimeoutPolicy.REJECT or xid is not None,
        )
        attrs = _attrs(txn) if xid is None else {**_attrs(txn), "xid": xid}
        span = tracer.start_span("txn" if xid is None else "xa", attributes=attrs)
        live = _Live(txn, machine, asyncio.get_running_loop().create_future(), span, self.stats)
        live.xid, live.owner = xid, owner
        self._live[txn.txid] = live
        live.enter("txn.prepare")
        encoded = encode_events(txn.events)  # once: the local row and the standby's
        remote = (
            self._ask_standby(live, settings, encoded) if self.markers.declared(txn.vpn) else None
        )
        return self._prepared(live, settings, encoded, remote)

    def _ask_standby(
        self, live: _Live, settings: VpnSettings, encoded: bytes
    ) -> Awaitable[bool] | None:
        """Send the standby ``live``'s prepare (sync mode); its vote to await."""
        if not live.machine.needs_standby or self.link is None:
            return None
        txn = live.txn
        within = settings.sync_timeout_ms / 1000
        return self.link.prepare(txn.vpn, txn.txid, encoded, within, live.owner)

    async def _prepared(
        self,
        live: _Live,
        settings: VpnSettings,
        encoded: bytes,
        remote: Awaitable[bool] | None,
    ) -> None:
        txn = live.txn
        try:
            await self._prepare(live, settings, encoded, remote)
        except psycopg.Error as e:
            self._live.pop(txn.txid, None)
            if self.link is not None:  # the standby may have prepared: it aborts
                self.link.outcome(txn.vpn, txn.txid, commit=False)
            live.finish("refused", "the site database did not take the prepare")
            raise TransactionRefused(f"the site database did not take the prepare: {e}") from e
        except TransactionRefused as e:
            self._live.pop(txn.txid, None)
            live.finish("refused", str(e))
            raise
        except BaseException:
            self._live.pop(txn.txid, None)
            live.finish("interrupted", "the prepare was interrupted")
            raise
        live.enter("txn.broker_commit" if live.xid is None else None)

    async def _prepare(
        self,
        live: _Live,
        settings: VpnSettings,
        encoded: bytes,
        asked: Awaitable[bool] | None,
    ) -> None:
        txn, machine = live.txn, live.machine
        try:
            await self.markers.declare(txn.vpn)
        except MarkerError as e:
            raise TransactionRefused(f"the commit marker queue is not available: {e}") from e
        floor = self.ledger.durable_index(txn.vpn)
        if asked is None:  # the first of its VPN: the standby is asked once the queue exists
            asked = self._ask_standby(live, settings, encoded)
        remote = None if asked is None else asyncio.ensure_future(asked)
        local = asyncio.ensure_future(
            self.log.prepare(
                txn.txid,
                txn.vpn,
                COORDINATOR,
                encoded,
                ledger_floor=floor,
                xid=live.xid,
                xa_owner=live.owner,
            )
        )
        await self._local_prepared(txn, local, remote)
        if machine.phase is Phase.ABORTED:  # abort() may have run before the row existed
            await self._forget(txn)
        _still_wanted(machine)
        actions = machine.feed(Input.LOCAL_PREPARED)
        failpoint("coordinator.after-local-prepare")
        if remote is not None:
            voted = await remote
            _still_wanted(machine)
            actions = machine.feed(Input.REMOTE_PREPARED if voted else Input.REMOTE_TIMEOUT)
            if live.phase is not None:
                live.phase.set_attribute("txn.standby_voted", voted)
        await self._perform_prepared(txn, settings, actions)
        failpoint("coordinator.after-prepare")
        if live.xid is None:
            self._commit_sent(live)

    def _commit_sent(self, live: _Live) -> None:
        """The broker commit went out: a delivery of a message the
        transaction published now proves the broker committed it."""
        live.machine.feed(Input.BROKER_COMMIT_SENT)
        live.published = tuple(e.repl_id.value for e in live.txn.events if isinstance(e, Published))
        for rid in live.published:
            self._committing_ids[rid] = live.txn.txid

    def xa_commit_sent(self, txid: str) -> None:
        """A prepared XA branch's broker commit (its marker and tx.commit)
        went out on its channel; :meth:`commit` follows its commit-ok."""
        live = self._live.get(txid)
        if live is None or live.machine.phase is not Phase.PREPARED:
            raise TransactionRefused(f"XA branch {txid} is not prepared here")
        live.enter("txn.broker_commit")
        self._commit_sent(live)

    def detach(self, txid: str) -> None:
        """A prepared XA branch lost its channel (the broker rolled its
        transaction back): it lives on in ``txn_log`` alone."""
        live = self._live.pop(txid, None)
        if live is not None:
            live.finish("detached")

    async def _perform_prepared(
        self, txn: LocalTransaction, settings: VpnSettings, actions: list[Action]
    ) -> None:
        """The actions once the votes are in: refuse, or (maybe degraded) let
        the broker commit."""
        for action in actions:
            if isinstance(action, Forget):
                await self._forget(txn)
            elif isinstance(action, Refuse):
                raise TransactionRefused(
                    f"{action.reason} ({settings.sync_timeout_ms} ms); nothing was applied"
                )
            elif isinstance(action, MarkDegraded):
                log.warning(
                    "VPN %s: transaction %s committed without the standby's prepare (degraded)",
                    txn.vpn,
                    txn.txid,
                )
                await self.log.move(txn.txid, "prepared", leaving=("prepared",), degraded=True)
        if not any(isinstance(a, SendBrokerCommit) for a in actions):
            raise TxnProtocolError(f"transaction {txn.txid}: prepared without both votes")

    def before_consumed(self, event: Consumed | DeadLettered) -> None:
        """A delivery of ``event``'s message was acked: if a committing
        transaction published it, the broker has committed that transaction;
        record the decision first, so the ledger holds the publish before
        the ack."""
        txid = self._committing_ids.get(event.repl_id.value)
        if txid is not None:
            live = self._live.get(txid)
            if live is not None:
                self._decide(live)

    async def commit(self, txn: LocalTransaction) -> None:
        """The broker committed (tx.commit-ok): decide, then return when the
        client may be told (:meth:`commit_soon`, awaited)."""
        answer: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

        def done(error: BaseException | None) -> None:
            if not answer.done():
                answer.set_result(error)

        self.commit_soon(txn, done)
        error = await answer
        if error is not None:
            raise error

    def commit_soon(
        self, txn: LocalTransaction, done: Callable[[BaseException | None], None]
    ) -> None:
        """The broker committed (tx.commit-ok): decide; ``done(None)`` once
        the client may be told, ``done(TransactionRefused)`` if the decision
        could not be recorded. ``done`` runs in the callback that settles
        the transaction (the standby's answer, the ledger's commit), so the
        listener writes ``tx.commit-ok`` at once."""
        live = self._live.get(txn.txid)
        if live is None:
            done(TransactionRefused(f"transaction {txn.txid} is not in flight"))
            return
        failpoint("coordinator.after-broker-commit")
        live.on_done = done
        self._decide(live)
        if live.done.done():  # settled already (a delivery decided it first)
            self._release(live, live.done.result())

    def _release(self, live: _Live, ok: bool) -> None:
        """The commit is recorded (``ok``) or cannot be: tell whoever waits."""
        if not live.done.done():
            live.done.set_result(ok)
        done, live.on_done = live.on_done, None
        if done is None:
            if live.answered_late:  # the client was told already: only the books
                self._live.pop(live.txn.txid, None)
                if ok:
                    live.finish("degraded" if live.machine.degraded else "committed")
                else:
                    live.finish("unrecorded", "the commit decision could not be recorded")
            return  # else no commit-ok came for it yet (resolve() awaits live.done)
        self._live.pop(live.txn.txid, None)
        if not ok:
            live.finish("unrecorded", "the commit decision could not be recorded")
            error: TransactionRefused | None = TransactionRefused(
                "the commit decision could not be recorded"
            )
        else:
            live.finish("degraded" if live.machine.degraded else "committed")
            failpoint("coordinator.after-decision")
            error = None
        try:
            done(error)
        except Exception:
            log.exception("transaction %s: answering the client failed", live.txn.txid)

    def _decide(self, live: _Live) -> None:
        """The broker committed: the machine records the decision (once)."""
        self._feed(live, Input.BROKER_COMMITTED)

    def _feed(self, live: _Live, what: Input) -> None:
        """Feed ``what`` to ``live``'s machine and perform what it answers."""
        try:
            actions = live.machine.feed(what)
        except TxnProtocolError:
            log.exception("transaction %s: a step out of order", live.txn.txid)
            self._release(live, False)
            return
        self._perform(live, actions)

    def _perform(self, live: _Live, actions: list[Action]) -> None:
        """The actions after the broker commit, in order (the prepare's are
        performed by :meth:`_prepare`). A degraded transaction's answer,
        and what follows it, wait until its group is recorded as a
        sync-ineligible window (:meth:`_window_first`)."""
        for i, action in enumerate(actions):
            if isinstance(action, Answer) and self._window_first(live, action, actions[i:]):
                return
            perform = self._performers.get(type(action))
            if perform is None:
                raise TxnProtocolError(f"transaction {live.txn.txid}: {action} after the prepare")
            perform(live, action)

    def _window_first(self, live: _Live, answer: Answer, rest: list[Action]) -> bool:
        """A degraded transaction was committed without the standby: its
        ledger group is recorded as a sync-ineligible window before the
        client is told (``rest``, from ``answer`` on, is performed once that
        is durable). True when ``rest`` now waits for the record."""
        m = live.machine
        if not (answer.ok and m.degraded and m.last_index) or live.window_asked:
            return False
        live.window_asked = True
        return self.sync.confirmed_without_standby(
            live.txn.vpn, m.first_index, m.last_index, lambda: self._perform(live, rest)
        )

    def _commit_early(self, live: _Live, action: CommitEarly) -> None:
        if self.link is not None:
            # the standby commits from its prepared row while the ledger write runs
            txn = live.txn
            self.link.commit_early(
                txn.vpn, txn.txid, action.first, lambda: self._committed_early(live)
            )

    def _open_standby_phase(self, live: _Live, action: OpenStandbyPhase) -> None:
        live.enter("txn.standby_commit")

    def _await_standby_ack(self, live: _Live, action: AwaitStandbyAck) -> None:
        if not self.sync.wait_standby(
            live.txn.vpn,
            action.last,
            lambda acked: self._standby_answered(live, acked),
            live.machine.first_index,
        ):
            self._feed(live, Input.STANDBY_ACKED)  # no sync gate: nothing to wait for

    def _withdraw_standby_wait(self, live: _Live, action: WithdrawStandbyWait) -> None:
        # the group waits in the sync gate: the stream's acknowledgement may
        # come after the VPN's sync timeout, which would count as the
        # standby falling behind
        self.sync.withdraw(live.txn.vpn, action.last)

    def _standby_settled(self, live: _Live, action: StandbySettled) -> None:
        if live.phase is not None:
            live.phase.set_attribute("txn.standby_applied", action.acked)
            live.phase.set_attribute("txn.committed_early", action.early)
        live.enter(None)

    def _mark_degraded(self, live: _Live, action: MarkDegraded) -> None:
        txn = live.txn
        log.warning(
            "VPN %s: transaction %s committed; the standby did not apply it in time",
            txn.vpn,
            txn.txid,
        )
        self._spawn(
            self.log.move(
                txn.txid,
                "committed",
                leaving=("prepared", "committed"),
                degraded=True,
                ledger_last=action.last_index,
            )
        )

    def _retire_marker(self, live: _Live, action: RetireMarker) -> None:
        # decided and recorded: its marker is not needed any more (the row
        # ends in the sweep, once the standby's acknowledged index passed it)
        self.marker_done(live.txn.vpn, live.txn.txid)

    def _answer(self, live: _Live, action: Answer) -> None:
        self._release(live, action.ok)

    def _send_outcome(self, live: _Live, action: SendOutcome) -> None:
        # After the client's answer: the outcome is bookkeeping. This
        # release's participant settles a row with its group and ignores a
        # commit outcome; a standby of the previous release settles the rows
        # it applied from the stream by it, so it is still sent.
        if self.link is not None:
            self.link.outcome(live.txn.vpn, live.txn.txid, commit=True)

    def _record_decision(self, live: _Live, action: RecordDecision) -> None:
        """Append the transaction's events as one group: the decision."""
        for rid in live.published:
            self._committing_ids.pop(rid, None)
        txn = live.txn
        live.enter("txn.decision")
        try:
            last = self.ledger.append_group(
                txn.events, lambda ok: self._decision_durable(live, ok), decision=txn.txid
            )
        except LedgerError as e:
            log.error("VPN %s: transaction %s: decision not recorded: %s", txn.vpn, txn.txid, e)
            self._feed(live, Input.APPEND_FAILED)
            return
        live.late_answer = asyncio.get_running_loop().call_later(
            DECISION_BOUND_SECONDS, self._decision_late, live
        )
        self._perform(live, live.machine.appended(last - len(txn.events) + 1, last))

    def _decision_durable(self, live: _Live, ok: bool) -> None:
        if live.late_answer is not None:
            live.late_answer.cancel()
            live.late_answer = None
        self._feed(live, Input.DECISION_DURABLE if ok else Input.DECISION_LOST)

    def _decision_late(self, live: _Live) -> None:
        """The site's database has not made the decision durable in
        :data:`DECISION_BOUND_SECONDS`: the client stops waiting, told the
        outcome is unknown (the broker committed; the decision commits once
        the database answers, and recovery settles it if the node stops)."""
        live.late_answer = None
        done, live.on_done = live.on_done, None
        if done is None:
            return
        live.answered_late = True
        txn = live.txn
        log.warning(
            "VPN %s: transaction %s: its commit decision is not durable after %g s; "
            "the client is told the outcome is unknown",
            txn.vpn,
            txn.txid,
            DECISION_BOUND_SECONDS,
        )
        try:
            done(
                TransactionRefused(
                    f"the site database did not record the commit decision within "
                    f"{DECISION_BOUND_SECONDS:g} s"
                )
            )
        except Exception:
            log.exception("transaction %s: answering the client failed", txn.txid)

    def _committed_early(self, live: _Live) -> None:
        """The standby committed the transaction early (ahead of the stream)."""
        failpoint("coordinator.after-early-commit")
        self.stats.committed_early[live.txn.vpn] += 1
        self._feed(live, Input.STANDBY_COMMITTED_EARLY)

    def _standby_answered(self, live: _Live, acked: bool) -> None:
        """The sync gate: the stream acknowledged the group, or timed out."""
        self._feed(live, Input.STANDBY_ACKED if acked else Input.STANDBY_TIMEOUT)

    async def abort(self, txn: LocalTransaction) -> None:
        """The broker commit will not happen (the client left, or rolled back)."""
        live = self._live.pop(txn.txid, None)
        if live is not None:
            if live.machine.phase in (Phase.PREPARING, Phase.PREPARED):
                live.machine.feed(Input.ABORT)
            live.finish("aborted")
        await self._forget(txn)

    async def resolve(self, txn: LocalTransaction) -> None:
        """tx.commit went out, its commit-ok never came back: ask the marker."""
        await asyncio.sleep(RESOLVE_DELAY)  # let the broker finish with the connection
        live = self._live.get(txn.txid)
        if live is None or live.machine.phase is not Phase.COMMITTING:
            return  # decided meanwhile (a delivery proved the commit)
        try:
            committed = txn.txid in await self.markers.present(txn.vpn)
        except MarkerError as e:
            log.error(
                "VPN %s: transaction %s stays in doubt until restart: %s", txn.vpn, txn.txid, e
            )
            return
        if committed:
            self._decide(live)
            ok = await live.done
            self._live.pop(txn.txid, None)
            live.finish("committed" if ok else "unrecorded", None if ok else "not recorded")
        else:
            self._live.pop(txn.txid, None)
            for rid in live.published:
                self._committing_ids.pop(rid, None)
            live.finish("aborted", "the broker did not commit (no marker)")
            await self._forget(txn)

    async def _local_prepared(
        self,
        txn: LocalTransaction,
        local: asyncio.Future[bool],
        remote: asyncio.Future[bool] | None,
    ) -> None:
        """Wait for the local prepared row, at most :data:`PREPARE_BOUND_SECONDS`."""
        try:
            await asyncio.wait((local,), timeout=PREPARE_BOUND_SECONDS)
            if not local.done():  # the site's database hangs: the client hears now
                if remote is not None:
                    remote.cancel()
                if self.link is not None:  # the standby may have prepared: it aborts
                    self.link.outcome(txn.vpn, txn.txid, commit=False)
                self._spawn(self._abort_late(txn, local))
                raise TransactionRefused(
                    f"the site database did not record the prepare within "
                    f"{PREPARE_BOUND_SECONDS:g} s; nothing was applied"
                )
            local.result()
        except TransactionRefused:
            raise
        except BaseException:
            if remote is not None:
                remote.cancel()
            local.cancel()
            raise

    async def _abort_late(self, txn: LocalTransaction, local: asyncio.Future[bool]) -> None:
        """A prepare refused for its slow local row: the row is aborted
        once its write is done (or, if the node stops first, by recovery: no
        marker, no commit)."""
        try:
            await local
        except psycopg.Error:
            return  # never written
        await self.log.move(txn.txid, "aborted", leaving=("prepared",))
        log.info("VPN %s: transaction %s: its late prepared row is aborted", txn.vpn, txn.txid)

    async def _forget(self, txn: LocalTransaction) -> None:
        await self.forget_branch(txn.vpn, txn.txid)

    async def forget_branch(self, vpn: str, txid: str) -> None:
        """Mark ``txid``'s prepared rows aborted on both sites."""
        await self.log.move(txid, "aborted", leaving=("prepared",))
        if self.link is not None:
            self.link.outcome(vpn, txid, commit=False)

    def marker_done(self, vpn: str, name: str) -> None:
        """The marker ``name`` is not needed any more: the next sweep takes it."""
        self._decided.setdefault(vpn, set()).add(name)

    async def decide_logged(self, row: TxnRow) -> bool:
        """Record the commit of a prepared XA branch whose work reached the
        broker from its row (its channel had closed): its events as one
        ledger group, then the standby's acknowledgement (up to the VPN's
        sync timeout; True if it came) and its outcome. Raises
        :class:`TransactionRefused` when the decision could not be recorded
        (the branch stays prepared; its marker settles it at the next start).
        Committed without the standby's acknowledgement, its group is
        recorded as a sync-ineligible window before this returns."""
        events = row.recorded_events()
        acked = True
        if not events:
            await self.log.move(row.txid, "committed", leaving=("prepared",))
        else:
            loop = asyncio.get_running_loop()
            durable: asyncio.Future[bool] = loop.create_future()
            answered: asyncio.Future[bool] = loop.create_future()
            last = 0

            def on_durable(ok: bool) -> None:
                # the sync gate's wait is made here, in the ledger's callback
                # (in index order), not after an await
                if not durable.done():
                    durable.set_result(ok)
                first = last - len(events) + 1
                if ok and not self.sync.wait_standby(
                    row.vpn, last, future_callback(answered), first
                ):
                    future_callback(answered)(True)

            try:
                last = self.ledger.append_group(events, on_durable, decision=row.txid)
            except LedgerError as e:
                raise TransactionRefused(f"the commit decision could not be recorded: {e}") from e
            if not await durable:
                raise TransactionRefused("the commit decision could not be made durable")
            acked = await answered
            recorded: asyncio.Future[None] = loop.create_future()
            if not acked and self.sync.confirmed_without_standby(
                row.vpn, last - len(events) + 1, last, lambda: _settle(recorded)
            ):
                await recorded
        self._decided.setdefault(row.vpn, set()).add(row.txid)
        if self.link is not None:
            self.link.outcome(row.vpn, row.txid, commit=True)
        return acked

    # -- recovery and housekeeping -------------------------------------------

    async def recover(self) -> dict[str, str]:
        """Resolve every coordinator row left prepared by a crash; returns
        ``{txid: outcome}`` (``committed``/``aborted``) for the log."""
        outcomes: dict[str, str] = {}
        rows = await self.log.prepared_rows(COORDINATOR)
        markers: dict[str, set[str]] = {}
        for row in rows:
            if row.vpn not in markers:
                markers[row.vpn] = await self.markers.present(row.vpn)
            outcomes[row.txid] = await self._recover_one(row, markers[row.vpn])
        if outcomes:
            log.info(
                "recovered %d in-doubt transaction(s): %s",
                len(outcomes),
                ", ".join(f"{t} {o}" for t, o in outcomes.items()),
            )
        for vpn, present in markers.items():
            done = {t for t in present if outcomes.get(marker_txid(t)) != "prepared"}
            await self.markers.remove(vpn, done)
        return outcomes

    async def _recover_one(self, row: TxnRow, markers: set[str]) -> str:
        with tracer.start_as_current_span("txn.recover", attributes={"txid": row.txid}):
            events = row.recorded_events()
            first = await self.log.decision_index(row)
            if first is not None:  # a group ledgered before decisions moved rows with it
                last = first + len(events) - 1
                await self.log.move(row.txid, "committed", leaving=("prepared",), ledger_last=last)
                return "committed"
            if row.txid in markers:
                loop = asyncio.get_running_loop()
                durable: asyncio.Future[bool] = loop.create_future()
                self.ledger.append_group(events, future_callback(durable), decision=row.txid)
                if not await durable:
                    return "prepared"  # the ledger is down: stays in doubt, retried next start
                return "committed"
            if row.xid is not None:  # an XA branch: its transaction manager decides
                return "prepared"
            await self.log.move(row.txid, "aborted", leaving=("prepared",))
            if self.link is not None:
                self.link.outcome(row.vpn, row.txid, commit=False)
            return "aborted"

    async def outcomes_for(self, txids: Sequence[str]) -> dict[str, bool | None]:
        """For a standby's query: True committed, False aborted (or unknown:
        presumed abort), None still in flight here."""
        states = await self.log.states(txids)
        out: dict[str, bool | None] = {}
        for txid in txids:
            state = states.get(txid)
            if state in ("committed", "ended"):
                out[txid] = True
            elif state == "prepared":
                out[txid] = None
            else:
                out[txid] = False
        return out

    async def _sweep_loop(self) -> None:
        for sweep in itertools.count(1):
            await asyncio.sleep(SWEEP_SECONDS)
            with contextlib.suppress(psycopg.Error):
                await self.log.end_acknowledged()
                if sweep % PRUNE_EVERY == 0:
                    await self.log.prune(TXN_RETAIN_SECONDS)
            for vpn in list(self._decided):
                txids = self._decided.pop(vpn)
                try:
                    await self.markers.remove(vpn, txids)
                except MarkerError as e:
                    log.warning("commit markers not removed yet: %s", e)
                    self._decided.setdefault(vpn, set()).update(txids)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[None]:
        """Run a bookkeeping step (a row's move) in the background; one that
        fails is logged, and recovery at the next start settles the row."""
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning(
                "transaction bookkeeping failed (settled at the next start): %s", task.exception()
            )


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _still_wanted(machine: TxnMachine) -> None:
    """The client left (or rolled back) while the prepare awaited a vote:
    :meth:`Coordinator.abort` aborted it; the prepare ends here."""
    if machine.phase is Phase.ABORTED:
        raise TransactionRefused("the transaction was aborted while it was being prepared")


def _attrs(txn: LocalTransaction) -> dict[str, str | int]:
    return {"vpn": txn.vpn, "txid": txn.txid, "events": len(txn.events)}
