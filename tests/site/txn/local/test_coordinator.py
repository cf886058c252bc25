"""The coordinator (txn/local/_coordinator.py, its steps after the broker
commit in _decision.py) on one real site (PostgreSQL, RabbitMQ), the
standby a stub: its rows, its ledger group, its spans, recovery by marker,
and the bounds on the site database's answers.

Its helpers (:func:`txn`, :func:`states`, :func:`active_site`) are those of
the participant's and the log's tests too."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pika
import pika.exceptions
import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bridge import (
    MARKER_QUEUE,
    IdSource,
    LocalTransaction,
    Published,
    TransactionRefused,
    VpnSettings,
)
from bridge.active import Replicator, WindowRecorder
from bridge.ledger import LedgerWriter
from plugin.devtools import LocalSite
from plugin.ops import connect, enable_vpn
from sql import migrate
from txn import MarkerKey
from txn.local import (
    LEGACY_MARKER_QUEUE,
    Coordinator,
    MarkerStore,
    TxnLog,
)

SPANS = InMemorySpanExporter()
_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(SPANS))
trace.set_tracer_provider(_provider)


class NoStandby:
    def wait_standby(self, vpn: str, index: int, resolve: object, first: int | None = None) -> bool:
        return False  # an async VPN: nothing to wait for

    def withdraw(self, vpn: str, index: int) -> None:
        raise AssertionError("nothing waits")

    def confirmed_without_standby(self, vpn: str, first: int, last: int, then: object) -> bool:
        return False  # no windows recorded


def txn(ids: IdSource, sequence: int) -> LocalTransaction:
    events = tuple(
        Published("v", ids.next(), "", "q", b"\x10\x00\x02", b"body", ("q",)) for _ in range(3)
    )
    return LocalTransaction("v", 1, 1, sequence, events, incarnation=ids.incarnation)


def states(dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn) as db:
        return dict(db.execute("SELECT txid, state FROM txn_log").fetchall())


def active_site(site: LocalSite) -> str:
    """``site`` with VPN ``v`` enabled as active (its vhost too); its DSN."""
    dsn = site.pg.dsn()
    migrate(dsn)
    with connect(dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args("v", "active"))
    site.rabbit.add_vhost("v")
    return dsn


async def opened(dsn: str) -> tuple[TxnLog, LedgerWriter]:
    """The active site's transaction log and ledger writer, VPN ``v`` open."""
    log = TxnLog(dsn)
    await log.open()
    writer = LedgerWriter(dsn)
    await writer.start()
    await writer.open_vpn("v")
    return log, writer


def test_commit_abort_recovery_and_spans(site_a: LocalSite) -> None:
    dsn = active_site(site_a)
    ids = IdSource(9)
    committed, aborted, in_doubt_marked, in_doubt_bare, in_doubt_forged = (
        txn(ids, n) for n in range(1, 6)
    )
    key = MarkerKey.new()

    async def scenario() -> dict[str, str]:
        async with LedgerWriter(dsn) as writer:
            await writer.open_vpn("v")
            log = TxnLog(dsn)
            await log.open()
            c = Coordinator(
                log, MarkerStore(site_a.rabbit.amqp_url(), key=key), writer, NoStandby()
            )
            c.configure(VpnSettings.from_args("v", "active"))
            await c.prepare(committed)
            await c.commit(committed)  # (the broker commit is the listener's part)
            # committed with its ledger group, no later bookkeeping step
            assert states(dsn)[committed.txid] == "committed"
            await c.prepare(aborted)
            await c.abort(aborted)
            # three transactions a crash leaves prepared; only one reached the
            # broker, and a client routed a message naming another into the queue
            await c.prepare(in_doubt_marked)
            await c.prepare(in_doubt_bare)
            await c.prepare(in_doubt_forged)
            conn = pika.BlockingConnection(pika.URLParameters(site_a.rabbit.amqp_url("v")))
            ch = conn.channel()
            # the marker publish the listener makes inside the broker transaction
            for body in (key.body("v", in_doubt_marked.txid), in_doubt_forged.txid.encode()):
                ch.basic_publish("", MARKER_QUEUE, body, pika.BasicProperties(delivery_mode=2))
            conn.close()
            restarted = Coordinator(
                log, MarkerStore(site_a.rabbit.amqp_url(), key=key), writer, NoStandby()
            )
            outcomes = await restarted.recover()
            await writer.wait_durable("v", 6)
            # rows end once the standby acknowledged their groups: up to the first
            with psycopg.connect(dsn, autocommit=True) as db:
                db.execute("UPDATE vpn_state SET applied_index = 3 WHERE vpn = 'v'")
            assert await log.end_acknowledged() == 1
            await c.close()
            await log.close()
            return outcomes

    outcomes = asyncio.run(scenario())
    assert outcomes == {
        in_doubt_marked.txid: "committed",
        in_doubt_bare.txid: "aborted",
        in_doubt_forged.txid: "aborted",  # an untagged marker is no marker
    }
    rows = states(dsn)
    assert rows[committed.txid] == "ended" and rows[aborted.txid] == "aborted"
    assert rows[in_doubt_marked.txid] == "committed" and rows[in_doubt_bare.txid] == "aborted"
    assert rows[in_doubt_forged.txid] == "aborted"
    with psycopg.connect(dsn) as db:  # two groups of three: the commit and the recovered one
        assert db.execute("SELECT count(*) FROM ledger WHERE vpn = 'v'").fetchone() == (6,)
    # one span per transaction with its outcome, one per phase below it
    spans = SPANS.get_finished_spans()
    roots = {s.attributes["txid"]: s for s in spans if s.name == "txn" and s.attributes}
    assert {t: r.attributes["txn.outcome"] for t, r in roots.items() if r.attributes} == {
        committed.txid: "committed",
        aborted.txid: "aborted",
        in_doubt_marked.txid: "interrupted",  # the node stopped (here: closed) meanwhile
        in_doubt_bare.txid: "interrupted",
        in_doubt_forged.txid: "interrupted",
    }
    root = roots[committed.txid].context
    phases = [s.name for s in spans if s.parent is not None and s.parent.span_id == root.span_id]
    assert phases == ["txn.prepare", "txn.broker_commit", "txn.decision"]  # async: no standby
    names = [s.name for s in spans]
    assert names.count("txn.prepare") == 5 and names.count("txn.broker_commit") == 5
    assert names.count("txn.decision") == 1 and names.count("txn.recover") == 3


def test_recovery_across_the_upgrade_to_the_marker_stream(site_a: LocalSite) -> None:
    """A site upgraded with transactions in doubt whose markers are in the
    classic queue of earlier releases: recovery reads them there (one
    committed, one aborted), acks the stale markers of transactions long
    over, and deletes the queue; the next marker goes to the stream."""
    dsn = active_site(site_a)
    ids = IdSource(21)
    marked, bare = txn(ids, 1), txn(ids, 2)
    key = MarkerKey.new()

    async def scenario() -> dict[str, str]:
        log, writer = await opened(dsn)
        c = Coordinator(log, MarkerStore(site_a.rabbit.amqp_url(), key=key), writer, NoStandby())
        c.configure(VpnSettings.from_args("v", "active"))
        await c.prepare(marked)
        await c.prepare(bare)
        conn = pika.BlockingConnection(pika.URLParameters(site_a.rabbit.amqp_url("v")))
        ch = conn.channel()
        ch.queue_declare(LEGACY_MARKER_QUEUE, durable=True)
        for name in (marked.txid, "1.2.3.4", "1.2.3.5"):  # the last two: stale
            ch.basic_publish("", LEGACY_MARKER_QUEUE, key.body("v", name))
        conn.close()
        restarted = Coordinator(
            log, MarkerStore(site_a.rabbit.amqp_url(), key=key), writer, NoStandby()
        )
        outcomes = await restarted.recover(["v"])
        await c.close()
        await restarted.close()
        await writer.close()
        await log.close()
        return outcomes

    assert asyncio.run(scenario()) == {marked.txid: "committed", bare.txid: "aborted"}
    conn = pika.BlockingConnection(pika.URLParameters(site_a.rabbit.amqp_url("v")))
    try:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as gone:
            conn.channel().queue_declare(LEGACY_MARKER_QUEUE, passive=True)
        assert gone.value.reply_code == 404
    finally:
        conn.close()


def test_commit_soon_answers_once_the_decision_is_recorded(site_a: LocalSite) -> None:
    """The listener's way in (``commit_soon``): one answer per transaction —
    None once the decision is durable, a refusal for a transaction that is
    not in flight (at once) or whose decision the ledger did not take."""
    dsn = active_site(site_a)
    ids = IdSource(13)
    unknown, t1, t2 = (txn(ids, n) for n in range(1, 4))

    async def scenario() -> None:
        log, writer = await opened(dsn)
        c = Coordinator(log, MarkerStore(site_a.rabbit.amqp_url()), writer, NoStandby())
        c.configure(VpnSettings.from_args("v", "active"))
        answers: list[BaseException | None] = []
        c.commit_soon(unknown, answers.append)
        assert len(answers) == 1 and isinstance(answers[0], TransactionRefused)
        await c.prepare(t1)
        c.commit_soon(t1, answers.append)
        assert len(answers) == 1  # not before its ledger group is durable
        await writer.wait_durable("v", len(t1.events))
        await asyncio.sleep(0)
        assert answers[1:] == [None]
        assert states(dsn)[t1.txid] == "committed"
        await c.prepare(t2)
        await writer.close()  # the decision cannot be recorded any more
        c.commit_soon(t2, answers.append)
        assert len(answers) == 3 and isinstance(answers[2], TransactionRefused)
        await c.close()
        await log.close()

    asyncio.run(scenario())
    assert states(dsn)[t2.txid] == "prepared"  # in doubt: the next start decides by marker


class RecordingStandby:
    """The bridge's side as the coordinator sees it, for a sync VPN whose
    standby votes yes and applies ahead the transactions in ``ahead``;
    every call lands in ``calls`` (with the client's answers)."""

    def __init__(self, ahead: set[str], calls: list[tuple[str, str]]) -> None:
        self.ahead, self.calls = ahead, calls

    def prepare(
        self, vpn: str, txid: str, events: bytes, within: float, owner: str | None = None
    ) -> asyncio.Future[bool]:
        vote: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        vote.set_result(True)
        return vote

    def commit_early(self, vpn: str, txid: str, first: int, on_applied: object) -> bool:
        if txid in self.ahead:
            asyncio.get_running_loop().call_soon(on_applied)  # type: ignore[arg-type]
        return True

    def outcome(self, vpn: str, txid: str, commit: bool) -> None:
        self.calls.append(("outcome", txid))

    def wait_standby(self, vpn: str, index: int, resolve: object, first: int | None = None) -> bool:
        asyncio.get_running_loop().call_soon(resolve, True)  # type: ignore[arg-type]
        return True  # the stream's acknowledgement, for one not committed early

    def withdraw(self, vpn: str, index: int) -> None:
        self.calls.append(("withdraw", str(index)))

    def confirmed_without_standby(self, vpn: str, first: int, last: int, then: object) -> bool:
        return False  # no windows recorded


def test_a_transaction_committed_early_sends_the_standby_no_outcome(site_a: LocalSite) -> None:
    """The standby settles a transaction it applied ahead by itself (with
    the stream's copy of its group); one it applied from the stream learns
    its outcome — after the client's answer, never before it."""
    dsn = active_site(site_a)
    ids = IdSource(17)
    ahead, streamed = txn(ids, 1), txn(ids, 2)
    calls: list[tuple[str, str]] = []

    async def scenario() -> None:
        log, writer = await opened(dsn)
        standby = RecordingStandby({ahead.txid}, calls)
        c = Coordinator(log, MarkerStore(site_a.rabbit.amqp_url()), writer, standby, standby)
        c.configure(VpnSettings.from_args("v", "active", "sync"))
        for t in (ahead, streamed):
            await c.prepare(t)
            answered: asyncio.Future[BaseException | None] = asyncio.Future()

            def answer(
                error: BaseException | None,
                t: LocalTransaction = t,
                answered: asyncio.Future[BaseException | None] = answered,
            ) -> None:
                calls.append(("answer", t.txid))
                answered.set_result(error)

            c.commit_soon(t, answer)
            assert await asyncio.wait_for(answered, 10) is None
        await c.close()
        await writer.close()
        await log.close()

    asyncio.run(scenario())
    assert calls == [("answer", ahead.txid), ("answer", streamed.txid), ("outcome", streamed.txid)]
    assert states(dsn) == {ahead.txid: "committed", streamed.txid: "committed"}


class LateAnswer(RecordingStandby):
    """A standby that commits every transaction ahead, answering ``after``
    seconds after ``TxnCommit`` — once the active's ledger group is durable
    and waits in the sync gate — and whose stream acknowledges nothing."""

    def __init__(self, after: float) -> None:
        super().__init__(set(), [])
        self.after = after

    def commit_early(self, vpn: str, txid: str, first: int, on_applied: object) -> bool:
        asyncio.get_running_loop().call_later(self.after, on_applied)  # type: ignore[arg-type]
        return True


def test_a_transaction_committed_early_is_no_sync_timeout_later(site_a: LocalSite) -> None:
    """When the ledger is durable before the standby's answer, the group
    waits in the VPN's sync gate; the answer settles the transaction and
    takes it out of the gate, so the stream's acknowledgement coming after
    the sync timeout (or not at all) does not mark the standby as fallen
    behind: the VPN stays sync-eligible."""
    dsn = active_site(site_a)
    ids = IdSource(19)
    t = txn(ids, 1)

    async def scenario() -> None:
        log, writer = await opened(dsn)
        settings = VpnSettings.from_args("v", "active", "sync", sync_timeout_ms=300)
        replicator = Replicator(writer)
        replicator.configure(settings, acked_index=0)
        c = Coordinator(
            log, MarkerStore(site_a.rabbit.amqp_url()), writer, replicator, LateAnswer(0.1)
        )
        c.configure(settings)
        gate = replicator.gates["v"]
        await c.prepare(t)
        answered: asyncio.Future[BaseException | None] = asyncio.Future()
        c.commit_soon(t, answered.set_result)
        await asyncio.sleep(0.05)
        assert gate.waiting == 1  # durable here, waiting for the standby
        assert await asyncio.wait_for(answered, 10) is None
        assert gate.waiting == 0
        await asyncio.sleep(0.4)  # past the sync timeout
        assert gate.eligible and gate.degradations == 0
        assert c.stats.outcomes[("v", "committed")] == 1
        await replicator.close()
        await c.close()
        await writer.close()
        await log.close()

    asyncio.run(scenario())


class SlowVote(RecordingStandby):
    """A standby whose vote comes after ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__(set(), [])
        self.delay = delay

    def prepare(
        self, vpn: str, txid: str, events: bytes, within: float, owner: str | None = None
    ) -> asyncio.Future[bool]:
        vote: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(self.delay, vote.set_result, False)
        return vote


@pytest.mark.parametrize(
    ("late", "policy"),
    [("vote", "degrade"), ("acknowledgement", "reject")],
    ids=["the vote late under degrade", "the stream late after the broker commit"],
)
def test_a_degraded_transaction_is_answered_once_its_group_is_a_recorded_window(
    site_a: LocalSite, late: str, policy: str
) -> None:
    """The client's ``tx.commit-ok`` for a transaction committed without the
    standby comes only once its ledger group is a ``sync_window`` row: a
    crash right after the answer leaves it inside a recorded window."""
    dsn = active_site(site_a)
    ids = IdSource(29)
    t = txn(ids, 1)
    seen: list[list[tuple[Any, ...]]] = []

    def windows() -> list[tuple[Any, ...]]:
        with psycopg.connect(dsn) as db:
            return db.execute(
                "SELECT first_index, last_index, closed_at IS NOT NULL FROM sync_window"
            ).fetchall()

    async def scenario() -> None:
        log, writer = await opened(dsn)
        recorder = WindowRecorder(dsn)
        await recorder.start()
        settings = VpnSettings.from_args(
            "v", "active", "sync", sync_timeout_ms=200, on_sync_timeout=policy
        )
        replicator = Replicator(writer, recorder)
        replicator.configure(settings, acked_index=0)
        # the vote comes after the timeout; or at once, and then the stream never acknowledges
        standby = SlowVote(0.5) if late == "vote" else RecordingStandby(set(), [])
        c = Coordinator(log, MarkerStore(site_a.rabbit.amqp_url()), writer, replicator, standby)
        c.configure(settings)
        await c.prepare(t)
        answered: asyncio.Future[BaseException | None] = asyncio.Future()

        def answer(error: BaseException | None) -> None:
            seen.append(windows())  # what a crash right after the answer would leave
            answered.set_result(error)

        c.commit_soon(t, answer)
        assert await asyncio.wait_for(answered, 10) is None
        assert c.stats.outcomes[("v", "degraded")] == 1
        assert replicator.sync_eligible("v")  # a transaction's window is no ineligibility
        await replicator.close()
        await c.close()
        await recorder.close()
        await writer.close()
        await log.close()

    asyncio.run(scenario())
    assert seen == [[(1, 3, True)]]  # the group's three events, ledger indexes 1..3


@pytest.mark.parametrize(
    "abort_after",
    [0.1, 0.0],
    ids=["the local row is written, the vote not in", "before the prepare took a step"],
)
def test_a_client_gone_during_the_prepare_ends_it_quietly_and_aborted(
    site_a: LocalSite, abort_after: float
) -> None:
    """The client's connection died during the prepare (its broker was
    killed): the listener aborts the transaction; the vote that comes
    later ends the prepare with a refusal, not a step out of order, and
    the row is aborted — also one the abort ran ahead of, which is not
    left prepared until the next restart."""
    dsn = active_site(site_a)
    ids = IdSource(23)
    t = txn(ids, 1)

    async def scenario() -> None:
        log, writer = await opened(dsn)
        settings = VpnSettings.from_args("v", "active", "sync", sync_timeout_ms=300)
        c = Coordinator(
            log, MarkerStore(site_a.rabbit.amqp_url()), writer, NoStandby(), SlowVote(0.2)
        )
        c.configure(settings)
        prepared = asyncio.ensure_future(c.prepare(t))
        if abort_after:
            await asyncio.sleep(abort_after)
        await c.abort(t)
        try:
            await prepared
        except TransactionRefused as e:
            assert "aborted while it was being prepared" in str(e)
        else:
            raise AssertionError("the prepare went on after the abort")
        assert states(dsn) == {t.txid: "aborted"}
        await c.close()
        await writer.close()
        await log.close()

    asyncio.run(scenario())


def test_a_prepare_the_sites_database_does_not_record_in_time_is_refused(
    site_a: LocalSite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The site's PostgreSQL hangs (here: a lock holds ``txn_log``): the
    client's commit is refused after the bound, not held for as long as
    the database hangs; the standby's row is aborted at once, the local
    row once its write gets through."""
    from tests.fix_sites import until_a_lock_waits
    from txn.local import _coordinator

    monkeypatch.setattr(_coordinator, "PREPARE_BOUND_SECONDS", 0.5)
    dsn = active_site(site_a)
    ids = IdSource(18)
    t1 = txn(ids, 1)
    calls: list[tuple[str, str]] = []

    async def scenario() -> None:
        log, writer = await opened(dsn)
        standby = RecordingStandby(set(), calls)
        c = Coordinator(log, MarkerStore(site_a.rabbit.amqp_url()), writer, standby, standby)
        c.configure(VpnSettings.from_args("v", "active", "sync"))
        await c.markers.declare("v")
        with psycopg.connect(dsn) as locker:
            locker.execute("LOCK TABLE txn_log IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            with pytest.raises(TransactionRefused, match="did not record the prepare within 0.5 s"):
                await c.prepare(t1)
            assert time.monotonic() - started < 5
            assert calls == [("outcome", t1.txid)]  # the standby aborts its row
            await asyncio.to_thread(until_a_lock_waits, dsn, "the late prepare", lambda: True)
            locker.commit()
        for _ in range(100):
            if states(dsn).get(t1.txid) == "aborted":
                break
            await asyncio.sleep(0.05)
        await c.close()
        await writer.close()
        await log.close()

    asyncio.run(scenario())
    assert states(dsn) == {t1.txid: "aborted"}


def test_a_decision_the_sites_database_does_not_record_in_time_ends_the_clients_wait(
    site_a: LocalSite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker committed, then the site's PostgreSQL hangs (here: a lock
    holds the ledger): the client is told, after the bound, that the
    outcome is unknown, not kept waiting as long as the database hangs; the
    decision still commits once the database answers."""
    from tests.fix_sites import until_a_lock_waits
    from txn.local import _decision

    monkeypatch.setattr(_decision, "DECISION_BOUND_SECONDS", 0.5)
    dsn = active_site(site_a)
    ids = IdSource(19)
    t1 = txn(ids, 1)

    async def scenario() -> None:
        log, writer = await opened(dsn)
        c = Coordinator(log, MarkerStore(site_a.rabbit.amqp_url()), writer, NoStandby())
        c.configure(VpnSettings.from_args("v", "active"))
        await c.prepare(t1)
        answered: asyncio.Future[BaseException | None] = asyncio.Future()
        with psycopg.connect(dsn) as locker:
            locker.execute("LOCK TABLE ledger IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            c.commit_soon(t1, answered.set_result)
            error = await asyncio.wait_for(answered, 10)
            assert isinstance(error, TransactionRefused)
            assert "did not record the commit decision within 0.5 s" in str(error)
            assert time.monotonic() - started < 5
            await asyncio.to_thread(until_a_lock_waits, dsn, "the decision", lambda: True)
            locker.commit()
        await asyncio.wait_for(writer.wait_durable("v", 3), 10)
        for _ in range(100):
            if not c._live:
                break
            await asyncio.sleep(0.05)
        assert not c._live  # its books closed once the decision was durable
        await c.close()
        await writer.close()
        await log.close()

    asyncio.run(scenario())
    assert states(dsn) == {t1.txid: "committed"}
