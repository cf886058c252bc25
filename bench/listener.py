"""What the listener costs a confirm-window publisher, measured in one run.

The issue's bar: a lean publisher (``--inflight`` unconfirmed, ``--size``-byte
persistent messages) through the listener reaches at least 0.90x the direct
rate on a VPN that is not replicated, and at least 0.80x on a replicated VPN
whose sink reports every event durable at once. This script prints both ratios.

Why it is built the way it is:

* **The publisher is lean** — raw asyncio protocol, frames encoded once with
  pamqp, acks decoded with ``struct`` — so the proxy's cost is not hidden
  behind client overhead (pika costs more per message than the listener).
* **One private RabbitMQ node** (``plugin._localsites``) serves all three
  targets, so they see the same broker; each target has its own vhost (its own
  message store) and queue, purged before and after every run, so each run
  starts from an empty queue on an otherwise idle broker.
* **The listener runs in its own process** (uvloop unless ``--listener-loop
  asyncio``), as deployed, so it does not share the publisher's GIL. It serves
  both listener targets: a vhost absent from its directory (not replicated)
  and a vhost enabled active with every queue in scope, whose sink discards
  events (``MemorySink`` would hold every body) but reports them durable.
* **Runs are interleaved** (direct, non-replicated, replicated per round) and
  medians compared, so drift of the machine or the broker hits every target.
  On a shared machine the rates still swing; the per-round and best-round
  ratios printed beside the headline, and the CPU time per message of the
  listener and of RabbitMQ, show how far to trust a headline ratio.
* **Confirms are checked, not just counted**: a nack, an ack for a tag never
  published or one released twice fails the run; after each listener run the
  sink's event count must match (N for the replicated target, 0 otherwise).

Run from the repository root: ``.venv/bin/python bench/listener.py``.
``--profile PREFIX`` writes a cProfile of the listener process per listener
target (``PREFIX.plain``, ``PREFIX.replicated``) and prints its top functions;
``--py-spy FILE`` samples the listener with py-spy (if installed) instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import multiprocessing
import os
import pstats
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import quote

import uvloop
from pamqp import base, body, commands, frame, header

from plugin._directory import VpnDirectory, VpnView
from plugin._events import Event, IdSource, LocalTransaction, Published, ReplicationSink
from plugin._listener import BrokerAddress, Listener
from plugin._localsites import LocalSites, RabbitNode
from plugin._topology import ReplicationScope, Topology
from plugin._vpn import Role

QUEUE = "bench.listener"
TARGETS = ("direct", "plain", "replicated")
VHOSTS = {"direct": "bench-direct", "plain": "bench-plain", "replicated": "bench-replicated"}
LABELS = {
    "direct": "direct",
    "plain": "non-replicated",
    "replicated": "replicated (in-memory sink)",
}
#: the issue's bars, as a fraction of the direct rate
BARS = {"plain": 0.90, "replicated": 0.80}

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
_FRAME_HEAD = struct.Struct(">BHI")
_ACK = struct.Struct(">HHQB")  # class, method, delivery tag, bits
_ACK_FRAME_SIZE = 7 + _ACK.size + 1


class BenchError(Exception):
    """The benchmark cannot produce a trustworthy number."""


# ---------------------------------------------------------------- publisher


@dataclass(slots=True)
class RunResult:
    target: str
    messages: int
    seconds: float
    latencies: list[float]
    #: this (publisher) process's CPU time per message, µs
    publisher_us: float
    #: listener process CPU time per message, µs (None for direct runs)
    listener_us: float | None = None
    #: RabbitMQ's CPU time per message, µs (None where /proc is not there)
    broker_us: float | None = None

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    def latency(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class LeanPublisher(asyncio.Protocol):
    """One AMQP connection and one confirm channel, driven by hand.

    Control methods are decoded with pamqp and handed to :meth:`rpc`; during
    the publish phase, ``basic.ack`` frames are decoded with ``struct`` in
    ``data_received`` and refill the window in the same callback.
    """

    CHANNEL = 1

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.frame_max = 131072
        self._buf = bytearray()
        self._replies: asyncio.Queue[base.Frame | BaseException] = asyncio.Queue()
        self._lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # publish phase
        self._message = b""
        self._total = 0
        self._next_tag = 1
        self._low = 1  # lowest unconfirmed tag
        self._confirmed = 0
        self._acked = bytearray()
        self._sent_at: list[float] = []
        self.latencies: list[float] = []
        self._done: asyncio.Future[float] | None = None

    @classmethod
    async def connect(cls, port: int, vhost: str) -> LeanPublisher:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(cls, "127.0.0.1", port)
        await proto._handshake(vhost)
        return proto

    # asyncio callbacks ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        err = BenchError(f"connection lost: {exc or 'closed by peer'}")
        self._fail(err)
        if not self._lost.done():
            self._lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, n, refill = 0, len(buf), 0
        try:
            while n - pos >= 7:
                ftype, channel, size = _FRAME_HEAD.unpack_from(buf, pos)
                end = pos + 8 + size
                if end > n:
                    break
                if buf[end - 1] != 0xCE:
                    raise BenchError(f"bad frame end {buf[end - 1]:#x}")
                refill += self._frame(buf, ftype, channel, pos, end)
                pos = end
        except BenchError as e:
            self._fail(e)
            if self.transport is not None:
                self.transport.abort()
            return
        del buf[:pos]
        if refill:
            self._send(refill)

    def _frame(self, buf: bytearray, ftype: int, channel: int, pos: int, end: int) -> int:
        """Handle one whole frame; returns how many publishes it confirmed."""
        if ftype == 8:
            return 0  # heartbeat
        if ftype != 1:
            raise BenchError(f"unexpected frame type {ftype} on channel {channel}")
        if end - pos == _ACK_FRAME_SIZE:
            cls_id, meth_id, tag, bits = _ACK.unpack_from(buf, pos + 7)
            if cls_id == 60 and meth_id == 80:
                return self._on_ack(tag, bool(bits & 1))
            if cls_id == 60 and meth_id == 120:
                raise BenchError(f"broker nacked delivery tag {tag}")
        _, _, method = frame.unmarshal(bytes(buf[pos:end]))
        if not isinstance(method, base.Frame):
            raise BenchError(f"undecodable method frame on channel {channel}")
        self._control(method)
        return 0

    # control ------------------------------------------------------------------

    def _control(self, method: base.Frame) -> None:
        if isinstance(method, commands.Connection.Close | commands.Channel.Close):
            raise BenchError(f"{method.name}: {method.reply_code} {method.reply_text}")
        self._replies.put_nowait(method)

    def _fail(self, err: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(err)
        self._replies.put_nowait(err)

    def _write(self, method: base.Frame, channel: int = 0) -> None:
        assert self.transport is not None
        self.transport.write(frame.marshal(method, channel))

    async def rpc(
        self, method: base.Frame | None, reply: type[base.Frame], channel: int = 0
    ) -> Any:
        if method is not None:
            self._write(method, channel)
        got = await asyncio.wait_for(self._replies.get(), 30)
        if isinstance(got, BaseException):
            raise got
        if not isinstance(got, reply):
            raise BenchError(f"expected {reply.__name__}, got {got.name}")
        return got

    async def _handshake(self, vhost: str) -> None:
        assert self.transport is not None
        self.transport.write(PROTOCOL_HEADER)
        await self.rpc(None, commands.Connection.Start)
        start_ok = commands.Connection.StartOk(
            client_properties={
                "product": "vpnrepl bench",
                "capabilities": {"publisher_confirms": True, "connection.blocked": True},
            },
            mechanism="PLAIN",
            response="\0guest\0guest",
        )
        tune = await self.rpc(start_ok, commands.Connection.Tune)
        self.frame_max = tune.frame_max or 131072
        self._write(commands.Connection.TuneOk(tune.channel_max, self.frame_max, 0))
        await self.rpc(commands.Connection.Open(virtual_host=vhost), commands.Connection.OpenOk)
        ch = self.CHANNEL
        await self.rpc(commands.Channel.Open(), commands.Channel.OpenOk, ch)
        await self.rpc(commands.Confirm.Select(), commands.Confirm.SelectOk, ch)
        await self.rpc(
            commands.Queue.Declare(queue=QUEUE, durable=True), commands.Queue.DeclareOk, ch
        )

    async def purge(self) -> int:
        ok = await self.rpc(commands.Queue.Purge(queue=QUEUE), commands.Queue.PurgeOk, self.CHANNEL)
        return int(ok.message_count)

    async def close(self) -> None:
        with contextlib.suppress(BenchError, TimeoutError):
            await self.rpc(commands.Connection.Close(200, "bye", 0, 0), commands.Connection.CloseOk)
        if self.transport is not None:
            self.transport.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._lost), 5)

    # publish phase ------------------------------------------------------------

    async def publish(self, target: str, messages: int, inflight: int, size: int) -> RunResult:
        """Publish ``messages`` keeping ``inflight`` unconfirmed; time first
        publish to last confirm."""
        self._message = encode_message(self.CHANNEL, size, self.frame_max)
        self._total = messages
        self._next_tag, self._low, self._confirmed = 1, 1, 0
        self._acked = bytearray(messages + 2)
        self._sent_at = [0.0] * (messages + 1)
        self.latencies = []
        self._done = asyncio.get_running_loop().create_future()
        cpu0, t0 = time.process_time(), time.perf_counter()
        self._send(min(inflight, messages))
        t1 = await self._done
        cpu_us = (time.process_time() - cpu0) / messages * 1e6
        return RunResult(target, messages, t1 - t0, self.latencies, cpu_us)

    def _send(self, count: int) -> None:
        count = min(count, self._total - self._next_tag + 1)
        if count <= 0:
            return
        assert self.transport is not None
        now = time.perf_counter()
        first = self._next_tag
        self._next_tag += count
        sent_at = self._sent_at
        for tag in range(first, first + count):
            sent_at[tag] = now
        self.transport.write(self._message * count)

    def _on_ack(self, tag: int, multiple: bool) -> int:
        """Record one broker ack; return how many tags it newly confirmed."""
        if not 1 <= tag < self._next_tag:
            raise BenchError(f"ack for delivery tag {tag}, never published")
        now = time.perf_counter()
        acked, sent_at, latencies = self._acked, self._sent_at, self.latencies
        newly = 0
        if multiple:
            for t in range(self._low, tag + 1):
                if not acked[t]:
                    acked[t] = 1
                    latencies.append(now - sent_at[t])
                    newly += 1
            if not newly:
                raise BenchError(f"multiple ack up to {tag} confirms nothing new")
        else:
            if acked[tag]:
                raise BenchError(f"delivery tag {tag} confirmed twice")
            acked[tag] = 1
            latencies.append(now - sent_at[tag])
            newly = 1
        low = self._low
        while acked[low]:
            low += 1
        self._low = low
        self._confirmed += newly
        if self._confirmed == self._total and self._done is not None and not self._done.done():
            self._done.set_result(now)
        return newly


def encode_message(channel: int, size: int, frame_max: int) -> bytes:
    """basic.publish + content header (delivery-mode 2) + body frames."""
    properties = commands.Basic.Properties(delivery_mode=2, content_type="application/octet-stream")
    payload = os.urandom(size)
    step = frame_max - 8
    return b"".join(
        [
            frame.marshal(commands.Basic.Publish(exchange="", routing_key=QUEUE), channel),
            frame.marshal(header.ContentHeader(0, size, properties), channel),
            *(
                frame.marshal(body.ContentBody(payload[i : i + step]), channel)
                for i in range(0, size, step)
            ),
        ]
    )


# ---------------------------------------------------------------- listener process


class DiscardingSink(ReplicationSink):
    """Counts events, keeps none, reports each durable at once."""

    def __init__(self) -> None:
        self.published = 0
        self.consumed = 0

    def append(self, event: Event, on_durable: Callable[[bool], None] | None) -> None:
        if isinstance(event, Published):
            self.published += 1
        else:
            self.consumed += 1
        if on_durable is not None:
            on_durable(True)

    async def prepare(self, txn: LocalTransaction) -> None:
        return None

    async def commit(self, txn: LocalTransaction) -> None:
        return None

    async def abort(self, txn: LocalTransaction) -> None:
        return None


def _listener_process(
    conn: Connection,
    broker_port: int,
    replicated: dict[str, Any],
    loop_kind: str,
    profile: Path | None,
) -> None:
    """Entry point of the listener process: serve until told to stop.

    Commands on ``conn``: ``("stats",)``, ``("profile", target, on)``, ``("stop",)``.
    cProfile output goes to ``{profile}.{target}`` when the process stops.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us in order
    loop = uvloop.new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    errors: list[str] = []
    loop.set_exception_handler(lambda _, ctx: errors.append(str(ctx.get("message"))))
    directory = VpnDirectory()
    for vhost, definitions in replicated.items():
        directory.put(
            VpnView(
                vhost,
                Role.ACTIVE,
                ReplicationScope(),
                Topology.from_definitions(vhost, definitions),
            )
        )
    sink = DiscardingSink()
    listener = Listener(
        BrokerAddress("127.0.0.1", broker_port), directory, IdSource(os.getpid()), sink
    )
    loop.run_until_complete(listener.start("127.0.0.1", 0))
    profiles: dict[str, cProfile.Profile] = {}
    stopped = loop.create_future()

    def command() -> None:
        try:
            cmd = conn.recv()
        except EOFError:
            cmd = ("stop",)
        if cmd[0] == "stats":
            conn.send(
                {
                    "published": sink.published,
                    "consumed": sink.consumed,
                    "errors": errors,
                    "cpu": time.process_time(),
                }
            )
        elif cmd[0] == "profile":
            prof = profiles.setdefault(cmd[1], cProfile.Profile())
            if cmd[2]:
                prof.enable()
            else:
                prof.disable()
            conn.send("ok")
        elif not stopped.done():
            stopped.set_result(None)

    loop.add_reader(conn.fileno(), command)
    conn.send(("ready", listener.port, os.getpid()))
    loop.run_until_complete(stopped)
    loop.remove_reader(conn.fileno())
    loop.run_until_complete(listener.close())
    loop.close()
    written = []
    for target, prof in profiles.items():
        path = Path(f"{profile}.{target}")
        prof.dump_stats(path)
        written.append(path)
    conn.send(written)


class ListenerProcess:
    """The parent's handle on the listener process."""

    def __init__(
        self,
        broker_port: int,
        replicated: dict[str, Any],
        loop_kind: str,
        profile: Path | None = None,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_listener_process,
            args=(child, broker_port, replicated, loop_kind, profile),
            name="vpnrepl-bench-listener",
            daemon=True,
        )
        self.process.start()
        child.close()
        if not self._conn.poll(60):
            raise BenchError("the listener process did not start within 60 s")
        _, self.port, self.pid = self._conn.recv()

    def ask(self, *cmd: Any) -> Any:
        self._conn.send(cmd)
        if not self._conn.poll(30):
            raise BenchError(f"the listener process did not answer {cmd[0]!r}")
        return self._conn.recv()

    def stop(self) -> list[Path]:
        """Stop in order; returns the cProfile files written."""
        written: list[Path] = []
        if self.process.is_alive():
            try:
                written = self.ask("stop")
            except (BenchError, OSError, EOFError):
                pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
        return written


# ---------------------------------------------------------------- the run


@dataclass
class Options:
    messages: int
    rounds: int
    inflight: int
    size: int
    warmup: int
    targets: tuple[str, ...]
    listener_loop: str
    profile: Path | None
    py_spy: Path | None
    check: bool
    broker_pid: int | None = None


def process_cpu(pid: int | None) -> float | None:
    """User + system CPU seconds of ``pid`` so far (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_run(
    target: str, port: int, opts: Options, messages: int, listener: ListenerProcess | None
) -> RunResult:
    before = listener.ask("stats") if listener is not None else None
    pub = await LeanPublisher.connect(port, VHOSTS[target])
    try:
        await pub.purge()
        if listener is not None and opts.profile is not None:
            listener.ask("profile", target, True)
        try:
            broker0 = process_cpu(opts.broker_pid)
            result = await pub.publish(target, messages, opts.inflight, opts.size)
            broker1 = process_cpu(opts.broker_pid)
            if broker0 is not None and broker1 is not None:
                result.broker_us = (broker1 - broker0) / messages * 1e6
        finally:
            if listener is not None and opts.profile is not None:
                listener.ask("profile", target, False)
        # empty again, so the next run (another vhost) shares the broker with
        # no backlog; every confirmed message must be there
        queued = await pub.purge()
        if queued != messages:
            raise BenchError(f"{target}: {queued} messages in the queue, {messages} confirmed")
    finally:
        await pub.close()
    if listener is not None and before is not None:
        after = listener.ask("stats")
        if after["errors"]:
            raise BenchError(f"listener loop errors: {after['errors']}")
        replicated = after["published"] - before["published"]
        expected = messages if target == "replicated" else 0
        if replicated != expected:
            raise BenchError(f"{target}: sink saw {replicated} publishes, expected {expected}")
        result.listener_us = (after["cpu"] - before["cpu"]) / messages * 1e6
    return result


async def run_all(
    opts: Options, broker_port: int, listener: ListenerProcess | None
) -> dict[str, list[RunResult]]:
    ports = {"direct": broker_port}
    if listener is not None:
        ports.update(plain=listener.port, replicated=listener.port)
    results: dict[str, list[RunResult]] = {t: [] for t in opts.targets}
    if opts.warmup:
        for target in opts.targets:
            await one_run(target, ports[target], opts, opts.warmup, None)
    for rnd in range(1, opts.rounds + 1):
        line = []
        for target in opts.targets:
            lt = listener if target != "direct" else None
            r = await one_run(target, ports[target], opts, opts.messages, lt)
            results[target].append(r)
            cpu = f" cpu {r.listener_us:4.1f} us/msg" if r.listener_us is not None else ""
            line.append(f"{target} {r.rate:6.0f} msg/s p50 {r.latency(0.5) * 1e3:5.1f} ms{cpu}")
        print(f"round {rnd}: " + " | ".join(line), flush=True)
    return results


def report(results: dict[str, list[RunResult]], opts: Options) -> bool:
    print()
    print(
        f"{'target':<28} {'median msg/s':>12} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'listener cpu':>12} {'broker cpu':>10} {'publisher':>9}  runs (msg/s)"
    )
    medians: dict[str, float] = {}
    for target, runs in results.items():
        medians[target] = statistics.median(r.rate for r in runs)
        lat50 = statistics.median(r.latency(0.5) for r in runs) * 1e3
        lat99 = statistics.median(r.latency(0.99) for r in runs) * 1e3
        rates = " ".join(f"{r.rate:.0f}" for r in runs)
        cpus = [r.listener_us for r in runs if r.listener_us is not None]
        cpu = f"{statistics.median(cpus):.1f} us/msg" if cpus else "-"
        pub = f"{statistics.median(r.publisher_us for r in runs):.1f} us"
        brokers = [r.broker_us for r in runs if r.broker_us is not None]
        broker = f"{statistics.median(brokers):.1f} us" if brokers else "-"
        print(
            f"{LABELS[target]:<28} {medians[target]:>12.0f} {lat50:>7.1f} {lat99:>7.1f} "
            f"{cpu:>12} {broker:>10} {pub:>9}  {rates}"
        )
    print(
        f"\n{opts.messages} x {opts.size} B persistent, {opts.inflight} in flight, "
        f"{opts.rounds} rounds, listener loop: {opts.listener_loop}"
    )
    met = True
    if "direct" in medians:
        for target, bar in BARS.items():
            if target in medians:
                ratio = medians[target] / medians["direct"]
                verdict = "ok" if ratio >= bar else "BELOW TARGET"
                met = met and ratio >= bar
                # the same round's runs are neighbours in time: their ratios
                # show how much of the spread is the machine, not the listener
                paired = sorted(
                    r.rate / d.rate for r, d in zip(results[target], results["direct"], strict=True)
                )
                best = max(r.rate for r in results[target]) / max(r.rate for r in results["direct"])
                print(
                    f"{LABELS[target]} / direct = {ratio:.2f}   (target >= {bar:.2f}: {verdict}; "
                    f"per round {paired[0]:.2f}..{paired[-1]:.2f}, best rounds {best:.2f})"
                )
    return met


def print_profiles(paths: list[Path], top: int = 25) -> None:
    for path in paths:
        print(f"\n=== listener cProfile ({path}) — top {top} by own time ===")
        pstats.Stats(str(path)).sort_stats("tottime").print_stats(top)


_LINE = re.compile(r":\d+\)$")


def summarise_py_spy(raw: Path, top: int = 25) -> None:
    """Own and inclusive time per function from py-spy's collapsed stacks."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = [_LINE.sub(")", f) for f in stack.split(";")]
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    if not total:
        print("py-spy recorded no samples")
        return
    print(f"\n=== listener py-spy ({raw}), {total} samples — own time ===")
    for name, n in own.most_common(top):
        print(f"{100 * n / total:6.1f}%  {name}")
    print("=== inclusive time (frames in every sample left out) ===")
    for name, n in [(k, v) for k, v in inclusive.most_common() if v < total][:top]:
        print(f"{100 * n / total:6.1f}%  {name}")


def start_py_spy(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        print("py-spy not found (pip install py-spy); profiling skipped", file=sys.stderr)
        return None
    return subprocess.Popen(
        [
            exe,
            "record",
            "--pid",
            str(pid),
            "--rate",
            "200",
            "--format",
            "raw",
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def prepare_broker(rabbit: RabbitNode) -> dict[str, Any]:
    for vhost in VHOSTS.values():
        rabbit.add_vhost(vhost)
        rabbit.api("PUT", f"queues/{quote(vhost, safe='')}/{QUEUE}", {"durable": True})
    vhost = VHOSTS["replicated"]
    return {vhost: rabbit.api("GET", f"definitions/{quote(vhost, safe='')}")}


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    sites = LocalSites()
    listener: ListenerProcess | None = None
    spy: subprocess.Popen[bytes] | None = None
    try:
        rabbit = sites.a.rabbit
        t0 = time.monotonic()
        rabbit.launch()
        rabbit.wait_ready()
        replicated = prepare_broker(rabbit)
        with contextlib.suppress(OSError, ValueError):
            opts.broker_pid = int(rabbit.pidfile.read_text().split()[0])
        print(
            f"RabbitMQ {rabbit.nodename} on port {rabbit.amqp_port} ({time.monotonic() - t0:.0f} s)"
        )
        if set(opts.targets) - {"direct"}:
            listener = ListenerProcess(
                rabbit.amqp_port, replicated, opts.listener_loop, opts.profile
            )
            print(f"listener pid {listener.pid} on port {listener.port} ({opts.listener_loop})")
            if opts.py_spy is not None:
                spy = start_py_spy(listener.pid, opts.py_spy)
        results = uvloop.run(run_all(opts, rabbit.amqp_port, listener))
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
            spy = None
            assert opts.py_spy is not None
            summarise_py_spy(opts.py_spy)
        met = report(results, opts)
        if listener is not None:
            written, listener = listener.stop(), None
            print_profiles(written)
        return 0 if met or not opts.check else 1
    except BenchError as e:
        print(f"bench/listener.py: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench/listener.py: interrupted", file=sys.stderr)
        return 130
    finally:
        if spy is not None:
            spy.kill()
        if listener is not None:
            listener.stop()
        sites.close()


def parse_args(argv: list[str] | None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20000, help="per run (default 20000)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--inflight", type=int, default=500, help="unconfirmed publishes (default 500)")
    p.add_argument("--size", type=int, default=1024, help="body bytes (default 1024)")
    p.add_argument("--warmup", type=int, default=2000, help="messages per target before round 1")
    p.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help="comma-separated subset of direct,plain,replicated (default all)",
    )
    p.add_argument("--listener-loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--profile", type=Path, metavar="PREFIX", help="cProfile the listener")
    p.add_argument("--py-spy", type=Path, metavar="FILE", help="sample the listener with py-spy")
    p.add_argument("--check", action="store_true", help="exit 1 when a ratio is below target")
    a = p.parse_args(argv)
    targets = tuple(t for t in TARGETS if t in a.targets.split(","))
    unknown = set(a.targets.split(",")) - set(TARGETS)
    if unknown or not targets:
        p.error(f"--targets: unknown {', '.join(sorted(unknown)) or 'empty list'}")
    if min(a.messages, a.rounds, a.inflight, a.size) < 1 or a.warmup < 0:
        p.error("--messages, --rounds, --inflight and --size must be positive")
    return Options(
        a.messages,
        a.rounds,
        a.inflight,
        a.size,
        a.warmup,
        targets,
        a.listener_loop,
        a.profile,
        a.py_spy,
        a.check,
    )


if __name__ == "__main__":
    sys.exit(main())
