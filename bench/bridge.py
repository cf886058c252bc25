"""What replication to a standby site costs clients, measured in one run.

The issue's bar (500 in flight, 1 KiB persistent messages, ratios to the same
client talking to the broker directly, in the same run): async publish
>= 0.70x, sync publish >= 0.60x (and the p50 latency sync adds), consume+ack
>= 0.70x, and the replication lag at half load. This script prints them all.

The set-up is the deployed one: two private sites (``LocalSites``: two
RabbitMQ nodes, two PostgreSQL clusters), ``vpnrepl init`` on both, two VPNs
enabled on site A, and a ``vpnrepl node`` process per site (A active, B its
standby over the bridge). Site A's broker has the vhosts

* ``orders`` — enabled ``--role active`` (async mode), every queue in scope;
* ``orders-sync`` — enabled ``--role active --mode sync`` with the same scope;
* ``orders-exposed`` — like ``orders`` but enabled ``--expose-id``: the
  listener leaves the replication id header in the messages it delivers
  instead of cutting it out, so its consume+ack beside ``orders``'s, round by
  round, is what hiding the header costs consumers.

The sync mode is measured on its own VPN rather than by switching
``orders`` with ``vpnrepl vpn enable orders --mode sync``: the node reads
settings every 30 s, so switching per round would need 30 s waits or a node
restart (and a standby reconnect) between every pair of runs. With two VPNs
the three publish targets interleave in every round on one set of
processes. Each vhost has one durable queue, ``bench.bridge``.

Every round runs, in an order rotated per round so no target always follows
the same one:

* **publish** (lean confirm-window publisher from ``_common``: ``--inflight``
  unconfirmed, ``--size``-byte persistent messages): direct to A's broker
  (vhost ``orders``), through A's listener to ``orders`` (async), through
  the listener to ``orders-sync`` (sync); rate = messages / (first publish to
  last confirm);
* **consume+ack** right after each publish, draining the queue it filled
  (lean consumer: ``basic.qos`` ``--prefetch``, one ``basic.consume``, one
  ``basic.ack`` per message unless ``--ack-every N``); rate = messages /
  (``basic.consume`` to the answer of a passive declare sent after the last
  ack). Through the listener every ack becomes a ledger event that is
  mirrored to the standby. The listener does not hold acks back, so their
  events may still be queued in the ledger writer (up to its 10,000-event
  buffer) when the consumer finishes; the rate counted until A's ledger held
  them all is printed as well — with runs longer than the buffer
  (``--messages 30000``) the consumer itself is held to about that rate.

After every run the script waits until the standby has applied everything
(it reads A's ``vpn_state.ledger_index`` and B's ``applied_index``), and A
its own live state (``vpn_live_state.live_index``: A applies it after the
ledger commit that releases confirms), and
checks the ledger grew by exactly one event per replicated publish or ack
and one for the client's queue declare (a topology change; none for direct
runs), so no run starts with the previous one's replication
work in the background; how long after the run's end A's ledger held every
event and the standby had applied them is printed ("after end"). CPU per
message of node A, node B, RabbitMQ A and each PostgreSQL (tree of
processes) counts from the run's start to that point.

Sync runs are checked to be sync: at the last confirm the standby must have
applied every confirmed publish, and node A must not have logged a sync
timeout (``degrade`` would confirm without the standby).

The sync VPN is enabled with ``--sync-timeout-ms 600000`` (``--sync-timeout-ms``
here), not the default 2000: ``SyncGate.acked`` leaves the deadlines of
acknowledged entries in the deadline heap, and ``SyncGate.expire`` takes any
passed deadline as a timeout, so under continuous sync traffic a ``degrade``
VPN goes sync-ineligible every timeout period even when the standby
acknowledges within milliseconds, and then confirms without the standby until
it catches up — sync figures would be flattered. With the long timeout no
stale deadline falls due during a default run; pass ``--sync-timeout-ms
2000`` to see the effect (the round lines then say ``DEGRADED``).

After the rounds:

* **unloaded latency**: ``--probe`` messages with 1 in flight per publish
  target; the sync-minus-async p50 is the latency sync adds per message,
  beside the same difference at 500 in flight (which is mostly queueing:
  latency ~ window / rate);
* **replication lag at half load**: publishes to ``orders`` paced at
  ``--lag-load`` (default 50%) of the async median rate for ``--lag-seconds``,
  while a thread polls B's ``vpn_state.applied_index`` every ``--poll-ms``.
  With one publisher and no other traffic, delivery tag ``t`` is ledger
  index ``base + t``; its lag is the time from the client's confirm of ``t``
  to the first poll that saw B's applied index reach ``base + t`` (each
  poll stamped at the middle of its query). Figures are late by at most one
  poll interval plus half a query. A negative value means the standby had
  applied the entry before the client saw its confirm (the broker's confirm
  can come after the ledger commit; on a loaded machine this process can
  also be scheduled late).

Run from the repository root: ``.venv/bin/python bench/bridge.py``.
``--py-spy DIR`` then samples node A and node B with py-spy during one extra
async publish, async consume and sync publish (after the measured rounds, so
the numbers above are not perturbed) and prints their top functions.
Everything started (nodes, brokers, databases, py-spy) is stopped on exit,
Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import quote

import psycopg
import uvloop
from _common import (
    BenchError,
    ConsumeResult,
    LeanConsumer,
    LeanPublisher,
    RunResult,
    add_publisher_options,
    beam_pid,
    process_cpu,
    start_py_spy,
    summarise_py_spy,
    tree_cpu,
    vpnrepl,
)

from plugin.devtools import HarnessError, LocalNode, LocalSites

QUEUE = "bench.bridge"
VPN, SYNC_VPN, EXPOSED_VPN = "orders", "orders-sync", "orders-exposed"
TARGETS = ("direct", "async", "sync", "exposed")
VHOSTS = {"direct": VPN, "async": VPN, "sync": SYNC_VPN, "exposed": EXPOSED_VPN}
PUBLISH_LABELS = {
    "direct": "publish direct",
    "async": "publish async VPN",
    "sync": "publish sync VPN",
    "exposed": "publish async, id kept",
}
CONSUME_LABELS = {
    "direct": "consume+ack direct",
    "async": "consume+ack async VPN",
    "sync": "consume+ack sync VPN",
    "exposed": "consume+ack async, id kept",
}
#: the issue's bars, as a fraction of the direct rate
PUBLISH_BARS = {"async": 0.70, "sync": 0.60}
CONSUME_BAR = 0.70
#: what node A logs when a sync VPN's timeout confirms without the standby
DEGRADED = "confirming without it"
#: processes whose CPU is accounted per message
CPU_KEYS = ("node_a", "node_b", "rabbit_a", "pg_a", "pg_b")
#: the 1-in-flight probe runs in this many interleaved chunks per target
PROBE_CHUNKS = 5


# ---------------------------------------------------------------- processes


class Deployment:
    """Two sites, their nodes, and the database reads the benchmark needs."""

    def __init__(self, sync_timeout_ms: int) -> None:
        self.sync_timeout_ms = sync_timeout_ms
        self.sites = LocalSites()
        self.a, self.b = self.sites.a, self.sites.b
        self.nodes: dict[str, LocalNode] = {}
        self.db_a: psycopg.Connection[Any] | None = None
        self.db_b: psycopg.Connection[Any] | None = None

    def start(self) -> None:
        t0 = time.monotonic()
        self.sites.start()
        print(f"two RabbitMQ nodes + two PostgreSQL clusters up in {time.monotonic() - t0:.0f} s")
        rabbit = self.a.rabbit
        for vhost in (VPN, SYNC_VPN, EXPOSED_VPN):
            rabbit.add_vhost(vhost)
            rabbit.api("PUT", f"queues/{quote(vhost, safe='')}/{QUEUE}", {"durable": True})
        base = self.sites.base
        cfg_a = self.a.write_config(base / "a.toml", peer=self.b, dial=False)
        cfg_b = self.b.write_config(base / "b.toml", peer=self.a)
        vpnrepl(cfg_a, "init")
        vpnrepl(cfg_a, "vpn", "enable", VPN, "--role", "active")
        vpnrepl(
            cfg_a,
            *("vpn", "enable", SYNC_VPN, "--role", "active", "--mode", "sync"),
            *("--sync-timeout-ms", str(self.sync_timeout_ms)),
        )
        vpnrepl(cfg_a, "vpn", "enable", EXPOSED_VPN, "--role", "active", "--expose-id")
        vpnrepl(cfg_b, "init")
        t0 = time.monotonic()
        self.nodes["a"] = LocalNode(self.a, cfg_a, base / "node-a.log", name="a")
        self.nodes["b"] = LocalNode(self.b, cfg_b, base / "node-b.log", name="b")
        self.nodes["a"].start()
        self.nodes["b"].start()
        self.db_a = psycopg.connect(self.a.pg.dsn(), autocommit=True)
        self.db_b = psycopg.connect(self.b.pg.dsn(), autocommit=True)
        self._wait_connected()
        print(
            f"nodes up, standby connected in {time.monotonic() - t0:.1f} s "
            f"(node A pid {self.nodes['a'].pid}, node B pid {self.nodes['b'].pid}); "
            f"VPNs {VPN} (async), {SYNC_VPN} (sync, timeout {self.sync_timeout_ms} ms), "
            f"{EXPOSED_VPN} (async, --expose-id)"
        )

    def _wait_connected(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        assert self.db_b is not None
        while True:
            rows = self.db_b.execute(
                "SELECT c.name, c.role, s.bridge_state FROM vpn_config c"
                " JOIN vpn_state s ON s.vpn = c.name WHERE c.enabled"
            ).fetchall()
            ready = {r[0] for r in rows if r[1] == "standby" and r[2] == "connected"}
            if ready >= {VPN, SYNC_VPN, EXPOSED_VPN}:
                return
            self.check_nodes()
            if time.monotonic() > deadline:
                raise BenchError(f"standby not connected in {timeout:.0f} s: {rows}")
            time.sleep(0.2)

    def check_nodes(self) -> None:
        for node in self.nodes.values():
            if not node.alive():
                raise BenchError(f"node {node.name} died:\n{node.tail()}")

    # replication progress ---------------------------------------------------

    def ledger_index(self, vpn: str) -> int:
        assert self.db_a is not None
        row = self.db_a.execute(
            "SELECT ledger_index FROM vpn_state WHERE vpn = %s", (vpn,)
        ).fetchone()
        return int(row[0]) if row else 0

    def live_index(self, vpn: str) -> int:
        """How far A's live state (applied after the ledger commit) reached."""
        assert self.db_a is not None
        row = self.db_a.execute(
            "SELECT live_index FROM vpn_live_state WHERE vpn = %s", (vpn,)
        ).fetchone()
        return int(row[0]) if row else 0

    def applied_index(self, vpn: str) -> int:
        assert self.db_b is not None
        row = self.db_b.execute(
            "SELECT applied_index FROM vpn_state WHERE vpn = %s", (vpn,)
        ).fetchone()
        return int(row[0]) if row else 0

    def wait_applied(self, vpn: str, expected: int, timeout: float = 180.0) -> tuple[float, float]:
        """Wait until A's ledger and B's applied index of ``vpn`` reach
        ``expected``; returns the seconds until the ledger did and until the
        standby did (and A's own live state, so no apply work is left for the
        next run). Fails if either goes past it (events the benchmark did
        not cause) or time runs out."""
        t0 = time.perf_counter()
        deadline = t0 + timeout
        ledger_done = None
        while True:
            ledger, applied = self.ledger_index(vpn), self.applied_index(vpn)
            now = time.perf_counter()
            if ledger > expected or applied > expected:
                raise BenchError(
                    f"VPN {vpn}: ledger {ledger}, applied {applied}, expected {expected}"
                )
            if ledger == expected and ledger_done is None:
                ledger_done = now - t0
            if applied == expected and ledger_done is not None:
                if self.live_index(vpn) == expected:
                    return ledger_done, now - t0
            if now > deadline:
                raise BenchError(
                    f"VPN {vpn}: standby not caught up in {timeout:.0f} s "
                    f"(ledger {ledger}, applied {applied}, expected {expected})"
                )
            self.check_nodes()
            time.sleep(0.005)

    def degradations(self) -> int:
        return self.nodes["a"].log_text().count(DEGRADED)

    def cpu(self) -> dict[str, float | None]:
        return {
            "node_a": process_cpu(self.nodes["a"].pid),
            "node_b": process_cpu(self.nodes["b"].pid),
            "rabbit_a": tree_cpu(beam_pid(self.a.rabbit.pidfile)),
            "pg_a": tree_cpu(self.a.pg.postmaster_pid()),
            "pg_b": tree_cpu(self.b.pg.postmaster_pid()),
        }

    def port(self, target: str) -> int:
        return self.a.rabbit.amqp_port if target == "direct" else self.a.amqp_port

    def close(self, logs: Path | None) -> None:
        for name in ("b", "a"):
            node = self.nodes.get(name)
            if node is not None:
                node.stop()
        for db in (self.db_a, self.db_b):
            if db is not None:
                with contextlib.suppress(psycopg.Error):
                    db.close()
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            for node in self.nodes.values():
                with contextlib.suppress(OSError):
                    shutil.copy(node.log, logs / node.log.name)
        self.sites.close()


def cpu_per_message(
    before: dict[str, float | None], after: dict[str, float | None], messages: int
) -> dict[str, float]:
    out = {}
    for key in CPU_KEYS:
        b, a = before.get(key), after.get(key)
        if b is not None and a is not None:
            out[key] = (a - b) / messages * 1e6
    return out


# ---------------------------------------------------------------- runs


@dataclass
class Options:
    messages: int
    rounds: int
    inflight: int
    size: int
    warmup: int
    prefetch: int
    ack_every: int
    probe: int
    lag_seconds: float
    lag_load: float
    poll_ms: float
    sync_timeout_ms: int
    py_spy: Path | None
    profile_messages: int
    logs: Path | None
    check: bool


@dataclass
class Results:
    publish: dict[str, list[RunResult]] = field(default_factory=lambda: {t: [] for t in TARGETS})
    consume: dict[str, list[ConsumeResult]] = field(
        default_factory=lambda: {t: [] for t in TARGETS}
    )
    probe: dict[str, RunResult] = field(default_factory=dict)
    lag: LagResult | None = None


async def publish_run(
    dep: Deployment,
    target: str,
    messages: int,
    inflight: int,
    size: int,
    rate: float = 0.0,
) -> RunResult:
    """One publish run; returns after the standby has applied all of it."""
    vpn = VHOSTS[target]
    # through the listener the client's queue declare is an event too (a
    # topology change), ahead of its publishes: they start after it
    declare = 0 if target == "direct" else 1
    base = dep.ledger_index(vpn) + declare
    expected = base + (0 if target == "direct" else messages)
    degraded = dep.degradations()
    cpu0 = dep.cpu()
    pub: LeanPublisher = await LeanPublisher.connect(dep.port(target), vpn, QUEUE)
    try:
        if await pub.depth():
            raise BenchError(f"{target}: queue {vpn}/{QUEUE} not empty before publishing")
        result = await asyncio.wait_for(
            pub.publish(target, messages, inflight, size, rate), max(120.0, messages / 50)
        )
        behind = expected - dep.applied_index(vpn)
    finally:
        await pub.close()
    ledger_done, caught_up = dep.wait_applied(vpn, expected)
    result.extra.update(cpu_per_message(cpu0, dep.cpu(), messages))
    result.extra.update(behind=behind, ledger_done=ledger_done, caught_up=caught_up, base=base)
    if target == "sync":
        result.extra["degraded"] = dep.degradations() - degraded
    return result


async def consume_run(dep: Deployment, target: str, opts: Options, messages: int) -> ConsumeResult:
    """Drain ``messages`` from the target's queue; returns once replicated."""
    vpn = VHOSTS[target]
    # one event per ack, and one for the client's queue declare (see publish_run)
    expected = dep.ledger_index(vpn) + (0 if target == "direct" else messages + 1)
    cpu0 = dep.cpu()
    con: LeanConsumer = await LeanConsumer.connect(
        dep.port(target), vpn, QUEUE, prefetch=opts.prefetch, ack_every=opts.ack_every
    )
    try:
        queued = await con.depth()
        if queued != messages:
            raise BenchError(f"{target}: {queued} messages in {vpn}/{QUEUE}, {messages} confirmed")
        result = await con.consume(target, messages)
    finally:
        await con.close()
    ledger_done, caught_up = dep.wait_applied(vpn, expected)
    result.extra.update(cpu_per_message(cpu0, dep.cpu(), messages))
    result.extra.update(ledger_done=ledger_done, caught_up=caught_up)
    return result


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


async def rounds(dep: Deployment, opts: Options, results: Results) -> None:
    if opts.warmup:
        for target in TARGETS:
            await publish_run(dep, target, opts.warmup, opts.inflight, opts.size)
            await consume_run(dep, target, opts, opts.warmup)
    for rnd in range(opts.rounds):
        turn = rnd % len(TARGETS)
        order = TARGETS[turn:] + TARGETS[:turn]
        line = []
        for target in order:
            p = await publish_run(dep, target, opts.messages, opts.inflight, opts.size)
            c = await consume_run(dep, target, opts, opts.messages)
            results.publish[target].append(p)
            results.consume[target].append(c)
            flag = " DEGRADED" if p.extra.get("degraded") else ""
            line.append(
                f"{target} pub {p.rate:5.0f}/s p50 {_ms(p.latency(0.5))} ms{flag} "
                f"cons {c.rate:5.0f}/s"
            )
        print(f"round {rnd + 1}: " + " | ".join(line), flush=True)


async def probe_latency(dep: Deployment, opts: Options, results: Results) -> None:
    """``--probe`` messages with one in flight per target: unloaded latency.

    In ``PROBE_CHUNKS`` interleaved chunks per target (the latencies pooled),
    so a burst of load on the machine does not land on one target only."""
    chunk = max(1, opts.probe // PROBE_CHUNKS)
    for _ in range(PROBE_CHUNKS):
        for target in TARGETS:
            r = await publish_run(dep, target, chunk, 1, opts.size)
            await consume_run(dep, target, opts, chunk)
            pooled = results.probe.get(target)
            if pooled is None:
                results.probe[target] = r
            else:
                pooled.latencies += r.latencies
                pooled.messages += r.messages
                pooled.seconds += r.seconds
                pooled.extra["behind"] = max(pooled.extra["behind"], r.extra["behind"])
                if "degraded" in r.extra:
                    pooled.extra["degraded"] += r.extra["degraded"]


# ---------------------------------------------------------------- lag


@dataclass
class LagResult:
    rate: float
    achieved: float
    messages: int
    lags: list[float]
    polls: int
    poll_seconds: float
    caught_up: float
    #: the longest the standby's applied index was seen not to move, s
    poll_gap: float

    def q(self, q: float) -> float:
        ordered = sorted(self.lags)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class AppliedPoller(threading.Thread):
    """Polls B's ``applied_index`` of one VPN; keeps (time, index) whenever it moves.

    The time is the middle of the query (the snapshot it read was taken
    between its start and end), on ``time.perf_counter`` like the publisher's.
    """

    def __init__(self, dsn: str, vpn: str, interval: float) -> None:
        super().__init__(name="applied-poller", daemon=True)
        self.dsn, self.vpn, self.interval = dsn, vpn, interval
        self.samples: list[tuple[float, int]] = []
        self.polls = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self._ready = threading.Event()

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as db:
                query = "SELECT applied_index FROM vpn_state WHERE vpn = %s"
                db.execute(query, (self.vpn,)).fetchone()  # connection and plan warm
                self._ready.set()
                last = -1
                while not self._halt.is_set():
                    t0 = time.perf_counter()
                    row = db.execute(query, (self.vpn,)).fetchone()
                    t1 = time.perf_counter()
                    self.polls += 1
                    index = int(row[0]) if row else 0
                    if index != last:
                        self.samples.append(((t0 + t1) / 2, index))
                        last = index
                    self._halt.wait(self.interval)
        except BaseException as e:  # reported by the caller
            self.error = e
            self._ready.set()

    def begin(self) -> None:
        self.start()
        if not self._ready.wait(30) or self.error is not None:
            raise BenchError(f"applied-index poller did not start: {self.error}")

    def finish(self) -> None:
        self._halt.set()
        self.join(10)
        if self.error is not None:
            raise BenchError(f"applied-index poller failed: {self.error}")


def confirm_to_applied(
    confirmed_at: list[float], base: int, samples: list[tuple[float, int]]
) -> list[float]:
    """Per delivery tag ``t`` (ledger index ``base + t``): the first sample
    time whose applied index reached it, minus ``t``'s confirm time."""
    lags, j = [], 0
    for tag in range(1, len(confirmed_at)):
        needed = base + tag
        while j < len(samples) and samples[j][1] < needed:
            j += 1
        if j == len(samples):
            raise BenchError(f"the poller never saw ledger index {needed} applied")
        lags.append(samples[j][0] - confirmed_at[tag])
    return lags


async def measure_lag(dep: Deployment, opts: Options, async_rate: float) -> LagResult:
    rate = async_rate * opts.lag_load
    messages = max(1, int(rate * opts.lag_seconds))
    assert dep.b.pg is not None
    poller = AppliedPoller(dep.b.pg.dsn(), VPN, opts.poll_ms / 1000)
    poller.begin()
    try:
        result = await publish_run(dep, "async", messages, opts.inflight, opts.size, rate)
    finally:
        poller.finish()
    lags = confirm_to_applied(result.confirmed_at, int(result.extra["base"]), poller.samples)
    await consume_run(dep, "async", opts, messages)  # drain: the next phase starts empty
    return LagResult(
        rate,
        result.rate,
        messages,
        lags,
        poller.polls,
        result.seconds,
        result.extra["caught_up"],
        max((b[0] - a[0] for a, b in itertools.pairwise(poller.samples)), default=0.0),
    )


# ---------------------------------------------------------------- report


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _cpu_cells(runs: list[Any]) -> str:
    cells = []
    for key in CPU_KEYS:
        vals = [r.extra[key] for r in runs if key in r.extra]
        cells.append(f"{_median(vals):7.1f}" if vals else f"{'-':>7}")
    return " ".join(cells)


def table(results: Results, opts: Options) -> None:
    print()
    print(
        f"{'run':<24} {'median/s':>8} {'p50 ms':>7} {'p99 ms':>7}  "
        f"{'nodeA':>7} {'nodeB':>7} {'rmqA':>7} {'pgA':>7} {'pgB':>7}  "
        f"{'after end ms':>14}  runs (msg/s)"
    )
    rows: list[tuple[str, list[Any], bool]] = [
        (PUBLISH_LABELS[t], results.publish[t], True) for t in TARGETS
    ]
    rows += [(CONSUME_LABELS[t], results.consume[t], False) for t in TARGETS]
    for label, runs, is_pub in rows:
        rate = _median([r.rate for r in runs])
        if is_pub:
            p50 = f"{_median([r.latency(0.5) for r in runs]) * 1e3:7.1f}"
            p99 = f"{_median([r.latency(0.99) for r in runs]) * 1e3:7.1f}"
        else:
            p50 = p99 = f"{'-':>7}"
        ledger = _median([r.extra["ledger_done"] for r in runs]) * 1e3
        caught = _median([r.extra["caught_up"] for r in runs]) * 1e3
        rates = " ".join(f"{r.rate:.0f}" for r in runs)
        print(
            f"{label:<24} {rate:>8.0f} {p50} {p99}  {_cpu_cells(runs)}  "
            f"{ledger:>6.0f} {caught:>7.0f}  {rates}"
        )
    ack = "one basic.ack per message" if opts.ack_every == 1 else f"multiple every {opts.ack_every}"
    print(
        f"\n{opts.messages} x {opts.size} B persistent per run, {opts.inflight} in flight, "
        f"{opts.rounds} rounds; consumer prefetch {opts.prefetch}, {ack}.\n"
        "CPU columns: us per message from run start until the standby applied it all "
        "(node = vpnrepl node, rmq = RabbitMQ, pg = PostgreSQL incl. backends); "
        "after end: ms after the run's end until A's ledger held every event, and until "
        "the standby had applied them all."
    )


def _ratio_line(name: str, runs: list[Any], direct: list[Any], bar: float | None) -> bool:
    ratio = _median([r.rate for r in runs]) / _median([d.rate for d in direct])
    # the same round's runs are neighbours in time: their ratios show how much
    # of the spread is the machine, not the replication
    paired = sorted(r.rate / d.rate for r, d in zip(runs, direct, strict=True))
    best = max(r.rate for r in runs) / max(d.rate for d in direct)
    verdict = (
        "no target"
        if bar is None
        else (f"target >= {bar:.2f}: {'ok' if ratio >= bar else 'BELOW TARGET'}")
    )
    print(
        f"{name} = {ratio:.2f}   ({verdict}; per round {paired[0]:.2f}..{paired[-1]:.2f}, "
        f"best rounds {best:.2f})"
    )
    return bar is None or ratio >= bar


#: LedgerWriter's default max_pending: events it queues before the listener
#: stops reading clients
LEDGER_BUFFER = 10_000


def _sustained_consume(con: dict[str, list[ConsumeResult]]) -> None:
    """The consumer's rate counts until the last ack reached the broker; the
    listener does not hold acks, so their ledger events may still be queued
    (up to the writer's ``max_pending`` before it holds the client back).
    Counting until A's ledger held them all shows the rate a long-running
    consumer would settle at."""

    def rate(r: ConsumeResult) -> float:
        return r.messages / (r.seconds + r.extra["ledger_done"])

    direct = _median([rate(r) for r in con["direct"]])
    for target in ("async", "sync"):
        ratio = _median([rate(r) for r in con[target]]) / direct
        print(
            f"consume+ack {target} VPN / direct, until A's ledger held every ack = {ratio:.2f}"
            "   (no target: the rate a sustained consumer would see)"
        )
    if con["async"] and con["async"][0].messages <= LEDGER_BUFFER:
        print(
            f"  note: {con['async'][0].messages} acks fit the ledger writer's "
            f"{LEDGER_BUFFER}-event buffer, so the listener never held the consumer back; "
            "with more (--messages 30000) the consumer runs at about the 'until ledger' rate"
        )


def _sync_checks(results: Results) -> None:
    runs = results.publish["sync"] + ([results.probe["sync"]] if "sync" in results.probe else [])
    degraded = sum(int(r.extra.get("degraded", 0)) for r in runs)
    complete = sum(1 for r in runs if r.extra["behind"] <= 0)
    print(
        f"sync check: the standby had applied every confirmed publish at the last confirm "
        f"in {complete}/{len(runs)} sync runs; sync timeouts (degrade) during them: {degraded}"
    )
    if degraded or complete < len(runs):
        print(
            "WARNING: some sync confirms did not wait for the standby; sync figures are flattered"
        )


def report(results: Results, opts: Options) -> bool:
    table(results, opts)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average at the end: {load} ({os.cpu_count()} CPUs)\n")
    pub, con = results.publish, results.consume
    met = _ratio_line("async publish / direct", pub["async"], pub["direct"], PUBLISH_BARS["async"])
    met &= _ratio_line("sync publish / direct ", pub["sync"], pub["direct"], PUBLISH_BARS["sync"])
    met &= _ratio_line("consume+ack async VPN / direct", con["async"], con["direct"], CONSUME_BAR)
    _ratio_line("consume+ack sync VPN / direct ", con["sync"], con["direct"], None)
    _ratio_line(
        "consume+ack async VPN, id header cut / kept (--expose-id)",
        con["async"],
        con["exposed"],
        None,
    )
    _sustained_consume(con)
    p50 = {t: _median([r.latency(0.5) for r in pub[t]]) * 1e3 for t in TARGETS}
    print(
        f"sync added latency p50, {opts.inflight} in flight: {p50['sync'] - p50['async']:+.1f} ms "
        f"(sync {p50['sync']:.1f} ms, async {p50['async']:.1f} ms, direct {p50['direct']:.1f} ms)"
    )
    if results.probe:
        pr = {t: r.latency(0.5) * 1e3 for t, r in results.probe.items()}
        print(
            f"sync added latency p50, 1 in flight ({results.probe['sync'].messages} msgs each): "
            f"{pr['sync'] - pr['async']:+.2f} ms "
            f"(sync {pr['sync']:.2f} ms, async {pr['async']:.2f} ms, direct {pr['direct']:.2f} ms)"
        )
    _sync_checks(results)
    lag = results.lag
    if lag is not None:
        print(
            f"replication lag at {opts.lag_load:.0%} load ({lag.rate:.0f} msg/s paced, "
            f"achieved {lag.achieved:.0f} msg/s, {lag.messages} msgs "
            f"over {lag.poll_seconds:.1f} s):"
            f" p50 {lag.q(0.5) * 1e3:.1f} ms, p99 {lag.q(0.99) * 1e3:.1f} ms, "
            f"min {min(lag.lags) * 1e3:.1f} ms, max {max(lag.lags) * 1e3:.1f} ms  "
            "(client confirm -> standby applied; "
            f"{lag.polls} polls of B every {opts.poll_ms:g} ms)"
        )
        negative = sum(1 for x in lag.lags if x < 0) / len(lag.lags)
        print(
            f"  lag measurement: {negative:.1%} negative (confirm seen after the standby applied), "
            f"longest the applied index was seen standing still {lag.poll_gap * 1e3:.0f} ms"
        )
    return met


# ---------------------------------------------------------------- profiling


async def profile_phases(dep: Deployment, opts: Options, out: Path) -> None:
    """py-spy on node A and node B during one extra run per phase."""
    n = opts.profile_messages
    phases = (
        ("async-publish", lambda: publish_run(dep, "async", n, opts.inflight, opts.size)),
        ("async-consume", lambda: consume_run(dep, "async", opts, n)),
        ("sync-publish", lambda: publish_run(dep, "sync", n, opts.inflight, opts.size)),
    )
    for name, run in phases:
        spies: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for node in ("a", "b"):
                pid = dep.nodes[node].pid
                assert pid is not None
                spy = start_py_spy(pid, out / f"node-{node}-{name}.txt", nonblocking=True)
                if spy is None:
                    return
                spies[node] = spy
            await asyncio.sleep(1.0)  # py-spy attaches
            t0 = time.perf_counter()
            result = await run()
            seconds = time.perf_counter() - t0
            for spy in spies.values():
                spy.send_signal(signal.SIGINT)
            for spy in spies.values():
                spy.wait(30)
        finally:
            for spy in spies.values():
                if spy.poll() is None:
                    spy.kill()
                    spy.wait(10)
        print(f"\n##### profile: {name}, {result.rate:.0f} msg/s under py-spy")
        for node in ("a", "b"):
            summarise_py_spy(
                out / f"node-{node}-{name}.txt",
                top=20 if node == "a" else 12,
                label=f"node {node.upper()} ({name})",
                seconds=seconds,
            )
    await consume_run(dep, "sync", opts, n)


# ---------------------------------------------------------------- main


async def run_all(dep: Deployment, opts: Options) -> Results:
    results = Results()
    await rounds(dep, opts, results)
    if opts.probe:
        await probe_latency(dep, opts, results)
    if opts.lag_seconds > 0:
        async_rate = _median([r.rate for r in results.publish["async"]])
        results.lag = await measure_lag(dep, opts, async_rate)
    return results


def _sigterm(signum: int, frame: FrameType | None) -> None:
    # as Ctrl-C: asyncio's runner cancels the running phase, then main cleans up
    signal.raise_signal(signal.SIGINT)


def _log_problems(dep: Deployment) -> None:
    for node in dep.nodes.values():
        text = node.log_text()
        errors = sum(1 for line in text.splitlines() if " ERROR " in line)
        if "Traceback" in text or errors:
            print(f"node {node.name} logged {errors} errors; last lines:\n{node.tail()}")


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    # a shell starts background jobs with SIGINT ignored; Ctrl-C/kill -INT must stop us
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _sigterm)
    dep = Deployment(opts.sync_timeout_ms)
    t0 = time.monotonic()
    try:
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"load average before start: {load} ({os.cpu_count()} CPUs)")
        dep.start()
        results = uvloop.run(run_all(dep, opts))
        met = report(results, opts)
        if opts.py_spy is not None:
            opts.py_spy.mkdir(parents=True, exist_ok=True)
            uvloop.run(profile_phases(dep, opts, opts.py_spy))
        _log_problems(dep)
        print(f"\ntotal {time.monotonic() - t0:.0f} s")
        return 0 if met or not opts.check else 1
    except (BenchError, HarnessError) as e:
        print(f"bench/bridge.py: {e}", file=sys.stderr)
        _log_problems(dep)
        return 1
    except KeyboardInterrupt:
        print("bench/bridge.py: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip cleanup
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        dep.close(opts.logs)


def parse_args(argv: list[str] | None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_publisher_options(p, messages=10000)
    p.add_argument("--prefetch", type=int, default=500, help="consumer prefetch (default 500)")
    p.add_argument(
        "--ack-every",
        type=int,
        default=1,
        metavar="N",
        help="1: one basic.ack per message (default); N: multiple=true every N messages",
    )
    p.add_argument("--probe", type=int, default=300, help="1-in-flight latency probe messages")
    p.add_argument("--lag-seconds", type=float, default=10.0, help="lag phase length (0: skip)")
    p.add_argument("--lag-load", type=float, default=0.5, help="lag phase rate / async median")
    p.add_argument("--poll-ms", type=float, default=2.0, help="standby poll interval (lag)")
    p.add_argument(
        "--sync-timeout-ms",
        type=int,
        default=600_000,
        metavar="N",
        help="the sync VPN's --sync-timeout-ms (default 600000; see the module docstring)",
    )
    p.add_argument("--py-spy", type=Path, metavar="DIR", help="profile the nodes after the run")
    p.add_argument(
        "--profile-messages", type=int, default=30000, help="per profiled run (default 30000)"
    )
    p.add_argument("--logs", type=Path, metavar="DIR", help="copy the node logs here at exit")
    p.add_argument("--check", action="store_true", help="exit 1 when a ratio is below target")
    a = p.parse_args(argv)
    if min(a.messages, a.rounds, a.inflight, a.size, a.prefetch, a.ack_every) < 1:
        p.error("--messages, --rounds, --inflight, --size, --prefetch, --ack-every must be >= 1")
    if a.ack_every > a.prefetch // 2 and a.ack_every > 1:
        p.error("--ack-every must be at most half of --prefetch (or the consumer stalls)")
    if a.warmup < 0 or a.probe < 0 or a.lag_seconds < 0 or not 0 < a.lag_load <= 1:
        p.error("--warmup, --probe, --lag-seconds must be >= 0 and --lag-load in (0, 1]")
    return Options(
        a.messages,
        a.rounds,
        a.inflight,
        a.size,
        a.warmup,
        a.prefetch,
        a.ack_every,
        a.probe,
        a.lag_seconds,
        a.lag_load,
        a.poll_ms,
        a.sync_timeout_ms,
        a.py_spy,
        a.profile_messages,
        a.logs,
        a.check,
    )


if __name__ == "__main__":
    sys.exit(main())
