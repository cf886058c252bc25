"""What a client XA branch costs over a local transaction of the same work.

Set-up: two private sites (``LocalSites``), VPN ``orders`` enabled on site A
``--role active --mode sync`` (every queue in scope), a ``vpnrepl node`` per
site, B the standby; one durable queue ``bench.xa``. Every variant goes
through A's listener with pika's ``BlockingConnection`` and publishes
``--per-txn`` persistent messages of ``--size`` bytes per transaction; the
publishes are not timed, the completion is:

* ``local``: ``tx.commit`` (the internal two-phase commit over both sites);
* ``xa``: ``end`` + ``prepare`` + ``commit`` of an XA branch, as a
  transaction manager drives it (:class:`txn.XAResource`);
* ``xa-1pc``: ``end`` + one-phase ``commit``.

Also ``direct``: ``tx.commit`` against RabbitMQ A itself, the floor under
all of them. The variants alternate within each round (the order rotates),
so the machine's drift hits them alike. The report gives each variant's
p50 and p99 and what XA adds over ``local`` in the same run.

Run from the repository root: ``.venv/bin/python bench/xa.py``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import pika
import psycopg
from _common import BenchError, percentile, vpnrepl

from plugin.devtools import HarnessError, LocalNode, LocalSites
from txn.client import XAResource
from txn.xa import Xid

VPN = "orders"
QUEUE = "bench.xa"
VARIANTS = ("direct", "local", "xa", "xa-1pc")


class Bench:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.sites = LocalSites()
        self.a, self.b = self.sites.a, self.sites.b
        self.nodes: list[LocalNode] = []
        self.branch = 0

    def start(self) -> None:
        t0 = time.monotonic()
        self.sites.start()
        self.a.rabbit.add_vhost(VPN)
        self.a.rabbit.api("PUT", f"queues/{VPN}/{QUEUE}", {"durable": True})
        base = self.sites.base
        cfg_a = self.a.write_config(base / "a.toml", peer=self.b, dial=False)
        cfg_b = self.b.write_config(base / "b.toml", peer=self.a)
        vpnrepl(cfg_a, "init")
        vpnrepl(cfg_a, "vpn", "enable", VPN, "--role", "active", "--mode", "sync")
        vpnrepl(cfg_b, "init")
        self.nodes = [
            LocalNode(self.a, cfg_a, base / "node-a.log", name="a"),
            LocalNode(self.b, cfg_b, base / "node-b.log", name="b"),
        ]
        for node in self.nodes:
            node.start()
        deadline = time.monotonic() + 90
        while self._bridge() != "connected":
            if time.monotonic() > deadline:
                raise BenchError("the standby did not connect")
            time.sleep(0.1)
        print(f"two sites and their nodes up in {time.monotonic() - t0:.0f} s")

    def _bridge(self) -> object:
        with psycopg.connect(self.b.pg.dsn(), autocommit=True) as db:
            row = db.execute("SELECT bridge_state FROM vpn_state").fetchone()
        return None if row is None else row[0]

    def run(self, variant: str, txns: int) -> list[float]:
        port = self.a.rabbit.amqp_port if variant == "direct" else self.a.amqp_port
        conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, VPN))
        work = conn.channel()
        xa = XAResource(conn) if variant.startswith("xa") else None
        if xa is None:
            work.tx_select()
        body = os.urandom(self.opts.size)
        props = pika.BasicProperties(delivery_mode=2)
        latencies = []
        for _ in range(txns):
            self.branch += 1
            xid = Xid.from_parts(1, f"bench-{os.getpid()}-{self.branch}", "broker")
            if xa is not None:
                xa.start(xid, work)
            for _ in range(self.opts.per_txn):
                work.basic_publish("", QUEUE, body, props)
            t0 = time.perf_counter()
            if xa is None:
                work.tx_commit()
            else:
                xa.end(xid)
                if variant == "xa":
                    xa.prepare(xid)
                xa.commit(xid, one_phase=variant == "xa-1pc")
            latencies.append(time.perf_counter() - t0)
        conn.close()
        return latencies

    def close(self) -> None:
        for node in reversed(self.nodes):
            if node.alive():
                node.stop()
        self.sites.close()


def report(got: dict[str, list[float]], opts: argparse.Namespace) -> None:
    print(
        f"\n{opts.rounds} rounds x {opts.txns} transactions of {opts.per_txn} x {opts.size} B"
        " publishes, sync mode (ms):"
    )
    local50 = statistics.median(got["local"])
    local99 = percentile(got["local"], 0.99)
    for variant in VARIANTS:
        p50, p99 = statistics.median(got[variant]), percentile(got[variant], 0.99)
        extra = ""
        if variant.startswith("xa"):
            extra = (
                f"  added over local: p50 {1000 * (p50 - local50):+6.2f}"
                f"  p99 {1000 * (p99 - local99):+6.2f}  ({p50 / local50:.2f}x)"
            )
        print(f"  {variant:7} p50 {1000 * p50:6.2f}  p99 {1000 * p99:6.2f}{extra}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--txns", type=int, default=100, help="transactions per run (default 100)")
    p.add_argument("--per-txn", type=int, default=10, help="publishes per transaction")
    p.add_argument("--size", type=int, default=1024, help="body bytes")
    opts = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"load average before start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    bench = Bench(opts)
    try:
        bench.start()
        got: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(opts.rounds):
            k = r % len(VARIANTS)
            for variant in VARIANTS[k:] + VARIANTS[:k]:
                lat = bench.run(variant, opts.txns)
                got[variant] += lat
                print(
                    f"round {r + 1}: {variant:7} p50 {1000 * statistics.median(lat):6.2f} ms"
                    f"  p99 {1000 * percentile(lat, 0.99):6.2f} ms"
                )
        report(got, opts)
        return 0
    except (BenchError, HarnessError) as e:
        print(f"bench/xa.py: {e}", file=sys.stderr)
        return 1
    finally:
        bench.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
