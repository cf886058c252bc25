"""The coordinator on one real site (PostgreSQL, RabbitMQ), no standby:
its rows, its ledger group, its spans, and recovery by marker."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pika
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
    encode_event,
)
from bridge.active import Replicator, WindowRecorder
from bridge.ledger import LedgerWriter
from plugin.devtools import LocalSite
from plugin.ops import connect, enable_vpn
from sql import migrate
from txn import MarkerKey
from txn.local import (
    PARTICIPANT,
    TXN_RETAIN_SECONDS,
    Coordinator,
    MarkerStore,
    Participant,
    TxnLog,
    encode_events,
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


def test_markers_are_read_without_removal_and_swept_by_name(site_a: LocalSite) -> None:
    """Recovery reads every marker and removes none; a sweep removes exactly
    the markers of the transactions it names, and every forged one, and
    leaves the others queued."""
    site_a.rabbit.add_vhost("v")
    store = MarkerStore(site_a.rabbit.amqp_url())
    asyncio.run(store.declare("v"))
    txids = [f"tx-{n}" for n in range(300)]
    conn = pika.BlockingConnection(pika.URLParameters(site_a.rabbit.amqp_url("v")))
    ch = conn.channel()
    ch.confirm_delivery()
    for txid in txids:
        body = store.body("v", txid)
        ch.basic_publish("", MARKER_QUEUE, body, pika.BasicProperties(delivery_mode=2))
    # forged: untagged, another key's tag, another vhost's tag, not text
    other = MarkerKey.new()
    for body in (b"tx-1", other.body("v", "tx-2"), store.body("w", "tx-3"), b"\xff tx"):
        ch.basic_publish("", MARKER_QUEUE, body, pika.BasicProperties(delivery_mode=2))

    def depth() -> int:
        return int(ch.queue_declare(MARKER_QUEUE, passive=True).method.message_count)

    assert asyncio.run(store.present("v")) == set(txids)
    assert depth() == 304

    async def overlapping() -> list[object]:
        # reads and a sweep at once: a marker one of them holds must not be
        # missing from another's answer (a missed marker aborts a commit)
        sweep = store.remove("v", {"tx-never-published"})
        return list(await asyncio.gather(*(store.present("v") for _ in range(4)), sweep))

    assert asyncio.run(overlapping()) == [set(txids)] * 4 + [0]
    assert depth() == 300  # the sweep removed the forged ones
    assert store.forged == {"v": 4}
    gone = set(txids[::3])
    assert asyncio.run(store.remove("v", gone | {"tx-never-published"})) == 100
    assert depth() == 200
    assert asyncio.run(store.present("v")) == set(txids) - gone
    assert asyncio.run(store.remove("v", set(txids))) == 200
    assert depth() == 0
    assert asyncio.run(store.present("v")) == set()
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


def test_a_participants_yes_vote_returns_the_events_it_was_for(site_a: LocalSite) -> None:
    """The events a yes vote was for (for the early commit);
    none for a no vote, whose row is aborted."""
    dsn = site_a.pg.dsn()
    migrate(dsn)
    with connect(dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args("v", "standby"))
    ids = IdSource(12)
    t1, t2 = txn(ids, 1), txn(ids, 2)

    async def scenario() -> None:
        log = TxnLog(dsn)
        await log.open()
        p = Participant(log)
        seen: list[tuple[tuple[bytes, object], ...]] = []
        voted = await p.prepare("v", t1.txid, encode_events(t1.events), seen.append)
        assert voted is not None
        assert [event for _, event in voted] == list(t1.events)
        assert [data for data, _ in voted] == [encode_event(e) for e in t1.events]
        assert seen == [voted]  # what the caller makes ready meanwhile gets the same events

        def fails(voted: object) -> None:
            raise ValueError("not this one")

        # the caller's own failure does not change the vote
        assert await p.prepare("v", t2.txid, encode_events(t2.events), fails) is not None
        assert await p.prepare("v", "unreadable", b"\x00\x00\x00\x09abc", seen.append) is None
        assert len(seen) == 1  # nothing made ready for unreadable events
        await p.close()
        await log.close()

    asyncio.run(scenario())
    assert states(dsn) == {t1.txid: "prepared", t2.txid: "prepared", "unreadable": "aborted"}


def test_a_participant_where_the_vpn_is_not_standby_votes_no(site_a: LocalSite) -> None:
    """A promoted site still linked to the old active (it serves the VPN
    until it is fenced) gets its prepares: a yes would let the old active
    commit, and under sync+reject confirm, a transaction this site holds
    only as a row its promotion never saw — its messages nowhere here."""
    dsn = site_a.pg.dsn()
    migrate(dsn)
    with connect(dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args("v", "active"))
    ids = IdSource(13)
    t1 = txn(ids, 1)

    async def scenario() -> None:
        log = TxnLog(dsn)
        await log.open()
        p = Participant(log)
        seen: list[object] = []
        assert await p.prepare("v", t1.txid, encode_events(t1.events), seen.append) is None
        assert await p.prepare("unknown", "1.9.9", encode_events(t1.events)) is None
        await p.close()
        await log.close()

    asyncio.run(scenario())
    assert states(dsn) == {}


def test_a_prepare_waiting_for_a_promotion_votes_no(site_a: LocalSite) -> None:
    """A prepare racing the promotion: one that waits for the promotion's
    locks sees the VPN active and writes nothing (a row written after the
    promotion read the prepared rows would be resolved by no one)."""
    import threading

    from bridge.store import become_active, lock_for_promotion
    from tests.fix_sites import until_a_lock_waits

    dsn = site_a.pg.dsn()
    migrate(dsn)
    with connect(dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args("v", "standby"))
    ids = IdSource(14)
    t1 = txn(ids, 1)
    votes: list[object] = []

    def vote() -> None:
        async def scenario() -> None:
            log = TxnLog(dsn)
            await log.open()
            votes.append(await Participant(log).prepare("v", t1.txid, encode_events(t1.events)))
            await log.close()

        asyncio.run(scenario())

    with psycopg.connect(dsn) as promoting:
        assert lock_for_promotion("v").run(promoting) is not None
        become_active("v", 2, 0).run(promoting)
        waiter = threading.Thread(target=vote)
        waiter.start()
        until_a_lock_waits(dsn, f"the prepare (votes {votes})", waiter.is_alive)
        promoting.commit()
    waiter.join(10)
    assert votes == [None]
    assert states(dsn) == {}


def test_a_commit_outcome_leaves_the_row_to_its_group_and_an_abort_is_recorded_at_once(
    site_a: LocalSite,
) -> None:
    """A commit outcome settles nothing (the row settles with its group,
    ``bridge/standby/_prepared.py``), so it stays in doubt until the group comes; an
    abort is recorded at once."""
    dsn = site_a.pg.dsn()
    migrate(dsn)
    with connect(dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args("v", "standby"))
    ids = IdSource(11)
    t1, t2, t3, t4 = (txn(ids, n) for n in range(1, 5))

    async def scenario() -> None:
        log = TxnLog(dsn)
        await log.open()
        p = Participant(log)
        for t in (t1, t2, t3):
            assert await p.prepare("v", t.txid, encode_events(t.events)) is not None
        await p.outcome("v", t1.txid, commit=True)
        await p.outcome("v", t2.txid, commit=False)
        assert states(dsn)[t2.txid] == "aborted"
        assert sorted(await p.in_doubt("v")) == sorted([t1.txid, t3.txid])
        # an abort handled before its prepare's row is written (they run as
        # separate tasks): the prepare votes no and its row ends aborted
        await p.outcome("v", t4.txid, commit=False)
        assert await p.prepare("v", t4.txid, encode_events(t4.events)) is None
        await p.close()
        await log.close()

    asyncio.run(scenario())
    rows = states(dsn)
    assert [rows[t.txid] for t in (t1, t2, t3, t4)] == [
        "prepared",
        "aborted",
        "prepared",
        "aborted",
    ]


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


def test_in_doubt_reads_the_prepared_rows_of_its_vpn_only(site_a: LocalSite) -> None:
    """A standby keeps a ``committed`` participant row per transaction it
    ever applied; a resync asks which rows are in doubt, and reads only
    the prepared ones of its VPN (not every row not ended, with events)."""
    dsn = active_site(site_a)
    with connect(dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args("w", "standby"))
    rows = [(f"1.1.{i}", "v", "committed") for i in range(200)]
    rows += [("1.2.1", "v", "prepared"), ("1.2.2", "w", "prepared"), ("1.2.3", "v", "aborted")]
    with psycopg.connect(dsn) as db:
        for txid, vpn, state in rows:
            db.execute(
                "INSERT INTO txn_log (txid, vpn, side, state, events)"
                " VALUES (%s, %s, 'participant', %s, %s)",
                (txid, vpn, state, b""),
            )

    async def scenario() -> None:
        log = TxnLog(dsn)
        await log.open()
        assert sorted(r.txid for r in await log.prepared_rows(PARTICIPANT)) == ["1.2.1", "1.2.2"]
        assert await Participant(log).in_doubt("v") == ["1.2.1"]
        await log.close()

    asyncio.run(scenario())


def test_rows_of_transactions_over_on_both_sites_are_pruned_after_their_retention(
    site_a: LocalSite,
) -> None:
    """``txn_log`` does not grow with every transaction a VPN ever had: the
    sweep deletes the rows of transactions over on both sites once they
    are an hour old, and keeps what is still undecided, unacknowledged, or
    a heuristic outcome a transaction manager must still hear of."""
    dsn = active_site(site_a)
    rows = [
        ("c-ended", "coordinator", "ended", None, "2 hours"),
        ("c-aborted", "coordinator", "aborted", None, "2 hours"),
        ("p-committed", "participant", "committed", None, "2 hours"),
        ("p-aborted", "participant", "aborted", None, "2 hours"),
        ("c-committed", "coordinator", "committed", None, "2 hours"),  # not acknowledged
        ("c-prepared", "coordinator", "prepared", None, "2 hours"),
        ("p-prepared", "participant", "prepared", None, "2 hours"),
        ("p-applied", "participant", "applied", None, "2 hours"),
        ("c-heuristic", "coordinator", "ended", "rollback", "2 hours"),
        ("c-recent", "coordinator", "ended", None, "10 minutes"),
    ]
    with psycopg.connect(dsn) as db:
        for txid, side, state, heuristic, age in rows:
            db.execute(
                "INSERT INTO txn_log (txid, vpn, side, state, events, heuristic, updated_at)"
                " VALUES (%s, 'v', %s, %s, %s, %s, now() - %s::interval)",
                (txid, side, state, b"", heuristic, age),
            )

    async def scenario() -> None:
        log = TxnLog(dsn)
        await log.open()
        assert await log.prune(TXN_RETAIN_SECONDS, limit=3) == 3  # a bounded statement
        assert await log.prune(TXN_RETAIN_SECONDS) == 1
        assert await log.prune(TXN_RETAIN_SECONDS) == 0
        await log.close()

    asyncio.run(scenario())
    assert sorted(states(dsn)) == [
        "c-committed",
        "c-heuristic",
        "c-prepared",
        "c-recent",
        "p-applied",
        "p-prepared",
    ]


def _scans_of_txn_log(node: dict[str, Any]) -> Iterator[tuple[str, str | None]]:
    """(node type, index name) of every node on ``txn_log`` in a plan."""
    if node.get("Relation Name") == "txn_log":
        yield node["Node Type"], node.get("Index Name")
    for child in node.get("Plans", []):
        yield from _scans_of_txn_log(child)


def test_an_abort_the_standby_database_does_not_take_stays_in_doubt_quietly(
    site_a: LocalSite, caplog: pytest.LogCaptureFixture
) -> None:
    """The standby's PostgreSQL died as an abort outcome came: the row stays
    prepared (the next resync asks the active), with a warning, not an
    unhandled error in the node."""
    dsn = active_site(site_a)
    with psycopg.connect(dsn) as db:
        db.execute(
            "INSERT INTO txn_log (txid, vpn, side, state, events)"
            " VALUES ('1.3.1', 'v', 'participant', 'prepared', '')"
        )

    async def scenario() -> None:
        log = TxnLog(dsn)
        await log.open()
        p = Participant(log)
        site_a.pg.stop()
        try:
            await p.outcome("v", "1.3.1", commit=False)  # raises nothing
        finally:
            site_a.pg.start()
        await log.close()

    asyncio.run(scenario())
    assert "its abort is not recorded yet" in caplog.text
    assert states(dsn) == {"1.3.1": "prepared"}
