"""How fast promotion materialises live messages, against a lean publisher, in one run.

The issue's bar: materialising a VPN's live messages into the standby
broker runs at least 0.8x the rate of a lean direct publisher with
confirms (same count, size and window, same broker). This script prints
both rates and the ratio per round and their medians.

Set-up: site B's servers only (``LocalSites``: one private RabbitMQ node and
one private PostgreSQL cluster; site A's are not started, the machine has
two cores), the schema (``sql.migrate``), VPN ``orders`` enabled as standby,
a ``promotion`` row of epoch 2, the vhost ``orders`` with ``--queues``
durable queues, and ``--messages`` live rows of ``--size``-byte bodies
spread over the queues (publishes interleaved across them, as a
VPN's traffic would be), with properties as a replicated compact client's
message carries them (our id header, delivery mode 2: 29 bytes).

Each round runs both targets, in alternating order, so drift of the machine
hits both:

* **materialise** — :func:`bridge.materialise` end to end, as ``vpnrepl
  promote`` calls it: the plan transaction, the passive declares, per queue
  a purge, the rows read through a server-side cursor and published with
  ``--window`` unconfirmed, the depth check and the ``done`` transaction.
  Before it, the queues are emptied and the VPN's ``promotion_queue`` rows
  deleted, so every round materialises everything.
* **lean** — ``bench/_common.py``'s :class:`LeanPublisher` (frames encoded
  once, acks decoded with ``struct``), one connection per queue, the same
  number of messages per queue, same body size, same window; timed from
  the first connect to the last queue's last confirm.

After every run the script checks each queue holds exactly what was
published, then empties it. Timings are printed, never asserted.

Run from the repository root: ``.venv/bin/python bench/promotion.py``.
``--profile FILE`` writes a cProfile of the materialise runs and prints
its top functions.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import struct
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import uvloop
from _common import BenchError, LeanPublisher, beam_pid, tree_cpu

from bridge import VpnSettings
from plugin.devtools import HarnessError, LocalSite, LocalSites, sweep_orphans
from plugin.ops import connect, enable_vpn
from sql import migrate

# bench/ is first on sys.path when this runs as a script, and bench/bridge.py
# (the bridge benchmark) would shadow the bridge package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from bridge.roles import materialise  # noqa: E402

VPN = "orders"
EPOCH = 2
TARGET_RATIO = 0.8


@dataclass(slots=True)
class Run:
    target: str
    messages: int
    seconds: float
    #: this process's CPU per message, µs
    client_us: float
    #: RabbitMQ's and PostgreSQL's CPU per message, µs (None without /proc)
    broker_us: float | None
    store_us: float | None

    @property
    def rate(self) -> float:
        return self.messages / self.seconds


# ---------------------------------------------------------------- set-up


def properties(n: int) -> bytes:
    """Headers (``x-vpnrepl-id``, an int64) and delivery mode 2."""
    entry = b"\x0cx-vpnrepl-id" + b"l" + struct.pack(">q", (7 << 44) | n)
    return struct.pack(">HI", 0x3000, len(entry)) + entry + b"\x02"


def queue_names(count: int) -> list[str]:
    return [f"bench.promote.{i}" for i in range(count)]


def prepare(site: LocalSite, messages: int, queues: list[str], size: int) -> None:
    dsn = site.pg.dsn()
    migrate(dsn)
    with connect(dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args(VPN, "standby"))
        conn.execute(
            "INSERT INTO promotion (vpn, epoch, state) VALUES (%s, %s, 'running')", (VPN, EPOCH)
        )
    site.rabbit.add_vhost(VPN)
    for q in queues:
        site.rabbit.api("PUT", f"queues/{VPN}/{q}", {"durable": True})
    t0 = time.monotonic()
    body = os.urandom(size)
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        with cur.copy(
            "COPY live_message (vpn, queue, repl_id, publish_index, exchange, routing_key,"
            " properties, body) FROM STDIN"
        ) as copy:
            for n in range(1, messages + 1):
                q = queues[n % len(queues)]
                rid = (7).to_bytes(8, "big") + n.to_bytes(8, "big")
                copy.write_row((VPN, q, rid, n, "ex", "rk", properties(n), body))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE live_message")
    print(
        f"{messages} live rows of {size} B in {len(queues)} queues ({time.monotonic() - t0:.1f} s)"
    )


def per_queue(messages: int, queues: list[str]) -> dict[str, int]:
    counts = dict.fromkeys(queues, 0)
    for n in range(1, messages + 1):
        counts[queues[n % len(queues)]] += 1
    return counts


async def empty_queues(port: int, counts: dict[str, int], target: str) -> None:
    """Check each queue holds what the run published, then purge it."""
    for q, expected in counts.items():
        pub = await LeanPublisher.connect(port, VPN, q)
        try:
            held = await pub.purge()
        finally:
            await pub.close()
        if held != expected:
            raise BenchError(f"{target}: {q} held {held} messages, {expected} expected")


def reset_promotion(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("DELETE FROM promotion_queue WHERE vpn = %s", (VPN,))
        conn.execute("UPDATE promotion SET materialised = 0, total = 0 WHERE vpn = %s", (VPN,))


# ---------------------------------------------------------------- targets


class Bench:
    def __init__(self, opts: argparse.Namespace, site: LocalSite) -> None:
        self.opts = opts
        self.site = site
        self.queues = queue_names(opts.queues)
        self.counts = per_queue(opts.messages, self.queues)
        self.broker_pid = beam_pid(site.rabbit.pidfile)
        self.store_pid = site.pg.postmaster_pid()
        self.profile = cProfile.Profile() if opts.profile else None

    def measure(self, target: str, work: Callable[[], Coroutine[Any, Any, None]]) -> Run:
        broker0, store0 = tree_cpu(self.broker_pid), tree_cpu(self.store_pid)
        cpu0, t0 = time.process_time(), time.perf_counter()
        run_loop(self.opts.loop, work())
        seconds = time.perf_counter() - t0
        client = time.process_time() - cpu0
        broker1, store1 = tree_cpu(self.broker_pid), tree_cpu(self.store_pid)
        n = self.opts.messages

        def per_message(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else (b - a) / n * 1e6

        run = Run(
            target,
            n,
            seconds,
            client / n * 1e6,
            per_message(broker0, broker1),
            per_message(store0, store1),
        )
        run_loop(self.opts.loop, empty_queues(self.site.rabbit.amqp_port, self.counts, target))
        return run

    def materialise(self) -> Run:
        reset_promotion(self.site.pg.dsn())

        async def work() -> None:
            if self.profile is not None:
                self.profile.enable()
            try:
                result = await materialise(
                    self.site.pg.dsn(),
                    self.site.rabbit.amqp_url(),
                    VPN,
                    EPOCH,
                    window=self.opts.window,
                )
            finally:
                if self.profile is not None:
                    self.profile.disable()
            if result.messages != self.opts.messages:
                raise BenchError(f"materialised {result.messages} of {self.opts.messages}")

        return self.measure("materialise", work)

    def lean(self) -> Run:
        async def work() -> None:
            for q, count in self.counts.items():
                pub = await LeanPublisher.connect(self.site.rabbit.amqp_port, VPN, q)
                try:
                    await pub.publish("lean", count, self.opts.window, self.opts.size)
                finally:
                    await pub.close()

        return self.measure("lean", work)


def run_loop(kind: str, coro: Coroutine[Any, Any, None]) -> None:
    if kind == "uvloop":
        uvloop.run(coro)
    else:
        asyncio.run(coro)


# ---------------------------------------------------------------- report


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:5.1f}"


def report(runs: dict[str, list[Run]], opts: argparse.Namespace) -> None:
    print(
        f"\n{'target':<12} {'median msg/s':>12} {'client µs':>9} {'broker µs':>9} "
        f"{'store µs':>8}  runs (msg/s)"
    )
    medians = {}
    for target, rs in runs.items():
        medians[target] = statistics.median(r.rate for r in rs)

        def med(values: list[float | None]) -> float | None:
            got = [v for v in values if v is not None]
            return statistics.median(got) if got else None

        print(
            f"{target:<12} {medians[target]:>12.0f} {_us(med([r.client_us for r in rs])):>9} "
            f"{_us(med([r.broker_us for r in rs])):>9} {_us(med([r.store_us for r in rs])):>8}"
            f"  {' '.join(f'{r.rate:.0f}' for r in rs)}"
        )
    paired = sorted(
        m.rate / lean.rate for m, lean in zip(runs["materialise"], runs["lean"], strict=True)
    )
    ratio = medians["materialise"] / medians["lean"]
    verdict = "ok" if ratio >= TARGET_RATIO else "BELOW TARGET"
    print(
        f"\n{opts.messages} x {opts.size} B in {opts.queues} queues, window {opts.window}, "
        f"{opts.rounds} rounds, loop {opts.loop}"
    )
    print(
        f"materialise / lean = {ratio:.2f}   (target >= {TARGET_RATIO}: {verdict}; "
        f"per round {paired[0]:.2f}..{paired[-1]:.2f}; median of per-round ratios "
        f"{statistics.median(paired):.2f})"
    )
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=100_000, help="live messages (default 100000)")
    p.add_argument("--queues", type=int, default=4, help="queues they are spread over (default 4)")
    p.add_argument("--size", type=int, default=1024, help="body bytes (default 1024)")
    p.add_argument("--window", type=int, default=1000, help="unconfirmed at most (default 1000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of both targets (default 3)")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    p.add_argument("--profile", type=Path, metavar="FILE", help="cProfile the materialise runs")
    opts = p.parse_args(argv)
    if min(opts.messages, opts.queues, opts.size, opts.window, opts.rounds) < 1:
        p.error("every count must be positive")
    print(f"load average before start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    sweep_orphans()
    sites = LocalSites()
    try:
        site = sites.b
        t0 = time.monotonic()
        site.rabbit.launch()
        site.pg.start()
        site.rabbit.wait_ready()
        site.pg.reset()
        print(f"RabbitMQ and PostgreSQL of site B up ({time.monotonic() - t0:.0f} s)")
        prepare(site, opts.messages, queue_names(opts.queues), opts.size)
        bench = Bench(opts, site)
        runs: dict[str, list[Run]] = {"materialise": [], "lean": []}
        for r in range(opts.rounds):
            order = ("materialise", "lean") if r % 2 == 0 else ("lean", "materialise")
            line = []
            for target in order:
                run = bench.materialise() if target == "materialise" else bench.lean()
                runs[target].append(run)
                line.append(f"{target} {run.rate:7.0f} msg/s ({run.seconds:.2f} s)")
            ratio = runs["materialise"][-1].rate / runs["lean"][-1].rate
            print(f"round {r + 1}: {' | '.join(line)} | ratio {ratio:.2f}", flush=True)
        report(runs, opts)
        if bench.profile is not None:
            bench.profile.dump_stats(str(opts.profile))
            print(f"\n=== materialise cProfile ({opts.profile}) — top 25 by own time ===")
            pstats.Stats(str(opts.profile)).sort_stats("tottime").print_stats(25)
        return 0
    except (BenchError, HarnessError) as e:
        print(f"bench/promotion.py: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench/promotion.py: interrupted", file=sys.stderr)
        return 130
    finally:
        sites.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
