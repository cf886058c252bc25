"""Two sites under faults: unchanged pika clients on the active while nodes
are SIGKILLed, the standby stays away past the ledger retention, sync mode
times out, and the bridge runs over (mutual) TLS.

Every message is numbered: its body starts with the six-digit number and its
``message_id`` is ``m-NNNNNN``, so a client-side list of confirmed numbers can
be checked against either site's ``live_message`` rows. Routing key
``order.created`` reaches ``orders.q1``, ``orders.q2`` and ``audit``;
``order.eu.created`` (every fifth number) only ``orders.q2`` and ``audit``.
``audit`` is out of the replication scope.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
import psycopg
import pytest
from pika.spec import Basic

from plugin._localsites import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.fix_tls import Pki

VPN = "orders"
SCOPE = r"orders\..*"
IN_SCOPE = ("orders.q1", "orders.q2")
LIVE = (
    "SELECT queue, repl_id, publish_index, exchange, routing_key, properties, body "
    "FROM live_message WHERE vpn = 'orders' ORDER BY queue, publish_index"
)
PADDING = b"." * 120


# ---------------------------------------------------------------- messages


def routing_key(n: int) -> str:
    return "order.eu.created" if n % 5 == 0 else "order.created"


def queues_of(n: int) -> tuple[str, ...]:
    """The in-scope queues message ``n`` is routed to."""
    return ("orders.q2",) if n % 5 == 0 else IN_SCOPE


def body(n: int) -> bytes:
    return b"%06d:" % n + PADDING


def number(payload: bytes) -> int:
    return int(payload[:6])


def properties(n: int) -> pika.BasicProperties:
    return pika.BasicProperties(
        delivery_mode=2,
        message_id=f"m-{n:06d}",
        content_type="text/plain",
        correlation_id=f"c-{n % 97}",
        priority=n % 10,
        timestamp=1_700_000_000 + n,
        headers={"n": n, "tag": "two-sites", "nested": {"even": n % 2 == 0}},
    )


def expected_rows(numbers: Iterable[int]) -> set[tuple[int, str]]:
    return {(n, q) for n in numbers for q in queues_of(n)}


# ---------------------------------------------------------------- sites


def amqp_url(site: LocalSite) -> str:
    return f"amqp://guest:guest@127.0.0.1:{site.amqp_port}/{VPN}"


def setup_vpn(site: LocalSite) -> None:
    """The VPN's topology, declared on the broker directly (as an admin would)."""
    site.rabbit.add_vhost(VPN)
    conn = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url(VPN)))
    ch = conn.channel()
    ch.exchange_declare("events", "topic", durable=True)
    for q, key in (("orders.q1", "order.*"), ("orders.q2", "order.#"), ("audit", "#")):
        ch.queue_declare(q, durable=True)
        ch.queue_bind(q, "events", key)
    conn.close()


def enable(vpnrepl: Vpnrepl, *options: str) -> None:
    done = vpnrepl("vpn", "enable", VPN, "--role", "active", "--queues", SCOPE, *options)
    assert done.returncode == 0, done.stderr


def live(site: LocalSite) -> list[tuple[Any, ...]]:
    with psycopg.connect(site.pg.dsn()) as db:
        return db.execute(LIVE).fetchall()


def live_numbers(site: LocalSite) -> set[tuple[int, str]]:
    return {(number(bytes(row[6])), row[0]) for row in live(site)}


def scalar(site: LocalSite, statement: str, *params: Any) -> Any:
    with psycopg.connect(site.pg.dsn(), autocommit=True) as db:
        row = db.execute(statement, params).fetchone()
    return None if row is None else row[0]


def broker_depths(site: LocalSite) -> dict[str, int]:
    """Exact queue depths from the broker itself (passive declares; the
    management API's counts lag by its statistics interval)."""
    conn = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url(VPN)))
    ch = conn.channel()
    depths = {q: ch.queue_declare(q, passive=True).method.message_count for q in IN_SCOPE}
    conn.close()
    return depths


def until(check: Callable[[], Any], what: str, timeout: float = 90.0) -> Any:
    """Poll ``check`` until it returns something true; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = check()
        except OSError:  # a node's admin endpoint between restarts
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


def vpn_status(node: NodeProcess) -> dict[str, Any]:
    vpns = [v for v in node.status()["vpns"] if v["name"] == VPN]
    return vpns[0] if vpns else {}


def caught_up(a: NodeProcess, b: NodeProcess, timeout: float = 120.0) -> None:
    """Wait until B applied A's whole ledger and A recorded B's acknowledgement."""

    def check() -> bool:
        va, vb = vpn_status(a), vpn_status(b)
        return bool(
            va
            and vb
            and va["ledger_index"] == vb["applied_index"] == va["applied_index"]
            and va["bridge"] == vb["bridge"] == "connected"
        )

    try:
        until(check, "the standby to catch up", timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}: A {a.status()} / B {b.status()}") from None


def live_caught_up(site: LocalSite) -> None:
    """Wait until the active's live state reflects its whole ledger (it is
    applied after each ledger commit, in a transaction of its own)."""
    until(
        lambda: scalar(
            site,
            "SELECT s.ledger_index = l.live_index FROM vpn_state s"
            " JOIN vpn_live_state l USING (vpn) WHERE s.vpn = %s",
            VPN,
        ),
        "the active's live state to catch up with its ledger",
        30,
    )


def assert_same_state(a: NodeProcess, b: NodeProcess) -> list[tuple[Any, ...]]:
    """B's live state is A's row for row, and ``status --json`` agrees."""
    caught_up(a, b)
    live_caught_up(a.site)
    a_rows, b_rows = live(a.site), live(b.site)
    assert len(a_rows) == len(b_rows)
    assert a_rows == b_rows  # (queue, id) for (queue, id); bodies, properties byte-identical
    sa, sb = cli_status(a), cli_status(b)
    assert sa["queues"] == sb["queues"]
    assert sa["ledger_index"] == sa["applied_index"] == sb["applied_index"]
    assert sa["unknown_acks"] == sb["unknown_acks"] == 0
    return a_rows


def cli_status(node: NodeProcess) -> dict[str, Any]:
    done = Vpnrepl(node.config)("status", "--json")
    assert done.returncode == 0, done.stderr
    vpns = [v for v in json.loads(done.stdout)["vpns"] if v["name"] == VPN]
    assert vpns, done.stdout
    return dict(vpns[0])


# ---------------------------------------------------------------- clients


class Publisher:
    """Publishes numbered persistent messages with publisher confirms through
    one pika ``SelectConnection``, up to ``window`` unconfirmed at a time, on
    its own thread; records which numbers were confirmed (acked) and nacked.

    A connection that goes away (a killed node) ends the run; ``error`` says
    why. Only the ioloop thread touches the connection.
    """

    def __init__(self, site: LocalSite, numbers: Iterable[int], window: int = 300) -> None:
        self.url = amqp_url(site)
        self.todo = list(numbers)
        self.window = window
        self.confirmed: set[int] = set()
        self.nacked: set[int] = set()
        self.error: str | None = None
        self._next = 0
        self._tag = 0
        self._pending: dict[int, int] = {}  # delivery tag -> number, ascending
        self._conn: pika.SelectConnection | None = None
        self._channel: Any = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)

    @property
    def settled(self) -> int:
        return len(self.confirmed) + len(self.nacked)

    @property
    def finished(self) -> bool:
        return self._thread.ident is not None and not self._thread.is_alive()

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def join(self, timeout: float = 120.0) -> Publisher:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"publisher still running after {timeout:g} s"
        return self

    def run(self, timeout: float = 120.0) -> Publisher:
        return self.start().join(timeout)

    def stop(self) -> None:
        """Publish nothing more; the run ends once the outstanding are settled."""
        assert self._conn is not None
        self._conn.ioloop.add_callback_threadsafe(self._stop)

    def _stop(self) -> None:
        self.todo = self.todo[: self._next]
        if self._channel is not None:
            self._fill()

    def _run(self) -> None:
        params = pika.URLParameters(self.url)
        self._conn = pika.SelectConnection(
            params,
            on_open_callback=self._opened,
            on_open_error_callback=self._failed,
            on_close_callback=self._closed,
        )
        try:
            self._conn.ioloop.start()
        finally:
            self._conn.ioloop.close()

    def _opened(self, conn: pika.SelectConnection) -> None:
        conn.channel(on_open_callback=self._channel_open)

    def _failed(self, conn: pika.SelectConnection, error: BaseException) -> None:
        self.error = f"connection failed: {error!r}"
        conn.ioloop.stop()

    def _closed(self, conn: pika.SelectConnection, reason: BaseException) -> None:
        if not self._closing:
            self.error = f"connection lost: {reason!r}"
        conn.ioloop.stop()

    def _channel_open(self, channel: Any) -> None:
        self._channel = channel
        channel.confirm_delivery(ack_nack_callback=self._confirm, callback=lambda _: self._fill())

    def _fill(self) -> None:
        while len(self._pending) < self.window and self._next < len(self.todo):
            n = self.todo[self._next]
            self._next += 1
            self._channel.basic_publish("events", routing_key(n), body(n), properties(n))
            self._tag += 1
            self._pending[self._tag] = n
        if not self._pending and self._next == len(self.todo) and not self._closing:
            self._closing = True
            assert self._conn is not None
            self._conn.close()

    def _confirm(self, frame: Any) -> None:
        method = frame.method
        into = self.confirmed if isinstance(method, Basic.Ack) else self.nacked
        tag = method.delivery_tag
        if method.multiple:
            while self._pending and next(iter(self._pending)) <= tag:
                into.add(self._pending.pop(next(iter(self._pending))))
        elif tag in self._pending:
            into.add(self._pending.pop(tag))
        else:  # the listener must never release a confirm twice
            self.error = self.error or f"a confirm of delivery tag {tag}, not outstanding"
        self._fill()


@dataclass
class Consumption:
    """What a consumer did: numbers removed from the queue, and requeued."""

    removed: set[int]
    requeued: int = 0
    redelivered: int = 0


def consume_mixed(
    site: LocalSite, queue: str, remove: int, inactivity: float = 30.0
) -> Consumption:
    """Consume ``queue`` until ``remove`` messages left it, settling deliveries
    in a fixed mix: groups of four acked by one ``multiple`` ack, single
    acks, nack and reject without requeue, and a nack *with* requeue for
    every tenth delivery (which comes back redelivered and is then acked).
    Deliveries still prefetched at the end are requeued by the cancel."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(site)))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=100)
    done = Consumption(set())
    group: list[int] = []
    seen = 0
    for method, props, payload in ch.consume(queue, inactivity_timeout=inactivity):
        assert method is not None, f"{queue}: no delivery for {inactivity:g} s"
        n = number(payload)
        assert props.message_id == f"m-{n:06d}"
        seen += 1
        tag = method.delivery_tag
        if method.redelivered:
            done.redelivered += 1
            ch.basic_ack(tag)
            done.removed.add(n)
        elif seen % 10 == 0:
            ch.basic_nack(tag, requeue=True)
            done.requeued += 1
        elif seen % 10 in (1, 2, 3, 4):
            group.append(n)
            if len(group) == 4:
                ch.basic_ack(tag, multiple=True)
                done.removed.update(group)
                group.clear()
        elif seen % 10 in (5, 6):
            ch.basic_ack(tag)
            done.removed.add(n)
        elif seen % 10 == 7:
            ch.basic_nack(tag, requeue=False)
            done.removed.add(n)
        else:
            ch.basic_reject(tag, requeue=False)
            done.removed.add(n)
        if len(done.removed) >= remove and not group:
            break
    ch.cancel()
    conn.close()
    return done


class ConsumerThread(threading.Thread):
    """:func:`consume_mixed` on a thread (it has its own connection)."""

    def __init__(self, site: LocalSite, queue: str, remove: int) -> None:
        super().__init__(name=f"consumer-{queue}", daemon=True)
        self.args = (site, queue, remove)
        self.result: Consumption | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = consume_mixed(*self.args)
        except BaseException as e:  # reported by finish()
            self.error = e

    def finish(self, timeout: float = 120.0) -> Consumption:
        self.join(timeout)
        assert not self.is_alive(), "consumer still running"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def publish_one(site: LocalSite, n: int) -> float:
    """Publish message ``n`` with a confirm on a ``BlockingConnection``;
    returns the seconds the confirm took (raises ``NackError`` on a nack)."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(site)))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        t0 = time.monotonic()
        ch.basic_publish("events", routing_key(n), body(n), properties(n))
        return time.monotonic() - t0
    finally:
        conn.close()


# ---------------------------------------------------------------- 1. steady state


def test_ten_thousand_messages_and_mixed_acks_mirror_byte_for_byte(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    setup_vpn(site_a)
    enable(vpnrepl_a)
    node_a.start()
    node_b.start()

    publisher = Publisher(site_a, range(1, 10_001)).run()
    assert publisher.error is None and not publisher.nacked
    assert len(publisher.confirmed) == 10_000
    # 40% of each in-scope queue leaves it, through the mix of settlements.
    q1 = consume_mixed(site_a, "orders.q1", remove=3_200)
    q2 = consume_mixed(site_a, "orders.q2", remove=4_000)
    assert q1.requeued and q1.redelivered and q2.requeued

    expected = expected_rows(range(1, 10_001))
    expected -= {(n, "orders.q1") for n in q1.removed}
    expected -= {(n, "orders.q2") for n in q2.removed}
    rows = assert_same_state(node_a, node_b)
    assert {(number(bytes(r[6])), r[0]) for r in rows} == expected
    counts = {q: sum(1 for _, qq in expected if qq == q) for q in IN_SCOPE}
    assert counts == {"orders.q1": 8_000 - len(q1.removed), "orders.q2": 10_000 - len(q2.removed)}
    assert vpn_status(node_a)["queues"] == vpn_status(node_b)["queues"] == counts
    assert broker_depths(site_a) == counts  # the replicated state is the broker's
    assert node_b.stop() == 0 and node_a.stop() == 0


# ---------------------------------------------------------------- 2. standby killed


def test_standby_killed_mid_stream_resyncs_from_its_applied_index(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    setup_vpn(site_a)
    enable(vpnrepl_a)
    node_a.start()
    node_b.start()

    publisher = Publisher(site_a, range(1, 8_001), window=100).start()
    consumer = ConsumerThread(site_a, "orders.q1", remove=2_500)
    consumer.start()
    until(lambda: vpn_status(node_b).get("applied_index", 0) >= 2_000, "B applying the stream")
    node_b.kill()
    assert publisher.settled < 8_000  # mid-stream: the publisher is still at work
    killed_at = scalar(site_b, "SELECT applied_index FROM vpn_state WHERE vpn = %s", VPN)
    until(
        lambda: vpn_status(node_a)["ledger_index"] >= killed_at + 1_000 or publisher.finished,
        "A's ledger to move on while B is down",
    )
    assert vpn_status(node_a)["ledger_index"] > killed_at
    node_b.start()
    publisher.join()
    removed = consumer.finish().removed
    assert publisher.error is None and len(publisher.confirmed) == 8_000

    rows = assert_same_state(node_a, node_b)
    expected = expected_rows(range(1, 8_001)) - {(n, "orders.q1") for n in removed}
    assert {(number(bytes(r[6])), r[0]) for r in rows} == expected
    # It resumed from its own applied index: a replay, no checkpoint.
    assert f"sync requested from index {killed_at + 1}\n" in node_b.log_text()
    assert f"from index {killed_at + 1}\n" in node_a.log_text()
    assert "checkpoint" not in node_a.log_text() + node_b.log_text()
    assert node_b.stop() == 0 and node_a.stop() == 0


# ---------------------------------------------------------------- 3. active killed


def test_active_killed_mid_stream_in_sync_mode_loses_nothing_confirmed(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    setup_vpn(site_a)
    # reject: a confirm can only mean that the standby acknowledged the message
    enable(vpnrepl_a, "--mode", "sync", "--sync-timeout-ms", "30000", "--on-sync-timeout", "reject")
    node_a.start()
    node_b.start()
    until(lambda: vpn_status(node_b).get("bridge") == "connected", "B connected")

    publisher = Publisher(site_a, range(1, 30_001), window=200).start()
    until(lambda: len(publisher.confirmed) >= 2_000, "2,000 confirms")
    node_a.kill()
    publisher.join()
    assert publisher.error is not None and "connection lost" in publisher.error
    confirmed = set(publisher.confirmed)
    assert 2_000 <= len(confirmed) < 30_000 and not publisher.nacked

    # Before A comes back: every confirmed message is on B, in each of its queues.
    on_b = live_numbers(site_b)
    missing = expected_rows(confirmed) - on_b
    assert not missing, f"{len(missing)} confirmed (message, queue) not on B: {sorted(missing)[:5]}"
    assert vpn_status(node_b)["unknown_acks"] == 0

    node_a.start()
    rows = assert_same_state(node_a, node_b)
    assert expected_rows(confirmed) <= {(number(bytes(r[6])), r[0]) for r in rows}
    assert node_b.stop() == 0 and node_a.stop() == 0


# ---------------------------------------------------------------- 4. retention


def test_standby_down_past_the_retention_gets_a_checkpoint(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    setup_vpn(site_a)
    with open(vpnrepl_a.config, "a") as f:
        f.write("\n[replication]\nledger_retain_seconds = 0\n")
    enable(vpnrepl_a)
    node_a.start()
    node_b.start()
    oldest = "SELECT min(idx) FROM ledger WHERE vpn = 'orders'"

    assert Publisher(site_a, range(1, 2_001)).run().error is None
    removed = consume_mixed(site_a, "orders.q1", remove=500).removed
    assert_same_state(node_a, node_b)
    # With no retention the node prunes all it acknowledged, but for the last
    # acknowledged entry (the standby proves with it that it follows).
    last = vpn_status(node_a)["ledger_index"]
    until(lambda: scalar(site_a, oldest) == last, "A to prune the acknowledged ledger")

    node_b.kill()
    b_at = scalar(site_b, "SELECT applied_index FROM vpn_state WHERE vpn = %s", VPN)
    assert Publisher(site_a, range(2_001, 5_001)).run().error is None
    removed |= consume_mixed(site_a, "orders.q1", remove=500).removed
    # The node only prunes what the standby acknowledged, so one standby is
    # never really behind the retained ledger ...
    assert scalar(site_a, oldest) <= b_at
    # ... so simulate what a retention shorter than the outage would do (as
    # with a second standby acknowledging): drop the ledger prefix B has not
    # received, straight in A's database.
    live_caught_up(site_a)  # a checkpoint reflects the live state: keep what it lacks
    cut = vpn_status(node_a)["ledger_index"] - 100
    with psycopg.connect(site_a.pg.dsn(), autocommit=True) as db:
        pruned = db.execute("DELETE FROM ledger WHERE vpn = %s AND idx <= %s", (VPN, cut))
        assert pruned.rowcount > cut - b_at
    # B comes back while publishes go on: a checkpoint, then replay and live.
    publisher = Publisher(site_a, range(5_001, 8_001), window=100).start()
    node_b.start()
    assert publisher.join().error is None
    rows = assert_same_state(node_a, node_b)
    expected = expected_rows(range(1, 8_001)) - {(n, "orders.q1") for n in removed}
    assert {(number(bytes(r[6])), r[0]) for r in rows} == expected
    installed = [
        line for line in node_b.log_text().splitlines() if "installed a checkpoint" in line
    ]
    assert len(installed) == 1, installed
    at = int(installed[0].rsplit(" ", 1)[1])
    assert at >= cut
    assert "a checkpoint of" in node_a.log_text()

    # A standby that lost its state altogether (a new site B) is also behind
    # what the node itself pruned: it gets a checkpoint of the real thing.
    node_b.kill()
    site_b.rabbit.reset()
    site_b.pg.reset()
    assert Vpnrepl(node_b.config)("init").returncode == 0
    node_b.start()
    assert assert_same_state(node_a, node_b) == rows
    installed = [
        line for line in node_b.log_text().splitlines() if "installed a checkpoint" in line
    ]
    assert len(installed) == 2, installed
    assert node_b.stop() == 0 and node_a.stop() == 0


# ---------------------------------------------------------------- 5. sync timeouts


@pytest.mark.parametrize("policy", ["degrade", "reject"])
def test_sync_mode_with_the_standby_stopped(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
    policy: str,
) -> None:
    timeout_ms = 1500
    setup_vpn(site_a)
    enable(
        vpnrepl_a,
        "--mode",
        "sync",
        "--sync-timeout-ms",
        str(timeout_ms),
        "--on-sync-timeout",
        policy,
    )
    node_a.start()
    node_b.start()
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "B connected")
    publish_one(site_a, 1)
    assert (1, "orders.q1") in live_numbers(site_b)  # confirmed: the standby has it
    assert vpn_status(node_a)["sync_eligible"] is True

    assert node_b.stop() == 0
    until(lambda: vpn_status(node_a)["bridge"] == "disconnected", "A to see B gone")
    cli_while_down: dict[str, Any] = {}
    if policy == "degrade":
        # The first confirm waits out the timeout, then the VPN is degraded
        # and confirms go out once the message is durable on A alone.
        assert publish_one(site_a, 2) >= 0.9 * timeout_ms / 1000
        assert vpn_status(node_a)["sync_eligible"] is False
        for n in range(3, 8):
            publish_one(site_a, n)
        assert vpn_status(node_a)["sync_eligible"] is False
        # the node records eligibility in vpn_state every 0.5 s; the
        # publishes above may all have been confirmed within that
        cli_while_down = until(
            lambda: (found := cli_status(node_a))["sync_eligible"] is False and found,
            "vpnrepl status to show the VPN sync-ineligible",
            5,
        )
    else:
        for n in (2, 3):
            t0 = time.monotonic()
            with pytest.raises(pika.exceptions.NackError):
                publish_one(site_a, n)
            assert time.monotonic() - t0 >= 0.9 * timeout_ms / 1000
        assert vpn_status(node_a)["sync_eligible"] is True  # reject never degrades

    node_b.start()
    caught_up(node_a, node_b)
    until(lambda: vpn_status(node_a)["sync_eligible"] is True, "A sync-eligible again")
    publish_one(site_a, 8)  # confirmed again, through the standby
    assert (8, "orders.q1") in live_numbers(site_b)
    assert_same_state(node_a, node_b)
    if policy == "degrade":
        # `vpnrepl status --json` is the admin's view of the same VPN.
        assert cli_while_down["sync_eligible"] is False, (
            "vpnrepl status --json said sync_eligible=true while the node's /status said false"
        )
    assert node_b.stop() == 0 and node_a.stop() == 0


def test_sync_mode_does_not_degrade_while_the_standby_keeps_up(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    """A publish stream that lasts longer than the sync timeout, with the
    standby up and acknowledging: no confirm may be released by the timeout
    policy (it would be a confirm the standby does not have yet)."""
    timeout_ms = 2000
    setup_vpn(site_a)
    enable(vpnrepl_a, "--mode", "sync", "--sync-timeout-ms", str(timeout_ms))
    node_a.start()
    node_b.start()
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "B connected")
    publisher = Publisher(site_a, range(1, 100_001), window=50).start()
    t0 = time.monotonic()
    until(lambda: time.monotonic() - t0 > 2.5 * timeout_ms / 1000, "a stream of 2.5 timeouts")
    publisher.stop()
    assert publisher.join().error is None and not publisher.nacked
    assert len(publisher.confirmed) > 1_000
    degraded = [x for x in node_a.log_text().splitlines() if "confirming without it" in x]
    assert not degraded, f"the VPN degraded with the standby up:\n{degraded[0]}"
    assert vpn_status(node_a)["sync_eligible"] is True
    assert_same_state(node_a, node_b)
    assert node_b.stop() == 0 and node_a.stop() == 0


# ---------------------------------------------------------------- 6. TLS


def _with_tls(node: NodeProcess, tls: str) -> None:
    with open(node.config, "a") as f:
        f.write(tls)


STALLED = ("no answer within", "SSL handshake is taking longer")


def assert_no_stalled_handshake(a: NodeProcess, b: NodeProcess) -> None:
    """On loopback a TLS handshake completes or fails at once; one that sits
    until a side's 10 s timeout is a bug, whatever the retry does later."""
    stalled = [
        line
        for line in (a.log_text() + b.log_text()).splitlines()
        if any(s in line for s in STALLED)
    ]
    assert not stalled, "bridge TLS handshakes stalled until a timeout:\n" + "\n".join(stalled)


@pytest.mark.parametrize("mutual", [False, True], ids=["TLS", "mutual TLS"])
def test_replication_over_tls(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
    pki: Pki,
    mutual: bool,
) -> None:
    setup_vpn(site_a)
    enable(vpnrepl_a)
    _with_tls(node_a, pki.section("a", "ca" if mutual else None))
    _with_tls(node_b, pki.section("b", "ca"))  # B verifies A against the private CA
    node_a.start()
    node_b.start()
    until(
        lambda: (
            vpn_status(node_b).get("bridge") == "connected"
            or any(s in node_b.log_text() for s in STALLED)
        ),
        "the bridge link over TLS",
    )
    assert_no_stalled_handshake(node_a, node_b)
    assert Publisher(site_a, range(1, 1_001)).run().error is None
    removed = consume_mixed(site_a, "orders.q2", remove=300).removed
    rows = assert_same_state(node_a, node_b)
    expected = expected_rows(range(1, 1_001)) - {(n, "orders.q2") for n in removed}
    assert {(number(bytes(r[6])), r[0]) for r in rows} == expected
    assert f"({'mutual TLS' if mutual else 'TLS'})\n" in node_a.log_text()
    assert node_b.stop() == 0 and node_a.stop() == 0


def test_a_standby_certificate_from_another_ca_is_refused(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
    pki: Pki,
) -> None:
    setup_vpn(site_a)
    enable(vpnrepl_a)
    _with_tls(node_a, pki.section("a", "ca"))
    _with_tls(node_b, pki.section("rogue", "ca"))
    node_a.start()
    node_b.start()
    assert Publisher(site_a, range(1, 101)).run().error is None
    peer = f"127.0.0.1:{site_a.bridge_port}"

    def refusals() -> tuple[list[str], list[str]]:
        return (
            [x for x in node_a.log_text().splitlines() if "standby at 127.0.0.1:" in x],
            [x for x in node_b.log_text().splitlines() if f"bridge to {peer}: " in x],
        )

    until(lambda: min(map(len, refusals())) >= 2, "two refused attempts in both logs")
    assert_no_stalled_handshake(node_a, node_b)
    on_a, on_b = refusals()
    for line in on_a[:2]:
        assert "bridge: refused standby at 127.0.0.1:" in line
        assert "TLS handshake failed: certificate verify failed" in line
        assert f"(the standby's certificate is not signed by {pki.dir / 'ca.crt'})" in line
    for line in on_b[:2]:
        assert "refused this site's certificate" in line and "; retrying in" in line
    # Nothing replicated: B never even learnt of the VPN.
    assert vpn_status(node_b) == {}
    assert scalar(site_b, "SELECT count(*) FROM live_message") == 0
    assert vpn_status(node_a)["bridge"] == "disconnected"
    assert vpn_status(node_a)["applied_index"] == 0
    assert node_b.stop() == 0 and node_a.stop() == 0
