"""What the two-phase commit adds to a client's ``tx.commit``, measured in one run.

The issue's bar: a transaction of 10 persistent 1 KiB publishes, its
``tx.commit`` latency (p50 and p99) through the plugin against the same
client talking to the broker directly, in the same run; the added p50 at
most 5 ms on loopback. This script prints both and the difference.

Set-up (the deployed one): two private sites (``LocalSites``), ``vpnrepl
init`` on both, VPN ``orders`` enabled on site A ``--role active --mode
sync`` (every queue in scope), a ``vpnrepl node`` per site, B the standby.
A sync VPN is the expensive case: the standby prepares before the broker
commit and applies before ``tx.commit-ok``. One durable queue,
``bench.txn``, which keeps what the runs publish (a purge is not replicated).

The client is pika's ``BlockingConnection`` on both paths (the same client
overhead cancels out in the difference); only the ``tx.commit`` call is
timed, the publishes before it are not. Runs alternate direct / through the
listener per round, so drift hits both. After each listener run the script
checks that the ledger grew by exactly 10 events per transaction and that
the standby applied them all, and that no transaction is left in doubt.

Run from the repository root: ``.venv/bin/python bench/transactions.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import pika
import psycopg
from _common import (
    BenchError,
    beam_pid,
    process_cpu,
    start_py_spy,
    summarise_py_spy,
    tree_cpu,
    vpnrepl,
)

from plugin._localsites import HarnessError, LocalNode, LocalSites

VPN = "orders"
QUEUE = "bench.txn"
TARGET_ADDED_P50_MS = 5.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Bench:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.sites = LocalSites()
        self.a, self.b = self.sites.a, self.sites.b
        self.nodes: list[LocalNode] = []

    def start(self) -> None:
        t0 = time.monotonic()
        self.sites.start()
        self.a.rabbit.add_vhost(VPN)
        self.a.rabbit.api("PUT", f"queues/{VPN}/{QUEUE}", {"durable": True})
        base = self.sites.base
        cfg_a = self.a.write_config(base / "a.toml")
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
        self._wait(
            lambda: self._scalar(self.b, "SELECT bridge_state FROM vpn_state") == "connected"
        )
        print(f"two sites and their nodes up in {time.monotonic() - t0:.0f} s")

    def _scalar(self, site, sql: str, *params: object) -> object:  # type: ignore[no-untyped-def]
        with psycopg.connect(site.pg.dsn(), autocommit=True) as db:
            row = db.execute(sql, params).fetchone()
        return None if row is None else row[0]

    def _wait(self, check, timeout: float = 90.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not check():
            for node in self.nodes:
                if not node.alive():
                    raise BenchError(f"node {node.name} died:\n{node.tail()}")
            if time.monotonic() > deadline:
                raise BenchError("timed out waiting for the sites")
            time.sleep(0.05)

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of each process on the path (Linux /proc)."""
        procs = {
            "client": process_cpu(os.getpid()),
            "broker A": process_cpu(beam_pid(self.a.rabbit.pidfile)),
            "broker B": process_cpu(beam_pid(self.b.rabbit.pidfile)),
            "postgres A": tree_cpu(self.a.pg.postmaster_pid()),
            "postgres B": tree_cpu(self.b.pg.postmaster_pid()),
            "node A": tree_cpu(self.nodes[0].pid),
            "node B": tree_cpu(self.nodes[1].pid),
        }
        return {name: cpu for name, cpu in procs.items() if cpu is not None}

    def run(self, target: str, txns: int) -> list[float]:
        port = self.a.rabbit.amqp_port if target == "direct" else self.a.amqp_port
        params = pika.ConnectionParameters("127.0.0.1", port, VPN)
        conn = pika.BlockingConnection(params)
        ch = conn.channel()
        ch.tx_select()
        body = b"x" * self.opts.size
        props = pika.BasicProperties(delivery_mode=2)
        latencies = []
        for _ in range(txns):
            for _ in range(self.opts.per_txn):
                ch.basic_publish("", QUEUE, body, props)
            t0 = time.perf_counter()
            ch.tx_commit()
            latencies.append(time.perf_counter() - t0)
        conn.close()
        return latencies

    def check_replicated(self, expected: int) -> None:
        def done() -> bool:
            ledger = self._scalar(self.a, "SELECT ledger_index FROM vpn_state")
            applied = self._scalar(self.b, "SELECT applied_index FROM vpn_state")
            return ledger == applied == expected

        self._wait(done, 60)
        doubt = self._scalar(self.a, "SELECT count(*) FROM txn_log WHERE state = 'prepared'")
        if doubt:
            raise BenchError(f"{doubt} transactions left in doubt")

    def close(self, logs: Path | None) -> None:
        for node in reversed(self.nodes):
            node.stop()
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            for node in self.nodes:
                with contextlib.suppress(OSError):
                    shutil.copy(node.log, logs / node.log.name)
        self.sites.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--txns", type=int, default=100, help="transactions per run (default 100)")
    p.add_argument("--per-txn", type=int, default=10, help="publishes per transaction")
    p.add_argument("--size", type=int, default=1024, help="body bytes")
    p.add_argument("--logs", type=Path, metavar="DIR", help="copy the node logs here at exit")
    p.add_argument(
        "--py-spy",
        type=Path,
        metavar="DIR",
        help="sample both nodes with py-spy for the whole run (node-a.txt, node-b.txt)",
    )
    p.add_argument("--check", action="store_true", help="exit 1 when the added p50 is over 5 ms")
    opts = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"load average before start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    bench = Bench(opts)
    try:
        bench.start()
        spies = []
        if opts.py_spy is not None:
            opts.py_spy.mkdir(parents=True, exist_ok=True)
            for node in bench.nodes:
                assert node.pid is not None  # noqa: S101 - started above
                spies.append(
                    (node.name, start_py_spy(node.pid, opts.py_spy / f"node-{node.name}.txt"))
                )
        got: dict[str, list[float]] = {"direct": [], "plugin": []}
        cpu: dict[str, dict[str, float]] = {"direct": {}, "plugin": {}}
        events = 0
        for r in range(opts.rounds):
            for target in ("direct", "plugin") if r % 2 == 0 else ("plugin", "direct"):
                before = bench.cpu()
                lat = bench.run(target, opts.txns)
                after = bench.cpu()
                got[target] += lat
                for name, spent in after.items():
                    if name in before:
                        cpu[target][name] = cpu[target].get(name, 0.0) + spent - before[name]
                if target == "plugin":
                    events += opts.txns * opts.per_txn  # one ledger event per publish
                print(
                    f"round {r + 1}: {target:6} p50 {1000 * statistics.median(lat):6.2f} ms"
                    f"  p99 {1000 * _percentile(lat, 0.99):6.2f} ms"
                )
            bench.check_replicated(events)
        for name, spy in spies:
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
                summarise_py_spy(opts.py_spy / f"node-{name}.txt", label=f"node {name}")
        d50, d99 = statistics.median(got["direct"]), _percentile(got["direct"], 0.99)
        p50, p99 = statistics.median(got["plugin"]), _percentile(got["plugin"], 0.99)
        added = 1000 * (p50 - d50)
        print(
            f"\n{opts.per_txn} x {opts.size} B persistent per transaction, "
            f"{opts.rounds} x {opts.txns} transactions per target, sync-mode VPN"
        )
        print(f"tx.commit direct      p50 {1000 * d50:6.2f} ms  p99 {1000 * d99:6.2f} ms")
        print(f"tx.commit via plugin  p50 {1000 * p50:6.2f} ms  p99 {1000 * p99:6.2f} ms")
        verdict = "ok" if added <= TARGET_ADDED_P50_MS else "ABOVE TARGET"
        print(
            f"added p50 {added:+.2f} ms (target <= {TARGET_ADDED_P50_MS:g} ms: {verdict}), "
            f"added p99 {1000 * (p99 - d99):+.2f} ms"
        )
        txns = opts.rounds * opts.txns
        print("CPU per transaction (ms; the whole loop, publishes included):")
        for name in cpu["plugin"]:
            direct = cpu["direct"].get(name, 0.0) * 1000 / txns
            plugin = cpu["plugin"][name] * 1000 / txns
            print(f"  {name:10}  direct {direct:6.2f}  via plugin {plugin:6.2f}")
        total = {t: sum(c.values()) * 1000 / txns for t, c in cpu.items()}
        print(f"  {'all':10}  direct {total['direct']:6.2f}  via plugin {total['plugin']:6.2f}")
        return 1 if opts.check and added > TARGET_ADDED_P50_MS else 0
    except (BenchError, HarnessError) as e:
        print(f"bench/transactions.py: {e}", file=sys.stderr)
        return 1
    finally:
        bench.close(opts.logs)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
