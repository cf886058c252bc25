"""Disaster recovery on the two-site harness, with unchanged pika clients:
the active's node is killed mid-stream, the standby is promoted, and what
the clients were told is checked against what the promoted site's broker
holds while the old active is still down; then the old active comes back
fenced. A promotion killed at any of its steps (``promotion.*`` failpoints,
in the CLI or in the node) is run again and loses and duplicates nothing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pika
import pika.exceptions
import psycopg
import pytest

from bridge import Published, decode_event
from plugin.devtools import HarnessError, LocalSite
from tests.fix_node import NodeProcess, Sites
from tests.support.two_sites import (
    IN_SCOPE,
    VPN,
    Publisher,
    admin_call,
    amqp_url,
    body,
    broker_depths,
    caught_up,
    cli_status,
    enable,
    live_numbers,
    number,
    properties,
    queues_of,
    routing_key,
    scalar,
    setup_vpn,
    until,
    vpn_status,
)


@pytest.fixture
def sites(site_a: LocalSite, site_b: LocalSite, tmp_path: Path) -> Iterator[Sites]:
    s = Sites(site_a, site_b, tmp_path)
    try:
        yield s
    finally:
        s.a.kill()
        s.b.kill()
    for node in (s.a, s.b):
        assert "Traceback" not in node.log_text(), node.log_text()


def admin_active(site: LocalSite) -> int:
    return admin_call(site.admin_port, f"/vpns/{quote(VPN, safe='')}/active")[0]


def broker_contents(site: LocalSite, queue: str) -> list[int]:
    """The numbers in ``queue`` of ``site``'s broker, in queue order (read
    through the site's listener: a client of the promoted site)."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(site)))
    ch = conn.channel()
    got: list[int] = []
    while True:
        method, props, payload = ch.basic_get(queue)
        if method is None:
            break
        assert props.message_id == f"m-{number(payload):06d}"
        assert "x-vpnrepl-id" not in (props.headers or {})
        got.append(number(payload))
    conn.close()  # unacked: the messages go back to the queue
    return got


class AckingConsumer(threading.Thread):
    """Consumes ``queue`` through the site's listener, acking each delivery
    on its own; ``acked`` holds the numbers whose ack was sent, until the
    connection goes away (``error``)."""

    def __init__(self, site: LocalSite, queue: str) -> None:
        super().__init__(name=f"acking-{queue}", daemon=True)
        self.site, self.queue = site, queue
        self.acked: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = pika.BlockingConnection(pika.URLParameters(amqp_url(self.site)))
            ch = conn.channel()
            ch.basic_qos(prefetch_count=50)
            for method, _, payload in ch.consume(self.queue, inactivity_timeout=60):
                if method is None:
                    return
                ch.basic_ack(method.delivery_tag)
                self.acked.append(number(payload))
        except BaseException as e:  # the node was killed: what the test expects
            self.error = e


#: the numbers the transactional client publishes start here
TX_FIRST = 500_001


class TxPublisher(threading.Thread):
    """Publishes numbered messages in transactions of five through the
    site's listener; ``committed`` holds those whose ``tx.commit-ok`` came."""

    def __init__(self, site: LocalSite, first: int) -> None:
        super().__init__(name="tx-publisher", daemon=True)
        self.site, self.first = site, first
        self.committed: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        n = self.first
        try:
            conn = pika.BlockingConnection(pika.URLParameters(amqp_url(self.site)))
            ch = conn.channel()
            ch.tx_select()
            while n < self.first + 100_000:
                batch = list(range(n, n + 5))
                for m in batch:
                    ch.basic_publish("events", routing_key(m), body(m), properties(m))
                ch.tx_commit()
                self.committed += batch
                n += 5
        except BaseException as e:  # the node was killed: what the test expects
            self.error = e


def test_failover_in_sync_mode_loses_nothing_a_client_was_told(sites: Sites) -> None:
    setup_vpn(sites.a.site)
    done = sites.cli_a("vpn", "enable", VPN, "--role", "active", "--queues", r"orders\..*",
                       "--mode", "sync", "--on-sync-timeout", "reject")  # fmt: skip
    assert done.returncode == 0, done.stderr
    sites.a.start()
    sites.b.start()
    until(lambda: vpn_status(sites.b).get("bridge") == "connected", "B to follow A")
    assert admin_active(sites.a.site) == 200 and admin_active(sites.b.site) == 503

    publisher = Publisher(sites.a.site, range(1, 20_001), window=200).start()
    consumer = AckingConsumer(sites.a.site, "orders.q1")
    consumer.start()
    transactions = TxPublisher(sites.a.site, first=TX_FIRST)
    transactions.start()
    until(lambda: len(publisher.confirmed) >= 1500, "1500 confirmed publishes")
    until(lambda: len(consumer.acked) >= 200, "200 acked deliveries")
    until(lambda: len(transactions.committed) >= 50, "50 committed transactional publishes")
    sites.a.kill()  # mid-stream: every client loses its connection
    publisher.join()
    consumer.join(60)
    transactions.join(60)
    assert publisher.error is not None and "connection lost" in publisher.error
    assert not publisher.nacked
    assert consumer.error is not None  # its connection went with the node
    assert transactions.error is not None

    # promotion on B while A is still down, through B's running node
    promoted = sites.cli_b("promote", VPN)
    assert promoted.returncode == 0, promoted.stderr
    assert f"VPN '{VPN}' promoted to active at epoch 2" in promoted.stdout
    status = cli_status(sites.b)
    assert (status["role"], status["epoch"], status["promotion"]["state"]) == ("active", 2, "done")
    assert [(e["epoch"], e["site"]) for e in status["epochs"]][-1] == (2, "b")
    assert admin_active(sites.b.site) == 200

    removed = set(consumer.acked)
    for queue in IN_SCOPE:
        got = broker_contents(sites.b.site, queue)
        assert len(got) == len(set(got)), f"{queue}: a message twice"
        for source in ([n for n in got if n < TX_FIRST], [n for n in got if n >= TX_FIRST]):
            assert source == sorted(source), f"{queue}: not in publish order"
        told = publisher.confirmed | set(transactions.committed)
        confirmed = {n for n in told if queue in queues_of(n)}
        missing = confirmed - set(got) - (removed if queue == "orders.q1" else set())
        assert not missing, (
            f"{queue}: confirmed and not consumed, missing on B: {sorted(missing)[:10]}"
        )
        # anything else is a publish the client was never told about (in flight at the kill)
        assert {n for n in got if n < TX_FIRST} <= set(range(1, 20_001))
    # acks A had not made durable at the kill bring their messages back: counted
    back = removed & set(broker_contents(sites.b.site, "orders.q1"))
    print(f"acked on A but still on B after the promotion: {len(back)} of {len(removed)}")

    # the old active comes back: its peer holds the VPN at a higher epoch
    sites.a.start()
    until(lambda: cli_status(sites.a)["fenced"], "A to learn it is fenced")
    assert admin_active(sites.a.site) == 503
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(pika.URLParameters(amqp_url(sites.a.site)))
    assert "is now active on site 'b' (epoch 2)" in sites.a.log_text()


# ---------------------------------------------------------------- promotion, killed and run again


def held(site: LocalSite, queue: str) -> list[int]:
    """The numbers in ``queue`` of the site's broker itself (no node in
    between), in queue order; nothing is acked, so they stay."""
    conn = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url(VPN)))
    try:
        ch = conn.channel()
        depth = ch.queue_declare(queue, passive=True).method.message_count
        got: list[int] = []
        if depth:
            for method, props, payload in ch.consume(queue, inactivity_timeout=10):
                assert method is not None, f"{queue}: {len(got)} of {depth} messages delivered"
                assert props.message_id == f"m-{number(payload):06d}"
                got.append(number(payload))
                if len(got) == depth:
                    break
            ch.cancel()
        return got
    finally:
        conn.close()


def in_queue(numbers: set[int], queue: str) -> list[int]:
    """What ``queue`` must hold of ``numbers``: those routed to it, in publish order."""
    return sorted(n for n in numbers if queue in queues_of(n))


def streamed(sites: Sites, count: int, b_failpoint: str | None = None) -> set[int]:
    """Both nodes up, ``count`` messages published through A and every one
    confirmed, B caught up with A; returns the confirmed numbers."""
    setup_vpn(sites.a.site)
    enable(sites.cli_a)
    sites.a.start()
    sites.b.start(failpoint=b_failpoint)
    publisher = Publisher(sites.a.site, range(1, count + 1)).run()
    assert publisher.error is None and not publisher.nacked
    assert publisher.confirmed == set(range(1, count + 1))
    caught_up(sites.a, sites.b)
    return publisher.confirmed


def promotion_of(node: NodeProcess) -> tuple[str, int, str, int, int]:
    """(role, epoch, promotion state, materialised, total) in ``status``."""
    s = cli_status(node)
    p = s["promotion"]
    return s["role"], s["epoch"], p["state"], p["materialised"], p["total"]


def assert_promoted_once(node: NodeProcess, confirmed: set[int], out: str) -> None:
    """The re-run finished the promotion at epoch 2 (the crashed run's, not
    a third) and said how many messages the site holds."""
    total = sum(len(in_queue(confirmed, q)) for q in IN_SCOPE)
    line = f"VPN '{VPN}' promoted to active at epoch 2 (resumed): {total} messages into 2 queues"
    assert line in out, out
    assert promotion_of(node) == ("active", 2, "done", total, total)
    epochs = [(e["epoch"], e["site"]) for e in cli_status(node)["epochs"]]
    assert epochs[-1] == (2, "b") and len(epochs) == len(set(epochs)), epochs


@pytest.mark.parametrize(
    "point",
    [
        # the middle step by default; the first and last with -m fault
        pytest.param("promotion.after-begin", marks=pytest.mark.fault),
        "promotion.mid-materialise",
        pytest.param("promotion.before-finish", marks=pytest.mark.fault),
    ],
)
def test_a_promotion_the_cli_ran_killed_then_run_again_loses_and_duplicates_nothing(
    sites: Sites, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No node runs on B (a disaster took both): ``vpnrepl promote`` does the
    work itself, is SIGKILLed at ``point`` and run again."""
    confirmed = streamed(sites, 3000)
    assert sites.a.stop() == 0 and sites.b.stop() == 0  # no node: the CLI promotes itself

    with monkeypatch.context() as env:
        env.setenv("VPNREPL_FAILPOINT", point)
        crashed = sites.cli_b("promote", VPN)
    assert crashed.returncode == -9, crashed.stderr
    assert f"failpoint {point} reached" in crashed.stderr
    role, epoch, state, materialised, total = promotion_of(sites.b)
    assert (role, epoch, state) == ("active", 2, "running")
    if point == "promotion.after-begin":
        assert materialised == total == 0
        assert sum(len(held(sites.b.site, q)) for q in IN_SCOPE) == 0
    elif point == "promotion.mid-materialise":
        assert 0 < materialised < total, (materialised, total)
    else:
        assert 0 < materialised == total

    again = sites.cli_b("promote", VPN)
    assert again.returncode == 0, again.stderr
    assert_promoted_once(sites.b, confirmed, again.stdout)
    for queue in IN_SCOPE:
        assert held(sites.b.site, queue) == in_queue(confirmed, queue), queue


def test_a_promotion_the_node_ran_killed_then_run_again_loses_and_duplicates_nothing(
    sites: Sites,
) -> None:
    """B's node runs the promotion and dies halfway through materialising:
    the CLI says so; the restarted node refuses the VPN's clients until the
    re-run finishes it."""
    confirmed = streamed(sites, 3000, b_failpoint="promotion.mid-materialise")
    sites.a.kill()

    crashed = sites.cli_b("promote", VPN)
    sites.b.wait_killed()
    assert crashed.returncode == 1, crashed.stderr
    errors = [ln for ln in crashed.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0].startswith("vpnrepl: error: "), crashed.stderr
    assert f"the site's node stopped while it ran promote {VPN}" in errors[0]
    role, epoch, state, materialised, total = promotion_of(sites.b)
    assert (role, epoch, state) == ("active", 2, "running")
    assert 0 < materialised < total, (materialised, total)

    sites.b.start()  # no failpoint: the promotion is still running, its clients refused
    assert admin_active(sites.b.site) == 503
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(pika.URLParameters(amqp_url(sites.b.site)))
    again = sites.cli_b("promote", VPN)
    assert again.returncode == 0, again.stderr
    assert_promoted_once(sites.b, confirmed, again.stdout)
    assert admin_active(sites.b.site) == 200
    for queue in IN_SCOPE:
        assert broker_contents(sites.b.site, queue) == in_queue(confirmed, queue), queue


# ---------------------------------------------------------------- after the promotion


ALICE = ("alice", "alice-pw-7")


@pytest.fixture
def alice(site_a: LocalSite, site_b: LocalSite) -> Iterator[tuple[str, str]]:
    """A client user on A's broker, with no permissions yet (the brokers'
    reset keeps users: removed from both afterwards)."""
    name, password = ALICE
    site_a.rabbit.api("PUT", f"users/{name}", {"password": password, "tags": ""})
    yield ALICE
    for site in (site_a, site_b):
        with contextlib.suppress(HarnessError):
            site.rabbit.api("DELETE", f"users/{name}")


def as_user(site: LocalSite, name: str, password: str) -> str:
    return f"amqp://{name}:{password}@127.0.0.1:{site.amqp_port}/{VPN}"


def test_a_client_user_of_the_old_active_consumes_her_messages_on_the_promoted_site(
    sites: Sites, alice: tuple[str, str]
) -> None:
    """A user of the old active's broker (not the node's) logs in to the
    promoted site's listener with her own password and gets her messages."""
    name, password = alice
    setup_vpn(sites.a.site)
    sites.a.site.rabbit.api(  # rights on the VPN only
        "PUT", f"permissions/{VPN}/{name}", {"configure": ".*", "write": ".*", "read": ".*"}
    )
    enable(sites.cli_a)
    sites.a.start()
    sites.b.start()
    publisher = Publisher(sites.a.site, range(1, 501))
    publisher.url = as_user(sites.a.site, name, password)  # hers, not guest's
    assert publisher.run().error is None and publisher.confirmed == set(range(1, 501))
    caught_up(sites.a, sites.b)
    sites.a.kill()

    promoted = sites.cli_b("promote", VPN)
    assert promoted.returncode == 0, promoted.stderr

    with pytest.raises(pika.exceptions.AMQPConnectionError):  # B checks her password
        pika.BlockingConnection(pika.URLParameters(as_user(sites.b.site, name, "wrong")))
    conn = pika.BlockingConnection(pika.URLParameters(as_user(sites.b.site, name, password)))
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=100)
        for queue in IN_SCOPE:
            got: list[int] = []
            want = in_queue(publisher.confirmed, queue)
            for method, props, payload in ch.consume(queue, inactivity_timeout=10):
                assert method is not None, f"{queue}: {len(got)} of {len(want)} delivered"
                assert props.message_id == f"m-{number(payload):06d}"
                ch.basic_ack(method.delivery_tag)
                got.append(number(payload))
                if len(got) == len(want):
                    break
            ch.cancel()
            assert got == want, queue
    finally:
        conn.close()
    assert broker_depths(sites.b.site) == dict.fromkeys(IN_SCOPE, 0)  # her acks took them


def ledger_rows(site: LocalSite) -> dict[int, set[tuple[int, str]]]:
    """Per ledger index of a publish: the (number, queue) rows it put into
    in-scope queues (read from the site's database directly)."""
    with psycopg.connect(site.pg.dsn()) as db:
        rows = db.execute("SELECT idx, event FROM ledger WHERE vpn = %s", (VPN,)).fetchall()
    out: dict[int, set[tuple[int, str]]] = {}
    for idx, data in rows:
        event = decode_event(bytes(data), VPN)
        if isinstance(event, Published):
            out[idx] = {(number(event.body), q) for q in event.queues}
    return out


def test_failover_in_async_mode_loses_only_the_tail_the_standby_had_not_applied(
    sites: Sites,
) -> None:
    """In async mode a confirm does not wait for the standby: a confirmed
    message missing on the promoted site must be one the old active's ledger
    holds above the index the standby had applied, and the promoted site
    holds exactly what it had applied."""
    setup_vpn(sites.a.site)
    enable(sites.cli_a, "--mode", "async")
    sites.a.start()
    sites.b.start()
    until(lambda: vpn_status(sites.b).get("bridge") == "connected", "B to follow A")
    publisher = Publisher(sites.a.site, range(1, 30_001), window=300).start()
    until(lambda: len(publisher.confirmed) >= 2000, "2000 confirmed publishes")
    # B falls behind (its node frozen): in async mode A confirms without it
    assert sites.b.pid is not None
    os.kill(sites.b.pid, signal.SIGSTOP)
    behind = len(publisher.confirmed)
    until(lambda: len(publisher.confirmed) >= behind + 2000, "A to confirm while B is frozen")
    sites.a.kill()  # mid-stream; A's PostgreSQL stays up
    sites.b.kill()  # never thawed: what it had applied at A's kill is all it has
    publisher.join()
    assert publisher.error is not None and "connection lost" in publisher.error
    assert not publisher.nacked
    b_applied = scalar(sites.b.site, "SELECT applied_index FROM vpn_state WHERE vpn = %s", VPN)
    applied = live_numbers(sites.b.site)  # no consumer ran: B's live state is all it applied

    promoted = sites.cli_b("promote", VPN)  # no node on B: the CLI promotes itself
    assert promoted.returncode == 0, promoted.stderr
    assert f"{len(applied)} messages into 2 queues" in promoted.stdout
    holds: set[tuple[int, str]] = set()
    for queue in IN_SCOPE:
        got = held(sites.b.site, queue)
        assert got == sorted({n for n, q in applied if q == queue}), f"{queue}: not as applied"
        holds |= {(n, queue) for n in got}

    ledger = ledger_rows(sites.a.site)
    upto = set().union(*(rows for idx, rows in ledger.items() if idx <= b_applied))
    tail = set().union(*(rows for idx, rows in ledger.items() if idx > b_applied))
    assert holds == upto, "B holds other than A's ledger up to the index B applied"
    told = {(n, q) for n in publisher.confirmed for q in queues_of(n)}
    missing = told - holds
    print(
        f"async failover: {len(publisher.confirmed)} confirmed, B applied index {b_applied}; "
        f"{len(missing)} confirmed queue messages not on B ({len(tail)} in A's unreplicated tail)"
    )
    assert missing, "B was frozen while A confirmed 2000 publishes, yet B holds them all"
    assert missing <= tail, f"confirmed, not on B, not in A's tail: {sorted(missing)[:10]}"


def test_a_standby_with_nothing_live_is_promoted_with_zero_messages(sites: Sites) -> None:
    setup_vpn(sites.a.site)
    enable(sites.cli_a)
    sites.a.start()
    sites.b.start()
    caught_up(sites.a, sites.b)
    sites.a.kill()
    assert live_numbers(sites.b.site) == set()
    assert admin_active(sites.b.site) == 503

    promoted = sites.cli_b("promote", VPN)
    assert promoted.returncode == 0, promoted.stderr
    assert f"VPN '{VPN}' promoted to active at epoch 2: 0 messages into 0 queues" in (
        promoted.stdout
    )
    assert promotion_of(sites.b) == ("active", 2, "done", 0, 0)
    assert admin_active(sites.b.site) == 200
    assert broker_depths(sites.b.site) == dict.fromkeys(IN_SCOPE, 0)
    pika.BlockingConnection(pika.URLParameters(amqp_url(sites.b.site))).close()  # admitted


def test_a_standby_refuses_the_vpns_clients_from_its_first_listing(sites: Sites) -> None:
    """Until the listener knows a VPN is standby here, a client would reach
    the standby's broker unreplicated (and a promotion empties what it finds
    there): the node learns it from the first listing, before it admits
    anyone, and at once when a listing brings a new VPN."""
    setup_vpn(sites.a.site)
    done = sites.cli_a("vpn", "enable", VPN, "--role", "active", "--queues", r"orders\..*")
    assert done.returncode == 0, done.stderr
    sites.a.start()
    sites.b.start()  # returns once B's listener accepts clients
    with pytest.raises(pika.exceptions.AMQPConnectionError) as refused:
        pika.BlockingConnection(pika.URLParameters(amqp_url(sites.b.site)))
    # pika reports a close during the handshake as a probable access denial
    assert "(530)" in str(refused.value) and "is a replication standby" in str(refused.value)


def test_a_fenced_active_tells_its_clients_no(sites: Sites) -> None:
    """Both sites up: a promotion is refused while the active serves the
    VPN to the standby, unless forced; forced, the old active learns it is
    fenced; a client it still serves has its next publish refused (a nack,
    or the connection closed with 320 naming the new active), never
    confirmed; a new client is refused with 530."""
    setup_vpn(sites.a.site)
    done = sites.cli_a("vpn", "enable", VPN, "--role", "active", "--queues", r"orders\..*",
                       "--mode", "sync", "--on-sync-timeout", "reject")  # fmt: skip
    assert done.returncode == 0, done.stderr
    sites.a.start()
    sites.b.start()
    until(lambda: vpn_status(sites.b).get("bridge") == "connected", "B to follow A")
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(sites.a.site)))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("events", routing_key(1), body(1), properties(1))  # confirmed
    # A still serves the VPN to B: a promotion would make a split brain
    refused_promotion = sites.cli_b("promote", VPN)
    assert refused_promotion.returncode == 1
    assert f"site 'a' still serves VPN '{VPN}' as active" in refused_promotion.stderr
    assert f"vpnrepl switchover {VPN}" in refused_promotion.stderr
    assert cli_status(sites.b)["role"] == "standby" and not cli_status(sites.a)["fenced"]
    promoted = sites.cli_b("promote", VPN, "--force")
    assert promoted.returncode == 0, promoted.stderr
    until(lambda: cli_status(sites.a)["fenced"], "A to learn it is fenced")
    with pytest.raises(
        (pika.exceptions.NackError, pika.exceptions.ConnectionClosedByBroker)
    ) as refused:
        ch.basic_publish("events", routing_key(2), body(2), properties(2))
    if isinstance(refused.value, pika.exceptions.ConnectionClosedByBroker):
        assert refused.value.reply_code == 320
        assert "active on site 'b'" in refused.value.reply_text
    with contextlib.suppress(pika.exceptions.AMQPError):
        conn.close()
    with pytest.raises(pika.exceptions.AMQPConnectionError) as new:
        pika.BlockingConnection(pika.URLParameters(amqp_url(sites.a.site)))
    assert "(530)" in str(new.value) and "active on site 'b'" in str(new.value)
    assert 2 not in {n for n, _ in live_numbers(sites.b.site)}


def test_a_split_brain_shows_on_the_old_active_once_it_hears_of_the_new_epoch(
    sites: Sites, tmp_path: Path
) -> None:
    """The bridge is cut (B's node down), B is promoted anyway, A goes on
    confirming its clients: when A hears of B's epoch it is fenced, and
    since it confirmed past the index B took over at, it shows a split
    brain (status, metric) until it is demoted. B, which never confirmed
    in A's place, shows none."""
    setup_vpn(sites.a.site)
    done = sites.cli_a("vpn", "enable", VPN, "--role", "active", "--queues", r"orders\..*")
    assert done.returncode == 0, done.stderr
    sites.a.start()
    sites.b.start()
    until(lambda: vpn_status(sites.b).get("bridge") == "connected", "B to follow A")
    Publisher(sites.a.site, range(1, 11)).run()
    caught_up(sites.a, sites.b)
    sites.b.kill()  # the bridge is cut: A cannot tell B anything any more
    promoted = sites.cli_b("promote", VPN)  # no node on B: the CLI promotes, unguarded
    assert promoted.returncode == 0, promoted.stderr
    assert Publisher(sites.a.site, range(11, 31)).run().error is None  # A still confirms
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(sites.a.site)))
    conn.channel().queue_declare("orders.during-split", durable=True)  # B never hears of it
    conn.close()
    assert not cli_status(sites.a)["split_brain"]  # A does not know yet
    sites.b.start()
    until(lambda: cli_status(sites.a)["fenced"], "A to hear of epoch 2")
    assert cli_status(sites.a)["split_brain"] and not cli_status(sites.b)["split_brain"]
    assert 'vpnrepl_split_brain{vpn="orders"} 1.0' in sites.a.get("/metrics")
    assert 'vpnrepl_split_brain{vpn="orders"} 0.0' in sites.b.get("/metrics")
    demoted = sites.cli_a("demote", VPN, "--export", str(tmp_path / "tail.jsonl"))
    assert demoted.returncode == 0, demoted.stderr
    assert "1 topology changes (declares, binds, deletes) made through" in demoted.stdout
    assert not cli_status(sites.a)["split_brain"]  # a standby now, its tail exported


def test_the_admin_endpoint_promotes_only_with_its_credentials(sites: Sites) -> None:
    """``POST /vpns/VPN/promote`` starts the promotion the CLI would: 401
    without credentials, 202 with them, and ``/requests/ID`` follows it to
    the end; the audit trail says it came over HTTP."""
    token = "promote-token-0123456789"
    with open(sites.b_cfg, "a") as f:
        f.write(f'\n[admin]\ntoken = "{token}"\n')
    setup_vpn(sites.a.site)
    done = sites.cli_a("vpn", "enable", VPN, "--role", "active", "--queues", r"orders\..*")
    assert done.returncode == 0, done.stderr
    sites.a.start()
    sites.b.start()
    until(lambda: cli_status(sites.b)["bridge"] == "connected", "B to follow A")
    sites.a.kill()  # the disaster

    def post(auth: str | None) -> tuple[int, str]:
        return admin_call(sites.b.site.admin_port, f"/vpns/{VPN}/promote", "POST", auth, b"{}")

    assert post(None)[0] == 401
    assert post("Bearer wrong-token-0123456789")[0] == 401
    code, body = post(f"Bearer {token}")
    assert code == 202, body
    href = json.loads(body)["href"]

    def finished() -> dict[str, Any] | None:
        code, text = admin_call(sites.b.site.admin_port, href, auth=f"Bearer {token}")
        assert code == 200, text
        row: dict[str, Any] = json.loads(text)
        return row if row["state"] in ("done", "failed") else None

    row = until(finished, "the promotion requested over HTTP")
    assert row["state"] == "done", row
    assert cli_status(sites.b)["role"] == "active"
    audit = json.loads(sites.cli_b("audit", "--json").stdout)
    assert audit[0]["command"] == "promote" and audit[0]["state"] == "done"
