"""Local transactions across two sites, through unchanged pika clients.

Transactional publishes use numbers that are multiples of five (routing key
``order.eu.created``: only ``orders.q2`` in scope); messages seeded for the
transactional consumers use the other numbers and are taken from
``orders.q1``, so every number says which transaction touched it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions
import pytest

from bridge import FAILPOINTS
from plugin.devtools import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.markers import marker_names
from tests.support.prometheus import value
from tests.support.two_sites import (
    VPN,
    Publisher,
    amqp_url,
    assert_same_state,
    body,
    broker_depths,
    caught_up,
    cli_status,
    enable,
    live_caught_up,
    live_numbers,
    number,
    properties,
    routing_key,
    scalar,
    setup_vpn,
    until,
    vpn_status,
)

SEEDED = [n for n in range(1, 61) if n % 5]  # 48 messages in orders.q1 and orders.q2


def connect(site: LocalSite) -> Any:
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(site)))
    ch = conn.channel()
    ch.tx_select()
    return conn, ch


def publish(ch: Any, numbers: Iterable[int]) -> None:
    for n in numbers:
        ch.basic_publish("events", routing_key(n), body(n), properties(n))


def take(ch: Any, queue: str, count: int) -> list[int]:
    """Get and ack ``count`` messages of ``queue`` inside the transaction."""
    got = []
    for _ in range(count):
        method, _props, payload = ch.basic_get(queue)
        if method is None:
            break
        ch.basic_ack(method.delivery_tag)
        got.append(number(payload))
    return got


def seed(site: LocalSite) -> None:
    publisher = Publisher(site, SEEDED).run()
    assert publisher.error is None and publisher.confirmed == set(SEEDED)


def txn_states(site: LocalSite, side: str) -> list[str]:
    return [
        str(s)
        for s in scalar(
            site,
            "SELECT coalesce(array_agg(state ORDER BY created_at), '{}') FROM txn_log"
            " WHERE side = %s",
            side,
        )
    ]


def start_both(node_a: NodeProcess, node_b: NodeProcess) -> None:
    node_a.start()
    node_b.start()
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "the standby to connect")


def test_transactions_are_on_the_standby_when_the_client_hears_commit_ok(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    setup_vpn(site_a)
    enable(vpnrepl_a, "--mode", "sync", "--sync-timeout-ms", "10000")
    start_both(node_a, node_b)
    seed(site_a)
    caught_up(node_a, node_b)
    conn, ch = connect(site_a)

    # publish: on B the moment commit-ok arrives (sync mode)
    publish(ch, (100, 105, 110))
    ch.tx_commit()
    assert {(100, "orders.q2"), (105, "orders.q2"), (110, "orders.q2")} <= live_numbers(site_b)
    # consume: gone from B as well
    acked = take(ch, "orders.q1", 3)
    ch.tx_commit()
    assert len(acked) == 3
    assert not {(n, "orders.q1") for n in acked} & live_numbers(site_b)
    # mixed
    acked += take(ch, "orders.q1", 2)
    publish(ch, (115,))
    ch.tx_commit()
    on_b = live_numbers(site_b)
    assert (115, "orders.q2") in on_b and not {(n, "orders.q1") for n in acked} & on_b
    # rollback, and a channel closed mid-transaction: nothing anywhere
    publish(ch, (120,))
    rolled_back = take(ch, "orders.q1", 1)
    ch.tx_rollback()
    ch2 = conn.channel()
    ch2.tx_select()
    publish(ch2, (125,))
    take(ch2, "orders.q1", 1)
    ch2.close()
    conn.close()

    a_rows = assert_same_state(node_a, node_b)
    numbers = {(number(bytes(r[6])), r[0]) for r in a_rows}
    assert (120, "orders.q2") not in numbers and (125, "orders.q2") not in numbers
    assert {(n, "orders.q1") for n in rolled_back} <= numbers  # back in the queue
    assert len([n for n, q in numbers if q == "orders.q1"]) == len(SEEDED) - 5
    # three two-phase transactions, ended on A, committed on B; none in doubt
    until(lambda: txn_states(site_a, "coordinator") == ["ended"] * 3, "A's rows to end")
    until(lambda: txn_states(site_b, "participant") == ["committed"] * 3, "B's rows to commit")
    assert cli_status(node_a)["in_doubt_txns"] == cli_status(node_b)["in_doubt_txns"] == 0
    # each broker commit left its marker in the stream, which keeps them
    committed = scalar(site_a, "SELECT array_agg(txid ORDER BY created_at) FROM txn_log")
    assert marker_names(site_a.rabbit.amqp_url(VPN)) == committed
    # one client, one transaction at a time: the standby committed each one
    # from its prepared row, ahead of the ledger stream's copy (which it
    # then skipped: the state above is whole, and nothing twice)
    metrics = node_a.get("/metrics")
    assert value(metrics, "vpnrepl_txn_total", vpn=VPN, outcome="committed") == 3
    assert value(metrics, "vpnrepl_txn_applied_ahead_total", vpn=VPN) == 3
    assert scalar(site_b, "SELECT unknown_acks FROM vpn_state WHERE vpn = %s", VPN) == 0
    assert node_b.stop() == 0 and node_a.stop() == 0


def test_an_async_vpn_commits_without_the_standby_and_ships_the_transaction(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    """Async mode: no standby prepare (no participant rows); the committed
    transaction reaches the standby with the ledger stream."""
    setup_vpn(site_a)
    enable(vpnrepl_a)  # async is the default mode
    start_both(node_a, node_b)
    conn, ch = connect(site_a)
    publish(ch, (300, 305))
    ch.tx_commit()
    conn.close()
    assert_same_state(node_a, node_b)
    assert {(300, "orders.q2"), (305, "orders.q2")} <= live_numbers(site_b)
    until(lambda: txn_states(site_a, "coordinator") == ["ended"], "A's row to end")
    assert txn_states(site_b, "participant") == []
    assert node_b.stop() == 0 and node_a.stop() == 0


@pytest.mark.parametrize("policy", ["reject", "degrade"])
def test_a_standby_that_does_not_prepare_in_time(
    policy: str,
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    setup_vpn(site_a)
    enable(vpnrepl_a, "--mode", "sync", "--sync-timeout-ms", "1500", "--on-sync-timeout", policy)
    node_a.start()  # no standby at all
    conn, ch = connect(site_a)
    publish(ch, (200, 205))
    if policy == "reject":
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.tx_commit()
        assert refused.value.reply_code == 406
        assert "standby did not prepare in time" in refused.value.reply_text
        assert conn.is_open  # a channel exception, not a connection one
        conn.close()
        assert live_numbers(site_a) == set()
        assert scalar(site_a, "SELECT count(*) FROM ledger") == 0
        conn2 = pika.BlockingConnection(pika.URLParameters(site_a.rabbit.amqp_url(VPN)))
        depth = conn2.channel().queue_declare("orders.q2", passive=True).method.message_count
        conn2.close()
        assert depth == 0  # the broker rolled back
        assert txn_states(site_a, "coordinator") == ["aborted"]
        assert cli_status(node_a)["in_doubt_txns"] == 0
        return
    ch.tx_commit()  # degrade: committed here, shipped when the standby is back
    conn.close()
    assert cli_status(node_a)["degraded_txns"] == 1
    # the active's live state follows its ledger by a few milliseconds
    until(
        lambda: {(200, "orders.q2"), (205, "orders.q2")} <= live_numbers(site_a),
        "the transaction in A's live state",
        10,
    )
    node_b.start()
    caught_up(node_a, node_b)
    assert {(200, "orders.q2"), (205, "orders.q2")} <= live_numbers(site_b)
    until(lambda: cli_status(node_a)["degraded_txns"] == 0, "the degraded count to clear", 30)
    assert_same_state(node_a, node_b)


# ---------------------------------------------------------------- crashes


@dataclass
class Txn:
    published: tuple[int, ...]
    consumed: list[int] = field(default_factory=list)
    committed: bool = False  # the client got tx.commit-ok


class TxnClient(threading.Thread):
    """Runs transactions of one kind until ``rounds`` are done or the
    connection breaks; records each transaction and whether it committed."""

    def __init__(self, site: LocalSite, kind: str, numbers: Iterable[int], rounds: int) -> None:
        super().__init__(name=f"txn-{kind}", daemon=True)
        self.site, self.kind, self.rounds = site, kind, rounds
        self.numbers = iter(numbers)
        self.txns: list[Txn] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn, ch = connect(self.site)
        except pika.exceptions.AMQPError as e:
            self.error = e
            return
        try:
            for _ in range(self.rounds):
                count = {"publish": 3, "consume": 0, "mixed": 1}[self.kind]
                txn = Txn(tuple(itertools.islice(self.numbers, count)))
                self.txns.append(txn)
                if self.kind != "publish":
                    txn.consumed = take(ch, "orders.q1", 2 if self.kind == "consume" else 1)
                publish(ch, txn.published)
                ch.tx_commit()
                txn.committed = True
        except (pika.exceptions.AMQPError, OSError) as e:
            self.error = e
        finally:
            try:
                conn.close()
            except (pika.exceptions.AMQPError, OSError):
                pass


def applied_on(rows: set[tuple[int, str]], txn: Txn) -> bool | None:
    """True if all of ``txn`` shows in ``rows``, False if none, None if part."""
    parts = [(n, "orders.q2") in rows for n in txn.published]
    parts += [(n, "orders.q1") not in rows for n in txn.consumed]
    if all(parts):
        return True
    return False if not any(parts) else None


#: the transaction's steps (the promotion's are crashed in tests/two_sites/test_failover.py)
TXN_STEPS = [p for p in FAILPOINTS if p.startswith(("coordinator.", "participant."))]
#: the default suite's steps, one on each side of each vote and decision;
#: every step runs with -m fault (about 12 s each on 2 cores)
DEFAULT_STEPS = {
    "coordinator.after-prepare",
    "coordinator.after-decision",
    "participant.after-prepare",
    "participant.after-apply",
}


@pytest.mark.parametrize(
    "point",
    [pytest.param(p, marks=() if p in DEFAULT_STEPS else pytest.mark.fault) for p in TXN_STEPS],
)
def test_a_crash_at_every_step_keeps_both_sites_whole(
    point: str,
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    """SIGKILL the active (coordinator steps) or the standby (participant
    steps) at ``point`` while transactional publish, consume and mixed
    clients run; after restart and recovery: (a) every transaction whose
    client got commit-ok is applied on both sites, (b) every other one is
    applied on both or on neither, (c) nothing is left in doubt, (d) both
    sites' live state is identical."""
    setup_vpn(site_a)
    enable(vpnrepl_a, "--mode", "sync", "--sync-timeout-ms", "2000", "--on-sync-timeout", "degrade")
    start_both(node_a, node_b)
    seed(site_a)
    caught_up(node_a, node_b)
    victim = node_a if point.startswith("coordinator") else node_b
    assert victim.stop() == 0
    victim.start(failpoint=point)
    # streaming live again before the clients start: a transaction is
    # committed ahead of the stream only then (the *-apply-ahead points)
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "the standby back")
    fives = itertools.count(1000, 5)
    clients = [
        TxnClient(site_a, "publish", fives, rounds=4),
        TxnClient(site_a, "consume", (), rounds=4),
        TxnClient(site_a, "mixed", fives, rounds=4),
    ]
    for c in clients:
        c.start()
    victim.wait_killed()
    for c in clients:
        c.join(120)
        assert not c.is_alive()
    txns = [t for c in clients for t in c.txns]
    # what each client was told: a killed active cuts its connection (only
    # the transaction in flight is in doubt); a killed standby costs nothing
    # but time (degrade)
    for c in clients:
        if victim is node_b or c.error is None:
            assert c.error is None and len(c.txns) == 4, f"{c.kind}: {c.error!r}"
            assert all(t.committed for t in c.txns), f"{c.kind}: a commit-ok missing"
        else:
            assert isinstance(c.error, pika.exceptions.AMQPConnectionError | OSError), c.error
            assert all(t.committed for t in c.txns[:-1]), f"{c.kind}: only the last in doubt"
    # while the victim is still down, the other site holds every transaction
    # its client was told committed
    survivor = site_b if victim is node_a else site_a
    if survivor is site_a:
        live_caught_up(site_a)
    held = live_numbers(survivor)
    for txn in txns:
        if txn.committed:
            assert applied_on(held, txn) is True, f"{txn} confirmed, not on {survivor.name}"
    assert any(t.committed for t in txns) or victim is node_a
    victim.start()
    caught_up(node_a, node_b)
    a_rows = {(number(bytes(r[6])), r[0]) for r in assert_same_state(node_a, node_b)}  # (d)
    b_rows = live_numbers(site_b)
    for txn in txns:
        on_a, on_b = applied_on(a_rows, txn), applied_on(b_rows, txn)
        if txn.committed:
            assert on_a is on_b is True, f"{txn} confirmed but not applied on both"  # (a)
        else:
            assert on_a is not None and on_a == on_b, f"{txn} half applied"  # (b)
    depths = broker_depths(site_a)  # and both follow what the broker holds
    assert depths == {q: sum(1 for _, rq in a_rows if rq == q) for q in depths}
    for node in (node_a, node_b):  # (c)
        until(lambda n=node: cli_status(n)["in_doubt_txns"] == 0, f"no in-doubt on {node}", 30)
    assert node_b.stop() == 0 and node_a.stop() == 0
