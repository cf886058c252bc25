"""Two sites with unchanged pika clients: the helpers the two-site test
modules share (topology, numbered messages, state checks, client threads).

Every message is numbered: its body starts with the six-digit number and its
``message_id`` is ``m-NNNNNN``, so a client-side list of confirmed numbers can
be checked against either site's ``live_message`` rows. Routing key
``order.created`` reaches ``orders.q1``, ``orders.q2`` and ``audit``;
``order.eu.created`` (every fifth number) only ``orders.q2`` and ``audit``.
``audit`` is out of the replication scope.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
import psycopg
from pika.spec import Basic

from plugin.devtools import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess

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


def queue_numbers(site: LocalSite, queue: str) -> list[int]:
    """The numbers in ``queue`` of ``site``'s broker (read directly, requeued)."""
    return drained(pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url(VPN))), queue)


def drained(conn: pika.BlockingConnection, queue: str) -> list[int]:
    """The numbers in ``queue``, in queue order, read without acking on
    ``conn``, which is then closed (the messages go back)."""
    ch = conn.channel()
    got = []
    while True:
        method, _props, payload = ch.basic_get(queue)
        if method is None:
            break
        got.append(number(payload))
    conn.close()
    return got


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


def replicating(
    vpnrepl_a: Vpnrepl, node_a: NodeProcess, node_b: NodeProcess
) -> tuple[pika.BlockingConnection, Any]:
    """The VPN set up and enabled on site A, both nodes running, and a pika
    connection through A's listener with a channel in confirm mode."""
    setup_vpn(node_a.site)
    enable(vpnrepl_a)
    node_a.start()
    node_b.start()
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(node_a.site)))
    ch = conn.channel()
    ch.confirm_delivery()
    return conn, ch


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


def admin_call(
    port: int,
    path: str,
    method: str = "GET",
    auth: str | None = None,
    body: bytes | None = None,
    content_type: str = "application/json",
) -> tuple[int, str]:
    """An admin endpoint request on loopback: its status and body (an
    HTTP error is an answer too)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method)
    if auth is not None:
        req.add_header("Authorization", auth)
    if method == "POST":
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - loopback
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


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
    """``status --json`` by the node's own release (an upgrade test runs a
    previous release's node, whose config this release may not read)."""
    if node.code is None:
        done = Vpnrepl(node.config)("status", "--json")
    else:
        argv = [sys.executable, "-m", "plugin", "--config", str(node.config), "status", "--json"]
        done = subprocess.run(
            argv, cwd=node.code, capture_output=True, text=True, timeout=120, check=False
        )
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

    ``hold_at``: publish only the first that many numbers, then wait for
    :meth:`release` before the rest, so a test can act while the run is
    certainly not over, whatever the machine's load.
    """

    def __init__(
        self,
        site: LocalSite,
        numbers: Iterable[int],
        window: int = 300,
        hold_at: int | None = None,
    ) -> None:
        self.url = amqp_url(site)
        self.todo = list(numbers)
        self.window = window
        self._hold_at = hold_at
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

    def release(self) -> None:
        """Publish the numbers past ``hold_at`` too."""
        assert self._conn is not None
        self._conn.ioloop.add_callback_threadsafe(self._release)

    def _release(self) -> None:
        self._hold_at = None
        if self._channel is not None:
            self._fill()

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
        end = len(self.todo) if self._hold_at is None else min(self._hold_at, len(self.todo))
        while len(self._pending) < self.window and self._next < end:
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
