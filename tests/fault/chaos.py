"""The fault suite's workload, nemeses and runs (Jepsen-style).

A :class:`Run` sets up the two-site harness, starts a workload — confirmed
publishers, acking consumers and transactional clients, pika and aio-pika,
each on connections of its own — that records what every client was told
(:class:`~tests.fault.checker.History`, with timestamps), applies a
:class:`Nemesis` during it and heals it, stops the workload, drains both
sites, and hands what they hold to :mod:`tests.fault.checker`. Every run writes a
report: JSON, a text table and a plot of throughput and lag over time with
the fault marked (``VPNREPL_FAULT_REPORTS=DIR`` keeps them; by default they
go to the test's temporary directory).

Numbers say everything: a publisher's numbers that are not multiples of
five are routed to ``orders.q1`` and ``orders.q2``; a transactional
client's are multiples of five, routed to ``orders.q2`` alone. Consumers
take from ``orders.q1``; nobody consumes ``orders.q2``, where order and
transaction atomicity are checked.

Clients reconnect after a failure, trying both sites' listeners (a standby
refuses with 530, so they find the active one), and a publisher publishes
again a number whose confirm it never got: the at-least-once client every
real one is, and the duplicate that retry can make is the checker's to
explain.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import functools
import itertools
import json
import os
import pwd
import random
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import psycopg
import psycopg.sql

from bridge import Published, decode_event
from plugin.devtools import LocalSite, process_tree
from tests.fault.checker import (
    Fault,
    Final,
    History,
    OldActive,
    Publish,
    Txn,
    check,
    report_json,
    table,
    violations,
)
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.two_sites import VPN, cli_status, setup_vpn, until, vpn_status

Q1, Q2 = "orders.q1", "orders.q2"
#: the VPN's sync timeout (seconds)
SYNC_TIMEOUT = 3.0
PADDING = b"." * 200
#: what a client's connection failure can raise
CLIENT_ERRORS = (pika.exceptions.AMQPError, OSError, ConnectionError, AssertionError)


def body(n: int) -> bytes:
    return b"%d:" % n + PADDING


def number(payload: bytes) -> int:
    return int(payload.split(b":", 1)[0])


def routing_key(n: int) -> str:
    return "order.eu.created" if n % 5 == 0 else "order.created"


def queues_of(n: int) -> tuple[str, ...]:
    return (Q2,) if n % 5 == 0 else (Q1, Q2)


PERSISTENT = pika.BasicProperties(delivery_mode=2)


class Recorder:
    """The history, written by every client thread."""

    def __init__(self, mode: str) -> None:
        self.t0 = time.monotonic()
        self.history = History(mode, consumed_queues=frozenset({Q1}))
        self.lock = threading.Lock()
        self.confirmed = 0
        self.nacked = 0
        self.errors: list[tuple[float, str, str]] = []
        #: sender -> when it was answered (:meth:`longest_silence`)
        self.answers: dict[str, list[float]] = {}
        #: listener port -> its site; sender -> the site it is connected to
        self.sites: dict[int, str] = {}
        self.connected_to: dict[str, str] = {}

    def connected(self, url: str) -> None:
        """The calling client's connection is to the listener of ``url``."""
        port = urllib.parse.urlsplit(url).port or 0
        self.connected_to[threading.current_thread().name] = self.sites.get(port, "")

    def now(self) -> float:
        return time.monotonic() - self.t0

    def sent(self, n: int, publisher: int, queues: tuple[str, ...] | None = None) -> None:
        with self.lock:
            p = self.history.published.get(n)
            if p is None:
                self.history.published[n] = Publish(queues or queues_of(n), "uncertain", publisher)
            else:
                p.attempts += 1

    def told(self, n: int, outcome: str) -> None:
        with self.lock:
            self.history.published[n].outcome = outcome
            self.history.published[n].answered_by = self.connected_to.get(
                threading.current_thread().name, ""
            )
            self.confirmed += outcome == "confirmed"
            self.nacked += outcome == "nacked"
            self._answered()

    def _answered(self) -> None:
        """A sender got an answer (a confirm, a nack, a commit, an error):
        for the liveness check, when, per sender."""
        self.answers.setdefault(threading.current_thread().name, []).append(self.now())

    def longest_silence(self, start: float, end: float) -> dict[str, float]:
        """Per sender that was answered before ``start``: the longest time
        within [start, end] it went without an answer."""
        with self.lock:
            out = {}
            for who, times in self.answers.items():
                if not times or times[0] > start:
                    continue
                inside = [t for t in times if start < t <= end]
                edges = [start, *inside, end]
                out[who] = max(b - a for a, b in itertools.pairwise(edges))
            return out

    def acked(self, acks: list[tuple[int, str, float]], sure: bool) -> None:
        """Acks sent at the times given: ``sure``, a synchronous call on
        their channel returned after them; else the connection failed first."""
        with self.lock:
            for n, queue, sent in acks:
                if sure:
                    self.history.acked[(n, queue)] = sent
                else:
                    self.history.acks_unsure.add((n, queue))

    def txn(self, t: Txn) -> None:
        with self.lock:
            self.history.txns.append(t)
            self._answered()

    def error(self, who: str, e: BaseException) -> None:
        with self.lock:
            self.errors.append((self.now(), who, f"{type(e).__name__}: {e}"[:200]))
            if not who.startswith("consumer"):
                self._answered()


def connect(urls: list[str]) -> pika.BlockingConnection:
    """A connection to the first listener that takes it (the active site)."""
    return connect_to(urls)[0]


def connect_to(urls: list[str]) -> tuple[pika.BlockingConnection, str]:
    """:func:`connect`, and the URL that took it."""
    last: BaseException | None = None
    for url in urls:
        params = pika.URLParameters(url)
        params.connection_attempts = 1
        params.socket_timeout = 5
        params.blocked_connection_timeout = 30
        try:
            return pika.BlockingConnection(params), url
        except CLIENT_ERRORS as e:
            last = e
    raise ConnectionError(f"no listener took the connection: {last!r}")


class Client(threading.Thread):
    """A workload client: runs :meth:`session` on a fresh connection until
    stopped, reconnecting after each failure; ``pace`` seconds between two
    publishes (a transaction, a batch) bound the rate of a long run."""

    pace = 0.0

    def __init__(self, name: str, recorder: Recorder, urls: list[str], stop: threading.Event):
        super().__init__(name=name, daemon=True)
        self.recorder, self.urls, self.stop_event = recorder, urls, stop

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                conn, url = connect_to(self.urls)
            except CLIENT_ERRORS as e:
                self.recorder.error(self.name, e)
                time.sleep(0.5)
                continue
            self.recorder.connected(url)
            try:
                self.session(conn)
            except CLIENT_ERRORS as e:
                self.recorder.error(self.name, e)
                time.sleep(0.2)
            finally:
                with contextlib.suppress(Exception):
                    conn.close()

    def session(self, conn: pika.BlockingConnection) -> None:
        raise NotImplementedError


class Publisher(Client):
    """Confirmed publishes, one at a time (pika blocks until each confirm);
    a number left unconfirmed by a failure is published again."""

    def __init__(self, ident: int, recorder: Recorder, urls: list[str], stop: threading.Event):
        super().__init__(f"publisher-{ident}", recorder, urls, stop)
        self.publisher_id = ident
        self.numbers = (n for n in itertools.count(ident * 1_000_000 + 1) if n % 5)
        self.retry: int | None = None

    def session(self, conn: pika.BlockingConnection) -> None:
        ch = conn.channel()
        ch.confirm_delivery()
        while not self.stop_event.is_set():
            n = self.retry if self.retry is not None else next(self.numbers)
            self.retry = n
            self.recorder.sent(n, self.publisher_id)
            try:
                ch.basic_publish("events", routing_key(n), body(n), PERSISTENT)
            except pika.exceptions.NackError:
                self.recorder.told(n, "nacked")
            else:
                self.recorder.told(n, "confirmed")
            self.retry = None
            if self.pace:
                conn.sleep(self.pace)


class Consumer(Client):
    """Acks ``orders.q1``'s deliveries one by one. An ack is recorded with
    the time it was sent once a synchronous call on its channel (a
    ``basic.qos``) returned after it: then the broker had it. Acks a failure
    left without one are recorded as unsure."""

    #: acks sent between two synchronous calls
    batch = 10

    def __init__(self, name: str, recorder: Recorder, urls: list[str], stop: threading.Event):
        super().__init__(name, recorder, urls, stop)
        self.unsettled: list[tuple[int, str, float]] = []

    def run(self) -> None:
        super().run()
        self._unsure()

    def _unsure(self) -> None:
        self.recorder.acked(self.unsettled, sure=False)
        self.unsettled = []

    def _settle(self, ch: Any) -> None:
        ch.basic_qos(prefetch_count=20)  # synchronous: the acks before it arrived
        self.recorder.acked(self.unsettled, sure=True)
        self.unsettled = []

    def session(self, conn: pika.BlockingConnection) -> None:
        self._unsure()  # the last session's, cut off before their call
        ch = conn.channel()
        ch.basic_qos(prefetch_count=20)
        for method, _props, payload in ch.consume(Q1, inactivity_timeout=0.5):
            if self.stop_event.is_set():
                break
            if method is None:
                if self.unsettled:
                    self._settle(ch)
                continue
            sent = self.recorder.now()
            ch.basic_ack(method.delivery_tag)
            self.unsettled.append((number(payload), Q1, sent))
            if len(self.unsettled) >= self.batch:
                self._settle(ch)
        if self.unsettled:
            self._settle(ch)


class TxPublisher(Client):
    """Transactions of three publishes to ``orders.q2``."""

    def __init__(self, ident: int, recorder: Recorder, urls: list[str], stop: threading.Event):
        super().__init__(f"tx-{ident}", recorder, urls, stop)
        self.numbers = itertools.count(ident * 1_000_000 + 5, 5)

    def session(self, conn: pika.BlockingConnection) -> None:
        ch = conn.channel()
        ch.tx_select()
        while not self.stop_event.is_set():
            numbers = tuple(next(self.numbers) for _ in range(3))
            for n in numbers:
                ch.basic_publish("events", routing_key(n), body(n), PERSISTENT)
            try:
                ch.tx_commit()
            except pika.exceptions.ChannelClosedByBroker:
                self.recorder.txn(Txn(numbers, (Q2,), "failed"))
                raise
            except CLIENT_ERRORS:
                self.recorder.txn(Txn(numbers, (Q2,), "uncertain"))
                raise
            self.recorder.txn(Txn(numbers, (Q2,), "committed"))
            if self.pace:
                conn.sleep(self.pace)


class Declarer(Client):
    """Declares a queue in the replication scope, binds it and publishes
    ``per_queue`` confirmed numbers to it, then the next queue: the topology
    changes while the faults happen (``declared``: the queues so far)."""

    per_queue = 20

    def __init__(self, ident: int, recorder: Recorder, urls: list[str], stop: threading.Event):
        super().__init__(f"declarer-{ident}", recorder, urls, stop)
        self.publisher_id = ident
        self.numbers = (n for n in itertools.count(ident * 1_000_000 + 1) if n % 5)
        self.queues = itertools.count(1)
        self.declared: list[str] = []
        self.retry: list[int] = []
        self.queue = ""

    def session(self, conn: pika.BlockingConnection) -> None:
        ch = conn.channel()
        ch.confirm_delivery()
        while not self.stop_event.is_set():
            if not self.retry:
                self.queue = f"orders.dyn{next(self.queues)}"
                self.retry = [next(self.numbers) for _ in range(self.per_queue)]
            # declared again after a failure: idempotent, as a client would
            ch.queue_declare(self.queue, durable=True)
            ch.queue_bind(self.queue, "events", f"{self.queue}.key")
            if self.queue not in self.declared:
                self.declared.append(self.queue)
            while self.retry and not self.stop_event.is_set():
                n = self.retry[0]
                self.recorder.sent(n, self.publisher_id, (self.queue,))
                try:
                    ch.basic_publish("events", f"{self.queue}.key", body(n), PERSISTENT)
                except pika.exceptions.NackError:
                    self.recorder.told(n, "nacked")
                else:
                    self.recorder.told(n, "confirmed")
                self.retry.pop(0)
                if self.pace:
                    conn.sleep(self.pace)


class AioPublisher(threading.Thread):
    """Confirmed publishes through aio-pika (its own asyncio loop), 20 in
    flight; reconnects (aio-pika's robust connection) and retries."""

    pace = 0.0

    def __init__(self, ident: int, recorder: Recorder, urls: list[str], stop: threading.Event):
        super().__init__(name=f"aio-publisher-{ident}", daemon=True)
        self.publisher_id, self.recorder, self.urls, self.stop_event = ident, recorder, urls, stop
        self.numbers = (n for n in itertools.count(ident * 1_000_000 + 1) if n % 5)

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        import aio_pika

        retry: list[int] = []
        while not self.stop_event.is_set():
            try:
                conn = await self._connect(aio_pika)
            except Exception as e:  # noqa: BLE001 - recorded; the client tries again
                self.recorder.error(self.name, e)
                await asyncio.sleep(0.5)
                continue
            try:
                async with conn:
                    ch = await conn.channel(publisher_confirms=True)
                    ex = await ch.get_exchange("events", ensure=False)
                    while not self.stop_event.is_set():
                        batch = retry or [next(self.numbers) for _ in range(20)]
                        retry = list(batch)
                        for n in batch:
                            self.recorder.sent(n, self.publisher_id)
                        outcomes = await asyncio.gather(
                            *(
                                ex.publish(
                                    aio_pika.Message(body(n), delivery_mode=2), routing_key(n)
                                )
                                for n in batch
                            ),
                            return_exceptions=True,
                        )
                        for n, outcome in zip(batch, outcomes, strict=True):
                            if isinstance(outcome, aio_pika.exceptions.DeliveryError):
                                self.recorder.told(n, "nacked")
                                retry.remove(n)
                            elif not isinstance(outcome, BaseException):
                                self.recorder.told(n, "confirmed")
                                retry.remove(n)
                        if retry:
                            raise ConnectionError(f"{len(retry)} publishes unconfirmed")
                        await asyncio.sleep(self.pace * len(batch))
            except Exception as e:  # noqa: BLE001 - recorded; the client tries again
                self.recorder.error(self.name, e)
                await asyncio.sleep(0.2)

    async def _connect(self, aio_pika: Any) -> Any:
        last: BaseException | None = None
        for url in self.urls:
            # aio_pika.connect leaves the connection of a failed attempt open;
            # collected later by another thread, its __del__ schedules its
            # close on that thread's loop, which never runs it
            conn = aio_pika.Connection(aio_pika.connection.make_url(url))
            try:
                await conn.connect(timeout=5)
                self.recorder.connected(url)
                return conn
            except Exception as e:  # noqa: BLE001 - the next listener
                await conn.close()
                last = e
        raise ConnectionError(f"no listener took the connection: {last!r}")


# ---------------------------------------------------------------- processes


def signal_tree(pid: int | None, sig: signal.Signals) -> None:
    """Send ``sig`` to every process of a server: stopping a postmaster
    alone does not pause its backends."""
    if pid is None:
        raise AssertionError("the server is not running")
    for p in process_tree(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


# ---------------------------------------------------------------- the bridge


class FaultProxy:
    """A TCP proxy standing between the two sites' bridge: ``pass``,
    ``cut`` (every connection closed and new ones refused), ``blackhole``
    (connections stay open, nothing goes through) or ``delay`` (each chunk
    held ``delay`` seconds)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.mode = "pass"
        self.delay = 0.0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()

    def set(self, mode: str, delay: float = 0.0) -> None:
        self.mode, self.delay = mode, delay
        if mode == "cut":
            with self._lock:
                for s in list(self._socks):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if self.mode == "cut":
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._socks |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while self.mode == "blackhole":
                    time.sleep(0.05)
                if self.mode == "cut":
                    break
                if self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            with self._lock:
                self._socks -= {src, dst}

    def close(self) -> None:
        self._closed = True
        self.set("cut")
        self._server.close()


# ---------------------------------------------------------------- nemeses


@dataclass
class Nemesis:
    """A fault: ``apply`` it, wait ``hold`` seconds, ``heal`` it."""

    name: str
    apply: Callable[[Run], None]
    heal: Callable[[Run], None]
    hold: float = 5.0
    #: the run's PostgreSQL servers must keep a clock it can move (:func:`clock_jump`)
    clocks: bool = False


def _node(run: Run, side: str) -> NodeProcess:
    return run.node_a if side == "a" else run.node_b


def _site(run: Run, side: str) -> LocalSite:
    return _node(run, side).site


def kill_node(side: str) -> Nemesis:
    return Nemesis(
        f"SIGKILL node {side}",
        lambda r: _node(r, side).kill(),
        lambda r: _node(r, side).start(),
    )


def pause_node(side: str) -> Nemesis:
    return Nemesis(
        f"SIGSTOP node {side}",
        lambda r: signal_tree(_node(r, side).pid, signal.SIGSTOP),
        lambda r: signal_tree(_node(r, side).pid, signal.SIGCONT),
    )


def kill_rabbit(side: str) -> Nemesis:
    return Nemesis(
        f"SIGKILL RabbitMQ {side}",
        lambda r: _site(r, side).rabbit.kill(),
        lambda r: _site(r, side).rabbit.start(),
    )


def pause_rabbit(side: str) -> Nemesis:
    return Nemesis(
        f"SIGSTOP RabbitMQ {side}",
        lambda r: signal_tree(_site(r, side).rabbit._proc.pid, signal.SIGSTOP),  # type: ignore[union-attr]
        lambda r: signal_tree(_site(r, side).rabbit._proc.pid, signal.SIGCONT),  # type: ignore[union-attr]
    )


def kill_pg(side: str) -> Nemesis:
    return Nemesis(
        f"SIGKILL PostgreSQL {side}",
        lambda r: _site(r, side).pg.kill(),
        lambda r: _site(r, side).pg.start(),
    )


def pause_pg(side: str) -> Nemesis:
    return Nemesis(
        f"SIGSTOP PostgreSQL {side}",
        lambda r: signal_tree(_site(r, side).pg.postmaster_pid(), signal.SIGSTOP),
        lambda r: signal_tree(_site(r, side).pg.postmaster_pid(), signal.SIGCONT),
    )


def bridge(mode: str, delay: float = 0.0, hold: float = 5.0) -> Nemesis:
    """The bridge, both directions: a full partition (``cut``: reset;
    ``blackhole``: half-open, nothing goes through) or a slow WAN."""
    return Nemesis(
        f"bridge {mode}" + (f" {delay:g} s" if delay else "") + f", held {hold:g} s",
        lambda r: r.partition(mode, delay),
        lambda r: r.partition("pass"),
        hold,
    )


def link(name: str, mode: str, hold: float = 5.0) -> Nemesis:
    """One link of :attr:`Run.links` cut (reset) or black-holed (half-open:
    connections stay, nothing goes through — a COMMIT whose answer is lost)."""
    return Nemesis(
        f"link {name} {mode}, held {hold:g} s",
        lambda r: r.links[name].set(mode),
        lambda r: r.links[name].set("pass"),
        hold,
    )


def _promote(run: Run) -> None:
    # a promotion with the old active still serving: a split brain on purpose
    done = Vpnrepl(run.node_b.config)("promote", VPN, "--force")
    assert done.returncode == 0, done.stderr
    run.active = "b"


def _demote_old(run: Run) -> None:
    """The old active is fenced: demote it (its tail exported), so it
    follows the new active."""
    until(lambda: cli_status(run.node_a).get("fenced"), "the old active to be fenced", 60)
    # as an operator would: demote once the site knows where the new epoch
    # took over (a fence from the standby's report does not say; demote
    # refuses until the new active's listing did). A split brain is known
    # from then on too: the listing records both at once.
    until(lambda: _takeover_known(run.node_a.site), "where the new epoch took over", 60)
    run.split_brain_seen = bool(cli_status(run.node_a).get("split_brain"))
    run.history.old_active = read_old_active(run.node_a.site, run.node_b.site)
    tail = run.tmp / "tail.jsonl"
    done = Vpnrepl(run.node_a.config)("demote", VPN, "--export", str(tail))
    assert done.returncode == 0, done.stderr
    _take_tail(run, tail)


def _takeover_known(site: LocalSite) -> bool:
    """The site recorded an epoch newer than the one it holds the VPN at."""
    with psycopg.connect(site.pg.dsn(), autocommit=True) as db:
        row = db.execute(
            "SELECT (SELECT max(epoch) FROM vpn_epoch WHERE vpn = %s)"
            " > (SELECT epoch FROM vpn_config WHERE name = %s)",
            (VPN, VPN),
        ).fetchone()
    return bool(row and row[0])


def _take_tail(run: Run, tail: Path) -> None:
    """The exported ``tail`` into the history, and republished on B."""
    run.history.exported_tail = frozenset(
        number(base64.b64decode(json.loads(line)["body"]))
        for line in tail.read_text().splitlines()
        if line.strip()
    )
    # the operator puts the tail back: then nothing may be lost at all
    done = Vpnrepl(run.node_b.config)("republish", str(tail))
    assert done.returncode == 0, done.stderr
    run.history.republished = True


def _split(run: Run) -> None:
    """The bridge cut both ways, then B promoted with ``--force``: both
    sites take clients (a split brain on purpose)."""
    run.partition("cut")
    time.sleep(1.0)
    _promote(run)


def _heal_split(run: Run) -> None:
    run.partition("pass")
    _demote_old(run)


def split_brain(hold: float = 5.0) -> Nemesis:
    return Nemesis(
        "split brain: bridge cut both ways, B promoted --force", _split, _heal_split, hold
    )


#: how long the bridge is black-holed before the disaster: the standby
#: lags as over a slow WAN, so what it had not applied is at stake (within
#: the sync timeout, so a sync confirm still waits for it)
DISASTER_LAG = 1.5


def _lose_site_a(run: Run, lag: float) -> None:
    """Site A's node, RabbitMQ and PostgreSQL killed together, while the
    standby lags: a disaster."""
    run.proxy.set("blackhole")
    time.sleep(lag)
    site = run.node_a.site
    run.node_a.kill()
    site.rabbit.kill()
    site.pg.kill()
    run.proxy.set("cut")
    run.lost = "a"


def _promote_alone(run: Run) -> None:
    vpnrepl = Vpnrepl(run.node_b.config)
    done = vpnrepl("promote", VPN)  # no --force: A is gone
    assert done.returncode == 0, done.stderr
    run.active = "b"
    if run.mode == "sync" and run.policy == "reject":
        # with no standby to come, a sync+reject VPN nacks every publish:
        # the operator serves without one (README, "Promotion")
        done = vpnrepl("vpn", "enable", VPN, "--role", "active", "--mode", "async")
        assert done.returncode == 0, done.stderr


def disaster(lag: float = DISASTER_LAG) -> Nemesis:
    """Site A lost for good under load, the standby ``lag`` seconds behind
    (past the sync timeout, a ``degrade`` VPN confirms without it); B
    promoted; A never comes back."""
    return Nemesis(
        f"site A lost {lag:g} s into a bridge black hole, B promoted",
        functools.partial(_lose_site_a, lag=lag),
        _promote_alone,
        hold=2.0,
    )


def promotion() -> Nemesis:
    return Nemesis("promotion of the standby", _promote, _demote_old, hold=2.0)


def _switchover(run: Run) -> None:
    done = Vpnrepl(run.node_b.config)("switchover", VPN)
    assert done.returncode == 0, done.stderr
    run.active = "b"


def switchover() -> Nemesis:
    return Nemesis("switchover", _switchover, lambda r: None, hold=2.0)


def _disk_limit(run: Run, side: str, limit: str) -> None:
    _site(run, side).rabbit.ctl("set_disk_free_limit", limit)


def disk_alarm(side: str) -> Nemesis:
    """RabbitMQ's disk alarm: a free-space limit above what the disk has, so
    the broker blocks publishers (``connection.blocked``) until it is lowered."""
    return Nemesis(
        f"RabbitMQ {side} disk alarm",
        lambda r: _disk_limit(r, side, "100000GB"),
        lambda r: _disk_limit(r, side, "50MB"),
        hold=10.0,
    )


#: libfaketime, from Debian's faketime package (``./run test`` installs it)
FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")


def faketime_env(clock: Path) -> dict[str, str]:
    """A server started with this reads its wall clock as the real one
    shifted by the offset in ``clock`` (``+3600``), read at every clock read
    (libfaketime's cache misses a step back, and a step to ``+0``)."""
    if not FAKETIME.exists():
        raise AssertionError(f"{FAKETIME} is missing: install Debian's faketime package")
    return {
        "LD_PRELOAD": str(FAKETIME),
        "FAKETIME_TIMESTAMP_FILE": str(clock),
        "FAKETIME_NO_CACHE": "1",
    }


def _clock(run: Run, side: str) -> Path:
    # beside the server's data: a test's tmp directory is closed to its user
    return _site(run, side).pg.base / "clock"


def clock_jump(side: str, seconds: int, hold: float = 10.0) -> Nemesis:
    """Site ``side``'s clock steps ``seconds`` (forward or back), then
    steps back after ``hold``: as an NTP step would. It moves the site's
    PostgreSQL ``now()``, which drives the ledger's retention, replication
    lag, sync windows and the ``txn_log`` prune; the node reads no wall
    clock for a decision (tests/unit/test_clocks.py), and libfaketime cannot step
    a Python process's wall clock without breaking its sleeps, so the node
    keeps the real one."""

    def step(run: Run, offset: int) -> None:
        _clock(run, side).write_text(f"{offset:+d}\n")
        with psycopg.connect(_site(run, side).pg.dsn(), connect_timeout=10) as conn:
            row = conn.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8").fetchone()
        shift = (row[0] if row else 0.0) - time.time()
        assert abs(shift - offset) < 60, f"PostgreSQL {side}'s clock is {shift:+.0f} s off"

    return Nemesis(
        f"clock of site {side} {seconds:+d} s, held {hold:g} s",
        lambda r: step(r, seconds),
        lambda r: step(r, 0),
        hold,
        clocks=True,
    )


class MountRefused(Exception):
    """The machine forbids a tmpfs mount: a disk-full run cannot be built."""


def _fill_pg_disk(run: Run, side: str) -> None:
    """The ledger moved onto a small tmpfs tablespace, which is then filled:
    each ledger write fails with ``No space left on device``."""
    site = _site(run, side)
    small = site.base / "small-tablespace"
    small.mkdir(exist_ok=True)
    pw = pwd.getpwnam("postgres")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size=16m,uid={pw.pw_uid},gid={pw.pw_gid},mode=0700",
         "vpnrepl-small", str(small)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise MountRefused(f"mount -t tmpfs: {done.stderr.strip() or done.returncode}")
    with psycopg.connect(site.pg.dsn(), autocommit=True) as db:
        # a utility statement takes no parameters: the path as a quoted literal
        db.execute(
            psycopg.sql.SQL("CREATE TABLESPACE small LOCATION {}").format(
                psycopg.sql.Literal(str(small))
            )
        )
        db.execute("ALTER TABLE ledger SET TABLESPACE small")
    filler = small / "filler"
    with contextlib.suppress(OSError), filler.open("wb") as f:
        while True:
            f.write(b"\0" * (1 << 20))
            f.flush()


def _free_pg_disk(run: Run, side: str) -> None:
    site = _site(run, side)
    small = site.base / "small-tablespace"
    (small / "filler").unlink(missing_ok=True)
    with psycopg.connect(site.pg.dsn(), autocommit=True) as db:
        db.execute("ALTER TABLE ledger SET TABLESPACE pg_default")
        db.execute("DROP TABLESPACE small")
    subprocess.run(["umount", str(small)], check=True)


def pg_disk_full(side: str) -> Nemesis:
    return Nemesis(
        f"PostgreSQL {side} disk full (its ledger's tablespace)",
        lambda r: _fill_pg_disk(r, side),
        lambda r: _free_pg_disk(r, side),
        hold=10.0,
    )


def _follows(standby: NodeProcess) -> bool:
    return bool(vpn_status(standby).get("bridge") == "connected")


def _flap(run: Run, times: int) -> None:
    """``times`` switchovers, back and forth, under load."""
    for _ in range(times):
        standby = run.standby_node()
        # as an operator would: a switchover runs on a standby that follows
        # the active (the last one's demoted site is still syncing)
        until(functools.partial(_follows, standby), "the standby to follow the active", 60)
        done = Vpnrepl(standby.config)("switchover", VPN)
        assert done.returncode == 0, done.stderr
        run.active = "b" if run.active == "a" else "a"


def flapping(times: int = 5) -> Nemesis:
    return Nemesis(
        f"{times} switchovers back and forth", lambda r: _flap(r, times), lambda r: None, 1.0
    )


def _promote_twice_at_once(run: Run) -> None:
    """Two operators promote B at the same moment: one promotion, one epoch."""
    before = int(cli_status(run.node_b)["epoch"])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = list(
            pool.map(lambda _: Vpnrepl(run.node_b.config)("promote", VPN, "--force"), (1, 2))
        )
    assert any(d.returncode == 0 for d in runs), [d.stderr for d in runs]
    for d in runs:
        assert d.returncode == 0 or d.stderr.strip(), "a refused promotion said nothing"
    run.active = "b"
    run.epochs_raised = int(cli_status(run.node_b)["epoch"]) - before


def concurrent_promotions() -> Nemesis:
    return Nemesis("two promotions of B at once", _promote_twice_at_once, _demote_old, hold=2.0)


def _promote_killed_at(run: Run, failpoint: str, command: str) -> None:
    """B's node restarted with ``failpoint`` armed, then ``command``
    (``promote --force`` or ``switchover``) on B: the node dies at that step
    of its promotion, under load."""
    b = run.node_b
    b.stop()
    b.start(failpoint=failpoint)
    args = ("promote", VPN, "--force") if command == "promote" else ("switchover", VPN)
    Vpnrepl(b.config)(*args)  # its answer is lost with the node
    b.wait_killed()
    run.active = "b"


def _resume_promotion(run: Run) -> None:
    """B's node back: ``promote`` again resumes the promotion it began; the
    old active is then demoted, its tail republished."""
    run.node_b.start()
    done = Vpnrepl(run.node_b.config)("promote", VPN, "--force")
    assert done.returncode == 0, done.stderr
    _demote_old(run)


def promotion_killed(failpoint: str, command: str = "promote") -> Nemesis:
    return Nemesis(
        f"{command} with B's node killed at {failpoint}",
        lambda r: _promote_killed_at(r, failpoint, command),
        _resume_promotion,
        hold=1.0,
    )


def _demote_killed(run: Run) -> None:
    """B promoted; A's node killed while it demotes; A back, demoted again."""
    _promote(run)
    a = run.node_a
    until(lambda: cli_status(a).get("fenced"), "the old active to be fenced", 60)
    demote = subprocess.Popen(  # noqa: S603 - our own CLI
        Vpnrepl(a.config).argv("demote", VPN, "--export", str(run.tmp / "first.jsonl")),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.3)
    a.kill()
    demote.wait(60)


def _demote_again(run: Run) -> None:
    """A back: still fenced, it is demoted again; a demote that finished
    before the kill left its tail in the first file, which is republished."""
    run.node_a.start()
    if cli_status(run.node_a).get("fenced"):
        _demote_old(run)
        return
    assert cli_status(run.node_a)["role"] == "standby", "A is neither fenced nor a standby"
    run.split_brain_seen = False
    _take_tail(run, run.tmp / "first.jsonl")


def demote_killed() -> Nemesis:
    return Nemesis("demote with A's node killed", _demote_killed, _demote_again, hold=1.0)


#: every nemesis of the fault suite
NEMESES: dict[str, Callable[[], Nemesis]] = {
    "kill-node-a": lambda: kill_node("a"),
    "kill-node-b": lambda: kill_node("b"),
    "pause-node-a": lambda: pause_node("a"),
    "pause-node-b": lambda: pause_node("b"),
    "kill-rabbit-a": lambda: kill_rabbit("a"),
    "kill-rabbit-b": lambda: kill_rabbit("b"),
    "pause-rabbit-a": lambda: pause_rabbit("a"),
    "pause-rabbit-b": lambda: pause_rabbit("b"),
    "kill-pg-a": lambda: kill_pg("a"),
    "kill-pg-b": lambda: kill_pg("b"),
    "pause-pg-a": lambda: pause_pg("a"),
    "pause-pg-b": lambda: pause_pg("b"),
    "bridge-cut": lambda: bridge("cut"),
    "bridge-blackhole": lambda: bridge("blackhole"),
    "bridge-delay": lambda: bridge("delay", 0.2),
    "bridge-blackhole-30s": lambda: bridge("blackhole", hold=30.0),
    "pg-a-blackhole-30s": lambda: link("pg-a", "blackhole", hold=30.0),
    **{
        f"{name}-{mode}": functools.partial(link, name, mode)
        for name in ("client-a", "pg-a", "pg-b", "rabbit-a")
        for mode in ("cut", "blackhole")
    },
    "promotion": promotion,
    "switchover": switchover,
    "disaster": disaster,
    "split-brain": split_brain,
    "disk-alarm-a": lambda: disk_alarm("a"),
    "pg-disk-full-a": lambda: pg_disk_full("a"),
    "flapping": flapping,
    "concurrent-promotions": concurrent_promotions,
    "kill-mid-materialise": lambda: promotion_killed("promotion.mid-materialise"),
    "kill-mid-switchover": lambda: promotion_killed("promotion.before-finish", "switchover"),
    "kill-during-demote": demote_killed,
    "clock-forward-a": lambda: clock_jump("a", 3600),
    "clock-back-a": lambda: clock_jump("a", -3600),
    "clock-forward-b": lambda: clock_jump("b", 3600),
}


# ---------------------------------------------------------------- random schedules

#: what a random schedule draws from: faults that heal themselves, by the
#: process or link they take (two faults of one schedule never share one)
SCHEDULED: dict[str, tuple[str, Callable[[float], Nemesis]]] = {
    "kill-node-a": ("node-a", lambda h: _held(kill_node("a"), h)),
    "kill-node-b": ("node-b", lambda h: _held(kill_node("b"), h)),
    "pause-node-a": ("node-a", lambda h: _held(pause_node("a"), h)),
    "pause-node-b": ("node-b", lambda h: _held(pause_node("b"), h)),
    "kill-rabbit-a": ("rabbit-a", lambda h: _held(kill_rabbit("a"), h)),
    "pause-rabbit-b": ("rabbit-b", lambda h: _held(pause_rabbit("b"), h)),
    "kill-pg-b": ("pg-b", lambda h: _held(kill_pg("b"), h)),
    "pause-pg-a": ("pg-a", lambda h: _held(pause_pg("a"), h)),
    "bridge-cut": ("bridge", lambda h: bridge("cut", hold=h)),
    "bridge-blackhole": ("bridge", lambda h: bridge("blackhole", hold=h)),
    "bridge-delay": ("bridge", lambda h: bridge("delay", 0.2, hold=h)),
    "pg-a-blackhole": ("pg-a-link", lambda h: link("pg-a", "blackhole", h)),
    "rabbit-a-cut": ("rabbit-a-link", lambda h: link("rabbit-a", "cut", h)),
    "client-a-blackhole": ("client-a-link", lambda h: link("client-a", "blackhole", h)),
}


def _held(nemesis: Nemesis, hold: float) -> Nemesis:
    nemesis.hold = hold
    nemesis.name += f", held {hold:.1f} s"
    return nemesis


@dataclass
class Scheduled:
    """A fault of a random schedule: begins ``at`` seconds into it."""

    at: float
    kind: str
    nemesis: Nemesis


def schedule(seed: int, faults: int = 3, span: float = 20.0) -> list[Scheduled]:
    """``faults`` faults of random kind, target, start (within ``span``
    seconds: they may overlap) and hold (1-15 s), from ``seed`` alone: the
    same seed is the same schedule."""
    rng = random.Random(seed)  # noqa: S311 - a schedule to replay, not a secret
    kinds = sorted(SCHEDULED)
    rng.shuffle(kinds)
    chosen: list[Scheduled] = []
    taken: set[str] = set()
    for kind in kinds:
        target, make = SCHEDULED[kind]
        if target in taken:
            continue
        taken.add(target)
        hold = round(rng.uniform(1.0, 15.0), 1)
        chosen.append(Scheduled(round(rng.uniform(0.0, span), 1), kind, make(hold)))
        if len(chosen) == faults:
            break
    return sorted(chosen, key=lambda s: s.at)


# ---------------------------------------------------------------- a run


@dataclass
class Sample:
    t: float
    confirmed: int
    lag_events: int | None


@dataclass
class Run:
    node_a: NodeProcess
    node_b: NodeProcess
    vpnrepl_a: Vpnrepl
    mode: str
    tmp: Path
    policy: str = "reject"
    recorder: Recorder = field(init=False)
    proxy: FaultProxy = field(init=False)
    active: str = "a"
    #: the site lost for good ("" while both are there)
    lost: str = ""
    declarer: Declarer | None = None
    #: ``[replication]`` settings of both nodes (a small ledger bound, a
    #: short retention: a long partition outlasts them)
    replication: dict[str, int] = field(default_factory=dict)
    #: both sites' PostgreSQL run under libfaketime (:func:`clock_jump`)
    clocks: bool = False
    #: how far two promotions at once raised the epoch (one: one promotion)
    epochs_raised: int = 0
    #: per fault: each sender's longest time without an answer while it lasted
    silences: dict[str, dict[str, float]] = field(default_factory=dict)
    #: the old active's status showed SPLIT-BRAIN once it heard of the new epoch
    split_brain_seen: bool = False
    #: what :meth:`report` found broken
    broken: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.recorder = Recorder(self.mode)
        self.recorder.history.policy = self.policy
        self._stop = threading.Event()
        self._clients: list[threading.Thread] = []
        a, b = self.node_a.site, self.node_b.site
        # each site names the other, as deployed: after a promotion A learns
        # of the new epoch from B and is fenced. Each reaches the other's
        # bridge through a proxy of its own, so a fault can take either
        # direction, or both (a full partition)
        self.proxy = FaultProxy(("127.0.0.1", a.bridge_port))  # B -> A
        self.proxy_ab = FaultProxy(("127.0.0.1", b.bridge_port))  # A -> B
        a.write_config(self.node_a.config, peer=b)
        for node, peer_port, proxy in (
            (self.node_b, a.bridge_port, self.proxy),
            (self.node_a, b.bridge_port, self.proxy_ab),
        ):
            text = node.config.read_text().replace(
                f'bridge = "127.0.0.1:{peer_port}"', f'bridge = "127.0.0.1:{proxy.port}"'
            )
            node.config.write_text(text)
        # the other links a partition can take: clients to A's listener, each
        # node to its own PostgreSQL, A's node to its RabbitMQ
        self.links = {
            "client-a": FaultProxy(("127.0.0.1", a.amqp_port)),
            "pg-a": FaultProxy(("127.0.0.1", a.pg.port)),
            "pg-b": FaultProxy(("127.0.0.1", b.pg.port)),
            "rabbit-a": FaultProxy(("127.0.0.1", a.rabbit.amqp_port)),
        }
        self.recorder.sites = {self.links["client-a"].port: "a", b.amqp_port: "b"}
        for node, site, side in ((self.node_a, a, "a"), (self.node_b, b, "b")):
            store = site.pg.dsn()
            text = node.config.read_text().replace(
                f'[store]\ndsn = "{store}"',
                f'[store]\ndsn = "{_via(store, site.pg.port, self.links[f"pg-{side}"])}"',
            )
            if side == "a":
                broker = site.rabbit.amqp_url()
                via = _via(broker, site.rabbit.amqp_port, self.links["rabbit-a"])
                text = text.replace(f'amqp_url = "{broker}"', f'amqp_url = "{via}"')
            if self.replication:
                text += "\n[replication]\n" + "".join(
                    f"{k} = {v}\n" for k, v in self.replication.items()
                )
            node.config.write_text(text)

    def partition(self, mode: str, delay: float = 0.0) -> None:
        """Both bridge directions at once: ``pass``, ``cut``, ``blackhole``, ``delay``."""
        for proxy in (self.proxy, self.proxy_ab):
            proxy.set(mode, delay)

    @property
    def history(self) -> History:
        return self.recorder.history

    def urls(self) -> list[str]:
        """A's listener (through the client link's proxy), then B's."""
        return [
            f"amqp://guest:guest@127.0.0.1:{port}/{VPN}"
            for port in (self.links["client-a"].port, self.node_b.site.amqp_port)
        ]

    def setup(self) -> None:
        if self.clocks:
            # the shared servers restart with a clock a fault can move; they
            # are restarted on the real one by close()
            for side in ("a", "b"):
                _clock(self, side).write_text("+0\n")
                _site(self, side).pg.extra_env = faketime_env(_clock(self, side))
                _site(self, side).pg.restart()
        setup_vpn(self.node_a.site)
        options = ["--mode", self.mode, "--sync-timeout-ms", str(int(SYNC_TIMEOUT * 1000))]
        if self.mode == "sync":
            options += ["--on-sync-timeout", self.policy]
        done = self.vpnrepl_a(
            "vpn", "enable", VPN, "--role", "active", "--queues", r"orders\..*", *options
        )
        assert done.returncode == 0, done.stderr
        self.node_a.start()
        self.node_b.start()
        until(lambda: vpn_status(self.node_a).get("bridge") == "connected", "the standby")

    def start_workload(
        self,
        publishers: int = 2,
        consumers: int = 1,
        tx: int = 1,
        pace: float = 0.0,
        declare: bool = False,
    ) -> None:
        """Start the clients; ``pace`` > 0 spaces each publisher's publishes
        (a long run's unconsumed ``orders.q2`` stays small enough to check);
        ``declare``: a client declares, binds and fills new queues."""
        urls, rec, stop = self.urls(), self.recorder, self._stop
        # the first publisher tries B first: in a split brain both sites take clients
        senders: list[Client | AioPublisher] = [
            *(
                Publisher(i + 1, rec, urls[::-1] if i == 0 else urls, stop)
                for i in range(publishers)
            ),
            AioPublisher(publishers + 1, rec, urls, stop),
            *(TxPublisher(8 + i, rec, urls, stop) for i in range(tx)),
        ]
        if declare:
            self.declarer = Declarer(7, rec, urls, stop)
            senders.append(self.declarer)
        for sender in senders:
            sender.pace = pace
        self._clients = [*senders]
        self._clients += [Consumer(f"consumer-{i}", rec, urls, stop) for i in range(consumers)]
        sampler = threading.Thread(target=self._sample, name="sampler", daemon=True)
        for c in [*self._clients, sampler]:
            c.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            lag = None
            with contextlib.suppress(Exception):
                lag = int(vpn_status(self.active_node())["lag_events"])
            self.samples.append(Sample(self.recorder.now(), self.recorder.confirmed, lag))
            time.sleep(0.5)

    def active_node(self) -> NodeProcess:
        return self.node_a if self.active == "a" else self.node_b

    def standby_node(self) -> NodeProcess:
        return self.node_b if self.active == "a" else self.node_a

    def wait_confirmed(self, more: int, timeout: float = 60.0) -> None:
        goal = self.recorder.confirmed + more
        try:
            until(
                lambda: self.recorder.confirmed >= goal, f"{more} more confirmed publishes", timeout
            )
        except AssertionError as e:
            raise AssertionError(
                f"{e}; {self.recorder.nacked} nacks so far; the clients' last errors: "
                f"{self.recorder.errors[-8:]}; last samples (t, confirmed, lag): "
                f"{[(round(x.t), x.confirmed, x.lag_events) for x in self.samples[-6:]]}"
            ) from None

    def apply(self, nemesis: Nemesis) -> None:
        start = self.recorder.now()
        nemesis.apply(self)
        time.sleep(nemesis.hold)
        nemesis.heal(self)
        self.faults.append(Fault(nemesis.name, start, self.recorder.now()))
        self.history.faults.append(self.faults[-1])
        self.silences[nemesis.name] = self.recorder.longest_silence(start, self.recorder.now())

    def apply_schedule(self, faults: list[Scheduled]) -> None:
        """Each fault in a thread of its own, from its start: they overlap
        as the schedule has them; returns once every one healed."""
        errors: list[BaseException] = []

        def one(s: Scheduled) -> None:
            time.sleep(s.at)
            try:
                self.apply(s.nemesis)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in faults]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
            assert not t.is_alive(), "a fault did not heal within 300 s"
        if errors:
            raise errors[0]

    def stop_workload(self) -> None:
        self._stop.set()
        for c in self._clients:
            c.join(60)
            assert not c.is_alive(), f"{c.name} did not stop"

    def queues(self) -> list[str]:
        return [Q1, Q2, *(self.declarer.declared if self.declarer is not None else ())]

    def drain(self) -> Final:
        """Both sites healed and caught up: what they hold (with a site lost
        for good, what the other holds alone)."""
        if self.lost:
            return self._drain_alone()
        active, standby = self.active_node(), self.standby_node()
        for node in (active, standby):
            assert node.alive(), f"node {node.name} is not running at the drain"
        until(
            lambda: (
                (a := vpn_status(active))
                and (b := vpn_status(standby))
                and a.get("bridge") == "connected"
                and a["ledger_index"] == a["applied_index"] == b["applied_index"]
            ),
            "the standby to catch up at the drain",
            120,
        )
        until(lambda: _live_caught_up(active.site), "the active's live state", 60)
        return Final(
            {q: broker_numbers(active.site, q) for q in self.queues()},
            live_numbers(active.site),
            live_numbers(standby.site),
        )

    def _drain_alone(self) -> Final:
        """The surviving site's state, read while the lost one is still
        down; then the lost site's PostgreSQL alone is started to read what
        its ledger held (:func:`read_old_active`)."""
        active = self.active_node()
        assert active.alive(), f"node {active.name} is not running at the drain"
        until(lambda: _live_caught_up(active.site), "the active's live state", 60)
        final = Final(
            {q: broker_numbers(active.site, q) for q in self.queues()},
            live_numbers(active.site),
            None,
        )
        lost = self.standby_node().site
        lost.pg.start()
        self.history.old_active = read_old_active(lost, active.site)
        return final

    def report(self, final: Final, name: str) -> dict[str, dict[str, list[Any]]]:
        verdicts = check(self.history, final)
        broken = violations(self.history, verdicts)
        out = Path(os.environ.get("VPNREPL_FAULT_REPORTS", str(self.tmp)))
        out.mkdir(parents=True, exist_ok=True)
        old = self.history.old_active
        lost = sorted({n for v in verdicts for n in v.lost})
        extra = {
            "nemesis": name,
            "lost_traces": self._traces(lost[:20]),
            "old_active": None
            if old is None
            else {"applied_at_promotion": old.applied_at_promotion, "ineligible": old.ineligible},
            "republished": self.history.republished,
            "exported": len(self.history.exported_tail or ()),
            "longest_silence": self.silences,
            "client_errors": self.recorder.errors[-50:],
            "samples": [(s.t, s.confirmed, s.lag_events) for s in self.samples],
        }
        (out / f"{name}.json").write_text(report_json(self.history, verdicts, extra))
        text = f"{name} ({self.mode}): faults {[f.name for f in self.faults]}\n{table(verdicts)}\n"
        (out / f"{name}.txt").write_text(text)
        plot(self.samples, self.faults, out / f"{name}.png", f"{name} ({self.mode})")
        print(text)
        return broken

    def _traces(self, numbers: list[int]) -> dict[str, dict[str, list[str]]]:
        """Where each lost number is still found, per site whose PostgreSQL
        answers: the row kinds holding it (a failure explains itself)."""
        out: dict[str, dict[str, list[str]]] = {}
        for node in (self.node_a, self.node_b):
            if not node.site.pg.alive():
                continue
            with psycopg.connect(node.site.pg.dsn(), autocommit=True) as db:
                for n in numbers:
                    found = trace(db, n)
                    if found:
                        out.setdefault(str(n), {})[node.name] = found
        return out

    def close(self) -> None:
        self._stop.set()
        self.proxy.close()
        self.proxy_ab.close()
        for link in self.links.values():
            link.close()
        if self.clocks:
            for side in ("a", "b"):
                _node(self, side).kill()
                _site(self, side).pg.extra_env = {}
                _site(self, side).pg.restart()


def read_old_active(old: LocalSite, new: LocalSite) -> OldActive:
    """What a promotion left behind: the old active's ledger index the new
    one took over at, and the index of each number the old one ledgered."""
    with psycopg.connect(new.pg.dsn(), autocommit=True) as db:
        row = db.execute(
            "SELECT taken_over_at FROM vpn_epoch WHERE vpn = %s ORDER BY epoch DESC LIMIT 1",
            (VPN,),
        ).fetchone()
    assert row is not None, "the promoted site recorded no epoch"
    index_of: dict[int, int] = {}
    epochs: set[int] = set()
    with psycopg.connect(old.pg.dsn(), autocommit=True) as db:
        for idx, epoch, data in db.execute(
            "SELECT idx, epoch, event FROM ledger WHERE vpn = %s AND kind = 'published'", (VPN,)
        ):
            event = decode_event(bytes(data), VPN)
            assert isinstance(event, Published)
            index_of.setdefault(number(event.body), int(idx))
            epochs.add(int(epoch))
        # the ranges it confirmed without the standby (sync + degrade); one
        # a crash left open ends at its ledger index
        windows = db.execute(
            "SELECT w.first_index, COALESCE(w.last_index, s.ledger_index)"
            " FROM sync_window w JOIN vpn_state s ON s.vpn = w.vpn"
            " WHERE w.vpn = %s AND w.epoch = ANY(%s) ORDER BY w.first_index",
            (VPN, sorted(epochs)),
        ).fetchall()
    return OldActive(int(row[0]), index_of, [(int(a), int(b)) for a, b in windows])


def _via(url: str, port: int, proxy: FaultProxy) -> str:
    """``url`` (of 127.0.0.1:``port``) through ``proxy``."""
    return url.replace(f"127.0.0.1:{port}/", f"127.0.0.1:{proxy.port}/")


def _live_caught_up(site: LocalSite) -> bool:
    with psycopg.connect(site.pg.dsn(), autocommit=True) as db:
        row = db.execute(
            "SELECT s.ledger_index = l.live_index FROM vpn_state s"
            " JOIN vpn_live_state l USING (vpn) WHERE s.vpn = %s",
            (VPN,),
        ).fetchone()
    return bool(row and row[0])


def broker_numbers(site: LocalSite, queue: str) -> list[int]:
    """The numbers in ``queue`` of ``site``'s broker, in queue order (read
    directly, unacked: they go back when the connection closes); none when
    the broker has no such queue."""
    conn = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url(VPN)))
    try:
        ch = conn.channel()
        try:
            depth = ch.queue_declare(queue, passive=True).method.message_count
        except pika.exceptions.ChannelClosedByBroker as e:
            if e.reply_code != 404:
                raise
            return []  # not there: what it was told it holds is lost
        got: list[int] = []
        if depth:
            ch.basic_qos(prefetch_count=0)
            for method, _props, payload in ch.consume(queue, inactivity_timeout=5):
                if method is None:
                    break
                got.append(number(payload))
                if len(got) >= depth:
                    break
        return got
    finally:
        conn.close()


#: where :func:`trace` looks for a number's body, and how it names a row
_TRACES = (
    ("live", "SELECT queue FROM live_message WHERE vpn = %(vpn)s AND position(%(b)s IN body) = 1"),
    (
        "ledger",
        "SELECT idx::text || ' epoch ' || epoch || ' ' || kind FROM ledger"
        " WHERE vpn = %(vpn)s AND position(%(b)s IN event) > 0",
    ),
    (
        "txn_log",
        "SELECT txid || ' ' || side || ' ' || state FROM txn_log"
        " WHERE vpn = %(vpn)s AND position(%(b)s IN events) > 0",
    ),
)


def trace(db: psycopg.Connection[Any], n: int) -> list[str]:
    """The rows of one site's store that hold number ``n``'s body."""
    found = []
    for kind, sql in _TRACES:
        for (where,) in db.execute(sql, {"vpn": VPN, "b": body(n)}).fetchall():
            found.append(f"{kind}: {where}")
    return found


def live_numbers(site: LocalSite) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    with psycopg.connect(site.pg.dsn(), autocommit=True) as db:
        for queue, payload in db.execute(
            "SELECT queue, body FROM live_message WHERE vpn = %s", (VPN,)
        ).fetchall():
            out.setdefault(str(queue), set()).add(number(bytes(payload)))
    return out


def plot(samples: list[Sample], faults: list[Fault], path: Path, title: str) -> None:
    """Throughput (confirms per second) and lag over time, faults shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    pairs = list(itertools.pairwise(samples))
    top.plot(
        [b.t for _, b in pairs],
        [(b.confirmed - a.confirmed) / max(b.t - a.t, 1e-3) for a, b in pairs],
    )
    top.set_ylabel("confirms / s")
    bottom.plot([s.t for s in samples], [s.lag_events or 0 for s in samples])
    bottom.set_ylabel("lag (events)")
    bottom.set_xlabel("seconds")
    for f in faults:
        for ax in (top, bottom):
            ax.axvspan(f.start, f.end, alpha=0.2, color="red")
        top.annotate(f.name, (f.start, 0), fontsize=7)
    fig.suptitle(title)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_resources(
    samples: list[tuple[float, int, int, int]], faults: list[Fault], path: Path, title: str
) -> None:
    """Both nodes' RSS and the active's ledger rows over time (the soak's
    ``(t, rss a KiB, rss b KiB, ledger rows)`` samples), faults shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    t = [s[0] for s in samples]
    top.plot(t, [s[1] / 1024 for s in samples], label="node a")
    top.plot(t, [s[2] / 1024 for s in samples], label="node b")
    top.set_ylabel("RSS (MiB)")
    top.legend(loc="upper left")
    bottom.plot(t, [s[3] for s in samples])
    bottom.set_ylabel("ledger rows")
    bottom.set_xlabel("seconds")
    for f in faults:
        for ax in (top, bottom):
            ax.axvspan(f.start, f.end, alpha=0.2, color="red")
    fig.suptitle(title)
    fig.savefig(path, dpi=80)
    plt.close(fig)


@contextlib.contextmanager
def run(
    node_a: NodeProcess,
    node_b: NodeProcess,
    vpnrepl_a: Vpnrepl,
    mode: str,
    tmp: Path,
    policy: str = "reject",
    replication: dict[str, int] | None = None,
    clocks: bool = False,
) -> Iterator[Run]:
    r = Run(
        node_a, node_b, vpnrepl_a, mode, tmp, policy, replication=replication or {}, clocks=clocks
    )
    try:
        yield r
    finally:
        r.close()


def summary(*dirs: Path) -> str:
    """A Markdown table of the JSON reports in ``dirs`` (one row per run):
    ``python -m tests.fault.chaos DIR...``."""
    head = (
        "| run | mode | faults | published | lost | lost, excused | exported | republished"
        " | duplicates (unexplained) | resurrected (unexplained) | longest silence (s)"
        " | violations |"
    )
    rows = [head, "|" + " --- |" * 12]
    for path in sorted(p for d in dirs for p in d.glob("*.json")):
        doc = json.loads(path.read_text())
        if "verdicts" not in doc:
            continue
        v = doc["verdicts"]

        def total(kind: str, verdicts: list[dict[str, Any]] = v) -> int:
            return sum(len(x[kind]) for x in verdicts)

        silences = [t for f in doc.get("longest_silence", {}).values() for t in f.values()]
        broken = sorted({k for kinds in doc["violations"].values() for k in kinds})
        mode = doc["mode"] + (f"+{doc['policy']}" if doc["mode"] == "sync" else "")
        rows.append(
            f"| {path.stem} | {mode} | {'; '.join(f['name'] for f in doc['faults'])} |"
            f" {doc['published']} | {total('lost')} | {total('lost_excused')} |"
            f" {doc.get('exported', '-')} | {'yes' if doc.get('republished') else '-'} |"
            f" {total('duplicated')} ({total('duplicated_unexplained')}) |"
            f" {total('resurrected')} ({total('resurrected_unexplained')}) |"
            f" {max(silences, default=0):.1f} | {', '.join(broken) or 'none'} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    print(summary(*(Path(a) for a in sys.argv[1:])))
