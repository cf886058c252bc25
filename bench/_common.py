"""Pieces the benchmarks share: lean AMQP clients, CPU accounting, py-spy.

* :class:`LeanPublisher` — one connection, one confirm channel, driven by
  hand: frames encoded once with pamqp, ``basic.ack`` decoded with ``struct``
  and the window refilled in the same callback, so the client costs far less
  per message than the proxy it measures. Optionally *paced* (a fixed rate,
  still capped at the window) and recording each tag's confirm time.
* :class:`LeanConsumer` — one connection, one channel, ``basic.qos`` prefetch
  and ``basic.consume``; deliveries, content headers and bodies are cut with
  ``struct``, and each message is acked once its body is complete (one
  ``basic.ack`` per message, or ``multiple`` every N).

Both check what they are told: a nack, an ack for a tag never published, a
tag confirmed twice, a redelivery or a channel/connection close fails the run
with :class:`BenchError`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import select
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from pamqp import base, body, commands, frame, header

# A script here runs with bench/ first on sys.path, where bench/bridge.py
# would shadow the ``bridge`` package for every later import: the
# repository root goes first (every script imports this module before the
# project's packages).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
_FRAME_HEAD = struct.Struct(">BHI")
_ACK = struct.Struct(">HHQB")  # class, method, delivery tag, bits
_ACK_FRAME_SIZE = 7 + _ACK.size + 1
_METHOD = struct.Struct(">HH")
_U64 = struct.Struct(">Q")
#: a whole basic.ack frame: type, channel, size, class, method, tag, bits, frame-end
_ACK_OUT = struct.Struct(">BHIHHQBB")


class BenchError(Exception):
    """The benchmark cannot produce a trustworthy number."""


# ---------------------------------------------------------------- results


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
    #: perf_counter time of each tag's confirm (index = delivery tag), when recorded
    confirmed_at: list[float] = field(default_factory=list)
    #: extra per-run figures a benchmark attaches (CPU of other processes, ...)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    def latency(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(slots=True)
class ConsumeResult:
    target: str
    messages: int
    seconds: float
    consumer_us: float
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.messages / self.seconds


# ---------------------------------------------------------------- lean clients


class _LeanConnection(asyncio.Protocol):
    """Handshake, control RPCs and the frame loop; subclasses handle the hot frames."""

    CHANNEL = 1

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.transport: asyncio.Transport | None = None
        self.frame_max = 131072
        self._buf = bytearray()
        self._replies: asyncio.Queue[base.Frame | BaseException] = asyncio.Queue()
        self._lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._done: asyncio.Future[float] | None = None

    @classmethod
    async def connect(cls, port: int, vhost: str, queue: str, **kwargs: Any) -> Self:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(lambda: cls(queue, **kwargs), "127.0.0.1", port)
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
            self._refill(refill)

    def _frame(self, buf: bytearray, ftype: int, channel: int, pos: int, end: int) -> int:
        raise NotImplementedError

    def _refill(self, count: int) -> None:
        raise NotImplementedError

    def _method(self, buf: bytearray, channel: int, pos: int, end: int) -> None:
        _, _, method = frame.unmarshal(bytes(buf[pos:end]))
        if not isinstance(method, base.Frame):
            raise BenchError(f"undecodable method frame on channel {channel}")
        self._control(method)

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
                "capabilities": {
                    "publisher_confirms": True,
                    "connection.blocked": True,
                    "consumer_cancel_notify": True,
                },
            },
            mechanism="PLAIN",
            response="\0guest\0guest",
        )
        tune = await self.rpc(start_ok, commands.Connection.Tune)
        self.frame_max = tune.frame_max or 131072
        self._write(commands.Connection.TuneOk(tune.channel_max, self.frame_max, 0))
        await self.rpc(commands.Connection.Open(virtual_host=vhost), commands.Connection.OpenOk)
        await self.rpc(commands.Channel.Open(), commands.Channel.OpenOk, self.CHANNEL)
        await self._setup_channel()

    async def _setup_channel(self) -> None:
        raise NotImplementedError

    async def declare(self) -> int:
        """Declare the (durable) queue; returns its ready-message count."""
        ok = await self.rpc(
            commands.Queue.Declare(queue=self.queue, durable=True),
            commands.Queue.DeclareOk,
            self.CHANNEL,
        )
        return int(ok.message_count)

    async def depth(self) -> int:
        """The queue's ready-message count (a passive declare, a round trip)."""
        ok = await self.rpc(
            commands.Queue.Declare(queue=self.queue, passive=True),
            commands.Queue.DeclareOk,
            self.CHANNEL,
        )
        return int(ok.message_count)

    async def purge(self) -> int:
        ok = await self.rpc(
            commands.Queue.Purge(queue=self.queue), commands.Queue.PurgeOk, self.CHANNEL
        )
        return int(ok.message_count)

    async def close(self) -> None:
        with contextlib.suppress(BenchError, TimeoutError):
            await self.rpc(commands.Connection.Close(200, "bye", 0, 0), commands.Connection.CloseOk)
        if self.transport is not None:
            self.transport.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._lost), 5)


class LeanPublisher(_LeanConnection):
    """One AMQP connection and one confirm channel, driven by hand.

    Control methods are decoded with pamqp and handed to :meth:`rpc`; during
    the publish phase, ``basic.ack`` frames are decoded with ``struct`` in
    ``data_received`` and refill the window in the same callback.
    """

    def __init__(self, queue: str) -> None:
        super().__init__(queue)
        self._message = b""
        self._total = 0
        self._next_tag = 1
        self._low = 1  # lowest unconfirmed tag
        self._confirmed = 0
        self._acked = bytearray()
        self._sent_at: list[float] = []
        self._confirmed_at: list[float] = []
        self.latencies: list[float] = []
        # pacing: publish tag n no earlier than t0 + (n - 1) / rate
        self._rate = 0.0
        self._t0 = 0.0
        self._inflight = 0

    async def _setup_channel(self) -> None:
        await self.rpc(commands.Confirm.Select(), commands.Confirm.SelectOk, self.CHANNEL)
        await self.declare()

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
        self._method(buf, channel, pos, end)
        return 0

    # publish phase ------------------------------------------------------------

    async def publish(
        self, target: str, messages: int, inflight: int, size: int, rate: float = 0.0
    ) -> RunResult:
        """Publish ``messages`` keeping at most ``inflight`` unconfirmed; time
        first publish to last confirm. With ``rate`` (msg/s) > 0 the publishes
        are paced at that rate (open loop, still capped at ``inflight``)."""
        self._message = encode_message(self.CHANNEL, size, self.frame_max, self.queue)
        self._total = messages
        self._next_tag, self._low, self._confirmed = 1, 1, 0
        self._acked = bytearray(messages + 2)
        self._sent_at = [0.0] * (messages + 1)
        self._confirmed_at = [0.0] * (messages + 1)
        self.latencies = []
        self._rate, self._inflight = rate, inflight
        self._done = asyncio.get_running_loop().create_future()
        cpu0, t0 = time.process_time(), time.perf_counter()
        self._t0 = t0
        pacer = None
        if rate > 0:
            pacer = asyncio.create_task(self._pace())
        else:
            self._send(min(inflight, messages))
        try:
            t1 = await self._done
        finally:
            if pacer is not None:
                pacer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pacer
        cpu_us = (time.process_time() - cpu0) / messages * 1e6
        result = RunResult(target, messages, t1 - t0, self.latencies, cpu_us)
        result.confirmed_at = self._confirmed_at
        return result

    async def _pace(self) -> None:
        while self._next_tag <= self._total:
            self._refill(self._inflight)
            await asyncio.sleep(0.001)

    def _refill(self, count: int) -> None:
        if self._rate:
            due = int((time.perf_counter() - self._t0) * self._rate) + 1
            room = self._inflight - (self._next_tag - 1 - self._confirmed)
            count = min(due - self._next_tag + 1, room)
        self._send(count)

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
        confirmed_at = self._confirmed_at
        newly = 0
        if multiple:
            for t in range(self._low, tag + 1):
                if not acked[t]:
                    acked[t] = 1
                    confirmed_at[t] = now
                    latencies.append(now - sent_at[t])
                    newly += 1
            if not newly:
                raise BenchError(f"multiple ack up to {tag} confirms nothing new")
        else:
            if acked[tag]:
                raise BenchError(f"delivery tag {tag} confirmed twice")
            acked[tag] = 1
            confirmed_at[tag] = now
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


def encode_message(channel: int, size: int, frame_max: int, queue: str) -> bytes:
    """basic.publish (default exchange, to ``queue``) + content header
    (delivery-mode 2) + body frames."""
    properties = commands.Basic.Properties(delivery_mode=2, content_type="application/octet-stream")
    payload = os.urandom(size)
    step = frame_max - 8
    return b"".join(
        [
            frame.marshal(commands.Basic.Publish(exchange="", routing_key=queue), channel),
            frame.marshal(header.ContentHeader(0, size, properties), channel),
            *(
                frame.marshal(body.ContentBody(payload[i : i + step]), channel)
                for i in range(0, size, step)
            ),
        ]
    )


class LeanConsumer(_LeanConnection):
    """One channel with ``basic.qos(prefetch)`` and one ``basic.consume``.

    A message is acked once its last body frame arrived (an ack for a
    delivery whose content the proxy has not relayed yet would not be what a
    real client does). ``ack_every=1`` sends one ``basic.ack`` per message;
    ``ack_every=N`` sends ``multiple=true`` for every N-th message and for the
    last one. Acks produced by one read go out in one write.
    """

    def __init__(self, queue: str, prefetch: int = 500, ack_every: int = 1) -> None:
        super().__init__(queue)
        self.prefetch = prefetch
        self.ack_every = ack_every
        self._total = 0
        self._received = 0
        self._unacked = 0  # completed, not yet acked (multiple mode)
        self._tag = 0  # delivery tag of the message whose content is arriving
        self._expect = 0  # body bytes still to come for it
        self._last_tag = 0
        self._acks: list[bytes] = []

    async def _setup_channel(self) -> None:
        await self.rpc(
            commands.Basic.Qos(prefetch_count=self.prefetch), commands.Basic.QosOk, self.CHANNEL
        )
        await self.declare()

    def _frame(self, buf: bytearray, ftype: int, channel: int, pos: int, end: int) -> int:
        if ftype == 3:
            self._expect -= end - pos - 8
            if self._expect <= 0 and self._tag:
                self._complete()
            return 0
        if ftype == 2:
            self._expect = _U64.unpack_from(buf, pos + 11)[0]
            if self._expect == 0:
                self._complete()
            return 0
        if ftype == 8:
            return 0
        if ftype != 1:
            raise BenchError(f"unexpected frame type {ftype} on channel {channel}")
        if _METHOD.unpack_from(buf, pos + 7) == (60, 60):  # basic.deliver
            p = pos + 12 + buf[pos + 11]
            tag = _U64.unpack_from(buf, p)[0]
            if buf[p + 8] & 1:
                raise BenchError(f"delivery tag {tag} is a redelivery")
            if self._tag:
                raise BenchError(f"delivery {tag} before the content of {self._tag} ended")
            self._tag = tag
            return 0
        self._method(buf, channel, pos, end)
        return 0

    def _complete(self) -> None:
        tag, self._tag = self._tag, 0
        if tag != self._last_tag + 1:
            raise BenchError(f"delivery tag {tag} after {self._last_tag}")
        self._last_tag = tag
        self._received += 1
        last = self._received == self._total
        if self.ack_every == 1:
            self._acks.append(_ACK_OUT.pack(1, self.CHANNEL, 13, 60, 80, tag, 0, 0xCE))
        else:
            self._unacked += 1
            if self._unacked >= self.ack_every or last:
                self._acks.append(_ACK_OUT.pack(1, self.CHANNEL, 13, 60, 80, tag, 1, 0xCE))
                self._unacked = 0
        if last:
            self._flush_acks()
            if self._done is not None and not self._done.done():
                self._done.set_result(time.perf_counter())

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._flush_acks()

    def _flush_acks(self) -> None:
        if self._acks and self.transport is not None:
            self.transport.write(b"".join(self._acks))
            self._acks.clear()

    def _refill(self, count: int) -> None:
        return None

    async def consume(self, target: str, messages: int) -> ConsumeResult:
        """Consume and ack ``messages``; time ``basic.consume`` to the answer
        of a passive declare sent after the last ack (so every ack has passed
        whatever sits between us and the broker). The queue must be empty then."""
        self._total, self._received, self._last_tag, self._unacked = messages, 0, 0, 0
        self._done = asyncio.get_running_loop().create_future()
        cpu0, t0 = time.process_time(), time.perf_counter()
        ok = await self.rpc(
            commands.Basic.Consume(queue=self.queue, consumer_tag="bench"),
            commands.Basic.ConsumeOk,
            self.CHANNEL,
        )
        await asyncio.wait_for(self._done, max(60.0, messages / 200))
        left = await self.depth()
        t1 = time.perf_counter()
        cpu_us = (time.process_time() - cpu0) / messages * 1e6
        await self.rpc(
            commands.Basic.Cancel(consumer_tag=ok.consumer_tag),
            commands.Basic.CancelOk,
            self.CHANNEL,
        )
        if left:
            raise BenchError(f"{target}: {left} messages left in {self.queue} after consuming")
        return ConsumeResult(target, messages, t1 - t0, cpu_us)


# ---------------------------------------------------------------- CPU accounting


def process_cpu(pid: int | None) -> float | None:
    """User + system CPU seconds of ``pid`` so far (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def beam_pid(pidfile: Path) -> int | None:
    """A RabbitMQ node's (BEAM) process id from its pid file, or None."""
    try:
        return int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def tree_cpu(pid: int | None) -> float | None:
    """CPU seconds of ``pid`` and all its live descendants, plus what their
    exited (and reaped) children used — e.g. a PostgreSQL postmaster and its
    backends. None when ``pid`` is not there."""
    if pid is None:
        return None
    stats: dict[int, tuple[int, float]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))
        stats[int(stat.parent.name)] = (int(fields[1]), ticks / os.sysconf("SC_CLK_TCK"))
    if pid not in stats:
        return None
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(p)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats[p][1]
        todo.extend(children.get(p, []))
    return total


# ---------------------------------------------------------------- py-spy

_LINE = re.compile(r":\d+\)$")


def summarise_py_spy(
    raw: Path, top: int = 25, label: str = "listener", seconds: float = 0.0, rate: int = 200
) -> None:
    """Own and inclusive time per function from py-spy's collapsed stacks.

    With ``seconds`` (how long py-spy sampled) the share of wall time the
    process was busy (non-idle samples) is printed as well.
    """
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
    busy = f", busy {100 * total / (seconds * rate):.0f}% of {seconds:.1f} s" if seconds else ""
    print(f"\n=== {label} py-spy ({raw}), {total} samples{busy} — own time ===")
    for name, n in own.most_common(top):
        print(f"{100 * n / total:6.1f}%  {name}")
    print("=== inclusive time (frames in every sample left out) ===")
    for name, n in [(k, v) for k, v in inclusive.most_common() if v < total][:top]:
        print(f"{100 * n / total:6.1f}%  {name}")


def py_spy_exe() -> str | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return exe if Path(exe).exists() else None


def start_py_spy(
    pid: int, out: Path, rate: int = 200, nonblocking: bool = False
) -> subprocess.Popen[bytes] | None:
    exe = py_spy_exe()
    if exe is None:
        print("py-spy not found (pip install py-spy); profiling skipped", file=sys.stderr)
        return None
    argv = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw"]
    if nonblocking:
        argv.append("--nonblocking")
    return subprocess.Popen(
        [*argv, "--output", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def add_publisher_options(p: argparse.ArgumentParser, messages: int) -> None:
    """The confirm-window publisher's options, shared by every benchmark."""
    p.add_argument("--messages", type=int, default=messages, help=f"per run (default {messages})")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--inflight", type=int, default=500, help="unconfirmed publishes (default 500)")
    p.add_argument("--size", type=int, default=1024, help="body bytes (default 1024)")
    p.add_argument("--warmup", type=int, default=2000, help="messages per target before round 1")


# ---------------------------------------------------------------- site processes


def start_ready(argv: list[str], what: str) -> subprocess.Popen[bytes]:
    """Start a helper process (a floor writer) with pipes to its stdin and
    stdout, and wait up to two minutes for it to print ``ready``: its work
    is built before any clock starts."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # noqa: S603
    assert proc.stdout is not None  # noqa: S101 - PIPE
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline().strip() if ready else b""
    if line != b"ready":
        proc.kill()
        raise BenchError(f"{what} did not start: {line!r}")
    return proc


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def vpnrepl_exe() -> str:
    exe = shutil.which("vpnrepl") or str(Path(sys.executable).with_name("vpnrepl"))
    if not Path(exe).exists():
        raise BenchError("the vpnrepl console script is not installed in this environment")
    return exe


def vpnrepl(config: Path, *args: str) -> str:
    out = subprocess.run(
        [vpnrepl_exe(), "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if out.returncode != 0:
        raise BenchError(f"vpnrepl {' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out.stdout.strip()


class SpanCollector:
    """Each exported span's duration by name, from an :class:`OtlpReceiver`.

    The nodes export in batches and flush when they stop, so read
    :attr:`durations` after stopping them.
    """

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        from plugin.devtools import OtlpReceiver

        self.durations: dict[str, list[float]] = {}

        def take(_path: str, data: bytes) -> None:
            for rs in ExportTraceServiceRequest.FromString(data).resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        took = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
                        self.durations.setdefault(span.name, []).append(took)

        self.receiver = OtlpReceiver(take)
        self.url = self.receiver.url

    def close(self) -> None:
        self.receiver.close()
