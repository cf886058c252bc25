"""What the listener costs a confirm-window publisher, measured in one run.

The issue's bar: a lean publisher (``--inflight`` unconfirmed, ``--size``-byte
persistent messages) through the listener reaches at least 0.90x the direct
rate on a VPN that is not replicated, and at least 0.80x on a replicated VPN
whose sink reports every event durable at once. This script prints both ratios.

Why it is built the way it is:

* **The publisher is lean** — raw asyncio protocol, frames encoded once with
  pamqp, acks decoded with ``struct`` — so the proxy's cost is not hidden
  behind client overhead (pika costs more per message than the listener).
* **One private RabbitMQ node** (``plugin.devtools``) serves all three
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
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import quote

import uvloop
from _common import (
    BenchError,
    LeanPublisher,
    RunResult,
    add_publisher_options,
    process_cpu,
    start_py_spy,
    summarise_py_spy,
)

from bridge import ConfirmKey, Event, IdSource, LocalTransaction, Published, Role
from plugin.devtools import LocalSites, RabbitNode
from plugin.listener import BrokerAddress, Listener, ReplicationSink
from plugin.topology import ReplicationScope, Topology, VpnDirectory, VpnView

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

    def append_many(
        self,
        events: Sequence[tuple[Event, ConfirmKey | None]],
        on_durable: Callable[[ConfirmKey, bool], None],
    ) -> None:
        for event, key in events:
            if type(event) is Published:
                self.published += 1
            else:
                self.consumed += 1
            if key is not None:
                on_durable(key, True)

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
    listener = Listener(BrokerAddress("127.0.0.1", broker_port), directory, IdSource(1), sink)
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


async def one_run(
    target: str, port: int, opts: Options, messages: int, listener: ListenerProcess | None
) -> RunResult:
    before = listener.ask("stats") if listener is not None else None
    pub = await LeanPublisher.connect(port, VHOSTS[target], QUEUE)
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
    add_publisher_options(p, messages=20000)
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
