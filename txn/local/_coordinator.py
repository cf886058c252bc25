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
   commit marker: a publish of the transaction id to the VPN's
   ``vpnrepl.commit-markers`` stream in the same broker transaction. The broker
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
   markers are removed (:mod:`txn.local._sweep`).

**Confirmed without the standby.** A transaction degraded — the standby's
vote late under ``degrade``, or its acknowledgement late after the broker
committed (either policy) — has its ledger group recorded as a
sync-ineligible window (``sync_window``, through the sink's
``confirmed_without_standby``) before the client is told: the machine's
``Answer`` and the actions after it are performed once that row is
durable, in the order the machine gave them. A group released by a
``degrade`` sync gate's timeout is inside the gate's own window (the gate
holds the answer until that is recorded).

**Recovery** (either node, at start, before clients are accepted) resolves
the rows a crash left prepared, by the ledger and the markers
(:mod:`txn.local._recovery`).

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
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence

import psycopg

from bridge import (
    Consumed,
    DeadLettered,
    LocalTransaction,
    Mode,
    Published,
    SyncTimeoutPolicy,
    TransactionRefused,
    VpnSettings,
    failpoint,
)

from . import _recovery
from ._collaborators import GroupLedger, ParticipantLink, SyncWait
from ._decision import DecisionSteps
from ._inflight import InFlight, TxnStats, tracer
from ._log import COORDINATOR, TxnLog, TxnRow, encode_events
from ._machine import (
    Action,
    Forget,
    Input,
    MarkDegraded,
    Refuse,
    SendBrokerCommit,
    TxnMachine,
    TxnPhase,
    TxnProtocolError,
)
from ._markers import MarkerError, MarkerStore
from ._sweep import MarkerSweep

__all__ = ["Coordinator"]

log = logging.getLogger(__name__)

#: how long after a broken connection a transaction is settled by its marker
RESOLVE_DELAY = 1.0
#: how long a transaction waits for its prepared row in the site's own
#: database before it is refused (as long as a plain publish waits for its
#: ledger entry before its nack)
PREPARE_BOUND_SECONDS = 10.0


class Coordinator(DecisionSteps):
    """Drives :class:`~txn.local._machine.TxnMachine` with the database, the
    ledger, the bridge and the broker's markers (see the module docstring):
    the prepare here, the steps after the broker commit in
    :class:`~txn.local._decision.DecisionSteps`."""

    def __init__(
        self,
        txn_log: TxnLog,
        markers: MarkerStore,
        ledger: GroupLedger,
        sync: SyncWait,
        link: ParticipantLink | None = None,
    ) -> None:
        self.log = txn_log
        self.markers = markers
        self.ledger = ledger
        self.sync = sync
        self.link = link
        self.settings: dict[str, VpnSettings] = {}
        self.stats = TxnStats()
        self.sweep = MarkerSweep(txn_log, markers)
        self._live: dict[str, InFlight] = {}
        self._committing_ids: dict[bytes, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._performers = self._performer_table()

    def configure(self, settings: VpnSettings) -> None:
        self.settings[settings.name] = settings

    def start(self) -> None:
        self.sweep.start()

    async def close(self) -> None:
        await self.sweep.close()
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
        live = InFlight(txn, machine, asyncio.get_running_loop().create_future(), span, self.stats)
        live.xid, live.owner = xid, owner
        self._live[txn.txid] = live
        live.enter("txn.prepare")
        encoded = encode_events(txn.events)  # once: the local row and the standby's
        remote = (
            self._ask_standby(live, settings, encoded) if self.markers.declared(txn.vpn) else None
        )
        return self._prepared(live, settings, encoded, remote)

    def _ask_standby(
        self, live: InFlight, settings: VpnSettings, encoded: bytes
    ) -> Awaitable[bool] | None:
        """Send the standby ``live``'s prepare (sync mode); its vote to await."""
        if not live.machine.needs_standby or self.link is None:
            return None
        txn = live.txn
        within = settings.sync_timeout_ms / 1000
        return self.link.prepare(txn.vpn, txn.txid, encoded, within, live.owner)

    async def _prepared(
        self,
        live: InFlight,
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
        live: InFlight,
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
        if machine.phase is TxnPhase.ABORTED:  # abort() may have run before the row existed
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

    def _commit_sent(self, live: InFlight) -> None:
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
        if live is None or live.machine.phase is not TxnPhase.PREPARED:
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

    async def abort(self, txn: LocalTransaction) -> None:
        """The broker commit will not happen (the client left, or rolled back)."""
        live = self._live.pop(txn.txid, None)
        if live is not None:
            if live.machine.phase in (TxnPhase.PREPARING, TxnPhase.PREPARED):
                live.machine.feed(Input.ABORT)
            live.finish("aborted")
        await self._forget(txn)

    async def resolve(self, txn: LocalTransaction) -> None:
        """tx.commit went out, its commit-ok never came back: ask the marker."""
        await asyncio.sleep(RESOLVE_DELAY)  # let the broker finish with the connection
        live = self._live.get(txn.txid)
        if live is None or live.machine.phase is not TxnPhase.COMMITTING:
            return  # decided meanwhile (a delivery proved the commit)
        try:
            committed = await self.marker_found(txn.vpn, txn.txid)
        except (MarkerError, psycopg.Error) as e:
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
        self.sweep.done(vpn, name)

    async def decide_logged(self, row: TxnRow) -> bool:
        """Record the commit of a prepared XA branch from its row
        (:func:`txn.local._recovery.decide_logged`)."""
        return await _recovery.decide_logged(
            self.log, self.ledger, self.sync, self.link, self.sweep.done, row
        )

    # -- recovery ------------------------------------------------------------

    async def marker_found(self, vpn: str, txid: str) -> bool:
        """Whether the broker committed prepared transaction ``txid``: its
        marker, looked for from its row's making."""
        since = await self.log.created_at(txid)
        if since is None:
            raise MarkerError(f"transaction {txid} has no txn_log row to date its marker by")
        return txid in await self.markers.present(vpn, since, {txid})

    async def recover(self, vpns: Collection[str] = ()) -> dict[str, str]:
        """Resolve every coordinator row left prepared by a crash; returns
        ``{txid: outcome}`` (``committed``/``aborted``) for the log. The
        legacy marker queues of ``vpns`` are retired meanwhile."""
        return await _recovery.recover(self.log, self.markers, self.ledger, self.link, vpns)

    async def outcomes_for(self, txids: Sequence[str]) -> dict[str, bool | None]:
        """For a standby's query: True committed, False aborted (or unknown:
        presumed abort), None still in flight here."""
        return await _recovery.outcomes_for(self.log, txids)


def _still_wanted(machine: TxnMachine) -> None:
    """The client left (or rolled back) while the prepare awaited a vote:
    :meth:`Coordinator.abort` aborted it; the prepare ends here."""
    if machine.phase is TxnPhase.ABORTED:
        raise TransactionRefused("the transaction was aborted while it was being prepared")


def _attrs(txn: LocalTransaction) -> dict[str, str | int]:
    return {"vpn": txn.vpn, "txid": txn.txid, "events": len(txn.events)}
