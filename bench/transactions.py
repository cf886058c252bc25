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

**The floor** — a third target, in the same run: what the steps the issue
names cost on this machine with no vpn-replication code on the path. A
sync-mode commit must, in this order, (1) make the events durable on the
active site and on the standby (two databases, at the same time), (2)
commit the broker with a commit marker in the same broker transaction, (3)
make the decision durable on both sites with the standby's apply: on A the
events as ledger rows, the ledger index and the coordinator row's move; on
B the messages as ``live_message`` rows, the applied index and the
participant row's move (again at the same time). The floor target does
exactly that: the client talks to RabbitMQ A directly, and two writer
processes, one per site (a ``floor`` database with the real schema in each
site's PostgreSQL), do the database steps when told over a pipe —
parameters built before the clock starts, each step one prepared,
autocommitted statement (rows through ``unnest`` of arrays): one round
trip and one commit per step and site. A pipe message stands in for the
bridge, a writer process for each site's node. Nothing there relays AMQP
frames, encodes events or keeps the state a real node needs, so the
floor's added p50 bounds from below what any implementation of these steps
in this stack (Python, psycopg, PostgreSQL, on one machine with everything
else) can reach here: when it is above the bar, the bar cannot be met on
this machine.

The client is pika's ``BlockingConnection`` on every path (the same client
overhead cancels out in the difference); only the ``tx.commit`` call (for
the floor: the three steps) is timed, the publishes before it are not. The
order of the targets rotates per round, so drift hits all of them. After
each listener run the script checks that the ledger grew by exactly 10
events per transaction and that the standby applied them all, and that no
transaction is left in doubt.

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
import uuid
from pathlib import Path

import pika
import psycopg
from _common import (
    BenchError,
    SpanCollector,
    beam_pid,
    percentile,
    process_cpu,
    start_py_spy,
    start_ready,
    summarise_py_spy,
    tree_cpu,
    vpnrepl,
)

from bridge import VpnSettings
from plugin.devtools import HarnessError, LocalNode, LocalSite, LocalSites
from plugin.ops import connect, enable_vpn
from sql import migrate

VPN = "orders"
#: the coordinator's spans (txn/local/_coordinator.py): the whole, then its phases
PHASES = ("txn", "txn.prepare", "txn.broker_commit", "txn.decision", "txn.standby_commit")
QUEUE = "bench.txn"
MARKERS = "bench.txn-floor-markers"
FLOOR_DB = "floor"
TARGETS = ("direct", "floor", "plugin")
TARGET_ADDED_P50_MS = 5.0

# ---------------------------------------------------------------- the floor's writers

_PREPARE = (
    "INSERT INTO txn_log (txid, vpn, side, state, events, ledger_floor)"
    " VALUES (%b, %b, %b, 'prepared', %b, 0)"
)
_COMMIT_A = """
WITH rows AS (
    INSERT INTO ledger (vpn, idx, epoch, kind, event)
    SELECT %(vpn)b, i, 1, 'publish', e
    FROM unnest(%(idx)b::bigint[], %(events)b::bytea[]) AS t(i, e)
), decided AS (
    UPDATE txn_log SET state = 'committed', updated_at = now() WHERE txid = %(txid)b
)
UPDATE vpn_state SET ledger_index = %(last)b WHERE vpn = %(vpn)b
"""
_COMMIT_B = """
WITH rows AS (
    INSERT INTO live_message (vpn, queue, repl_id, publish_index, exchange, routing_key,
                              properties, body)
    SELECT %(vpn)b, %(queue)b, r, i, '', %(queue)b, %(properties)b, b
    FROM unnest(%(ids)b::bytea[], %(idx)b::bigint[], %(bodies)b::bytea[]) AS t(r, i, b)
), decided AS (
    UPDATE txn_log SET state = 'committed', updated_at = now() WHERE txid = %(txid)b
)
UPDATE vpn_state SET applied_index = %(last)b WHERE vpn = %(vpn)b
"""


def writer_main(site: str, dsn: str, txns: int, per_txn: int, size: int, first: int) -> int:
    """One site's floor writer: build every transaction's parameters, say
    ``ready``, then for each line ``prepare N`` / ``commit N`` on stdin do
    that step of transaction N as one autocommitted statement and answer
    ``ok``."""
    body = os.urandom(size)
    properties = b"\x90\x00\x00\x02"  # delivery mode 2, as the client sends
    steps = []
    for t in range(txns):
        txid = str(uuid.uuid4())
        idx = list(range(first + t * per_txn, first + (t + 1) * per_txn))
        ids = [n.to_bytes(16, "big") for n in idx]
        # an encoded Published event is about the body plus ~80 bytes
        events = [rid + properties + QUEUE.encode() + body for rid in ids]
        prepare = (txid, VPN, "coordinator" if site == "a" else "participant", b"".join(events))
        commit: dict[str, object] = {"vpn": VPN, "txid": txid, "idx": idx, "last": idx[-1]}
        if site == "a":
            commit["events"] = events
        else:
            commit |= {"queue": QUEUE, "properties": properties, "ids": ids}
            commit["bodies"] = [body] * per_txn
        steps.append((prepare, commit))
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        print("ready", flush=True)
        cpu = time.process_time()
        for line in sys.stdin:
            step, n = line.split()
            prepare, commit = steps[int(n)]
            if step == "prepare":
                cur.execute(_PREPARE, prepare, prepare=True)
            else:
                cur.execute(_COMMIT_A if site == "a" else _COMMIT_B, commit, prepare=True)
                if cur.rowcount != 1:
                    print(f"vpn_state of {VPN} not updated", flush=True)
                    return 1
            print("ok", flush=True)
        print(f"cpu {time.process_time() - cpu:.6f}", flush=True)  # the steps' CPU only
    return 0


class Writer:
    """A floor writer subprocess, started and made ready before the clock starts."""

    def __init__(self, site: str, dsn: str, opts: argparse.Namespace, first: int) -> None:
        argv = [sys.executable, __file__, "--writer", site, dsn]
        argv += [str(opts.txns), str(opts.per_txn), str(opts.size), str(first)]
        self.proc = start_ready(argv, f"floor writer {site}")
        assert self.proc.stdin is not None and self.proc.stdout is not None  # noqa: S101
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout

    def tell(self, step: str, n: int) -> None:
        self.stdin.write(f"{step} {n}\n".encode())
        self.stdin.flush()

    def done(self) -> None:
        line = self.stdout.readline().strip()
        if line != b"ok":
            raise BenchError(f"floor writer failed (exit {self.proc.poll()}): {line!r}")

    def close(self) -> float:
        """Stop the writer; returns the CPU seconds its steps took."""
        self.stdin.close()
        line = self.stdout.readline().split()
        if self.proc.wait(60) != 0 or len(line) != 2 or line[0] != b"cpu":
            raise BenchError(f"floor writer exited with {self.proc.returncode}: {line!r}")
        return float(line[1])


def _floor_database(site: LocalSite, role: str) -> str:
    """A ``floor`` database with the real schema next to the site's own."""
    with psycopg.connect(site.pg.dsn("postgres"), autocommit=True) as db:
        db.execute(f"CREATE DATABASE {FLOOR_DB}")
    dsn = site.pg.dsn(FLOOR_DB)
    migrate(dsn)
    with connect(dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args(VPN, role))
    return dsn


# ---------------------------------------------------------------- the runs


class Bench:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.sites = LocalSites()
        self.a, self.b = self.sites.a, self.sites.b
        self.nodes: list[LocalNode] = []
        self.floor_dsns: list[str] = []
        self.floor_index = 0  # the last ledger index the floor writers used
        self.floor_steps: dict[str, list[float]] = {"prepare": [], "broker": [], "commit": []}
        #: CPU seconds per process over the last run's transactions
        self.last_cpu: dict[str, float] = {}
        #: receives node A's transaction spans (``--phases``)
        self.spans = SpanCollector() if opts.phases else None

    def start(self) -> None:
        t0 = time.monotonic()
        self.sites.start()
        self.a.rabbit.add_vhost(VPN)
        for queue in (QUEUE, MARKERS):
            self.a.rabbit.api("PUT", f"queues/{VPN}/{queue}", {"durable": True})
        self.floor_dsns = [_floor_database(self.a, "active"), _floor_database(self.b, "standby")]
        base = self.sites.base
        cfg_a = self.a.write_config(base / "a.toml", peer=self.b, dial=False)
        cfg_b = self.b.write_config(base / "b.toml", peer=self.a)
        if self.spans is not None:
            with cfg_a.open("a") as f:
                f.write(f'\n[telemetry]\notlp_traces_url = "{self.spans.url}"\n')
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
        """One run's latencies: ``tx.commit`` (direct, plugin) or the three
        steps (floor, each step's also kept in ``floor_steps``)."""
        port = self.a.rabbit.amqp_port if target != "plugin" else self.a.amqp_port
        writers: list[Writer] = []
        if target == "floor":
            first = self.floor_index + 1
            self.floor_index += txns * self.opts.per_txn
            writers = [
                Writer(site, dsn, self.opts, first)
                for site, dsn in zip("ab", self.floor_dsns, strict=True)
            ]
        params = pika.ConnectionParameters("127.0.0.1", port, VPN)
        conn = pika.BlockingConnection(params)
        ch = conn.channel()
        ch.tx_select()
        body = b"x" * self.opts.size
        props = pika.BasicProperties(delivery_mode=2)
        latencies = []
        before = self.cpu()
        for n in range(txns):
            for _ in range(self.opts.per_txn):
                ch.basic_publish("", QUEUE, body, props)
            t0 = time.perf_counter()
            if not writers:
                ch.tx_commit()
                latencies.append(time.perf_counter() - t0)
                continue
            for w in writers:
                w.tell("prepare", n)
            for w in writers:
                w.done()
            t1 = time.perf_counter()
            ch.basic_publish("", MARKERS, str(n).encode(), props)
            ch.tx_commit()
            t2 = time.perf_counter()
            for w in writers:
                w.tell("commit", n)
            for w in writers:
                w.done()
            t3 = time.perf_counter()
            latencies.append(t3 - t0)
            for step, took in zip(self.floor_steps, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                self.floor_steps[step].append(took)
        after = self.cpu()
        self.last_cpu = {name: after[name] - before[name] for name in after if name in before}
        if writers:
            ch.queue_purge(MARKERS)
            ch.tx_commit()
        conn.close()
        if writers:
            self.last_cpu["floor writers"] = sum(w.close() for w in writers)
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

    def stop_nodes(self) -> None:
        for node in reversed(self.nodes):
            if node.alive():
                node.stop()

    def phases(self) -> None:
        """Print the p50 of each transaction span node A exported (the
        nodes flush their spans when they stop)."""
        if self.spans is None:
            return
        self.stop_nodes()
        print("node A's spans per transaction (p50, ms; txn.* are its phases in order):")
        for name in PHASES:
            took = self.spans.durations.get(name, [])
            if took:
                print(f"  {name:20} {1000 * statistics.median(took):6.2f}  ({len(took)} spans)")
        self.spans.close()

    def close(self, logs: Path | None) -> None:
        self.stop_nodes()
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            for node in self.nodes:
                with contextlib.suppress(OSError):
                    shutil.copy(node.log, logs / node.log.name)
        self.sites.close()


def report(
    bench: Bench,
    opts: argparse.Namespace,
    got: dict[str, list[float]],
    cpu: dict[str, dict[str, float]],
) -> float:
    """Print the run's results; returns the plugin's added p50 in ms."""
    d50, d99 = statistics.median(got["direct"]), percentile(got["direct"], 0.99)
    f50, f99 = statistics.median(got["floor"]), percentile(got["floor"], 0.99)
    p50, p99 = statistics.median(got["plugin"]), percentile(got["plugin"], 0.99)
    added, floor = 1000 * (p50 - d50), 1000 * (f50 - d50)
    print(
        f"\n{opts.per_txn} x {opts.size} B persistent per transaction, "
        f"{opts.rounds} x {opts.txns} transactions per target, sync-mode VPN"
    )
    print(f"tx.commit direct      p50 {1000 * d50:6.2f} ms  p99 {1000 * d99:6.2f} ms")
    steps = ", ".join(
        f"{k} {1000 * statistics.median(t):.2f}" for k, t in bench.floor_steps.items()
    )
    print(f"the floor's steps     p50 {1000 * f50:6.2f} ms  p99 {1000 * f99:6.2f} ms ({steps})")
    print(f"tx.commit via plugin  p50 {1000 * p50:6.2f} ms  p99 {1000 * p99:6.2f} ms")
    verdict = "ok" if added <= TARGET_ADDED_P50_MS else "ABOVE TARGET"
    print(
        f"added p50 {added:+.2f} ms (target <= {TARGET_ADDED_P50_MS:g} ms: {verdict}), "
        f"added p99 {1000 * (p99 - d99):+.2f} ms"
    )
    reachable = "below the target" if floor <= TARGET_ADDED_P50_MS else "ABOVE the target"
    print(
        f"floor: the issue's steps alone add p50 {floor:+.2f} ms on this machine "
        f"({reachable}); the plugin adds {added - floor:+.2f} ms to them"
    )
    txns = opts.rounds * opts.txns
    print("CPU per transaction (ms; publishes included, the floor writers' start-up not):")
    names = [n for n in cpu["plugin"] if n != "floor writers"] + ["floor writers"]
    for name in names:
        row = "  ".join(f"{t} {cpu[t].get(name, 0.0) * 1000 / txns:6.2f}" for t in TARGETS)
        print(f"  {name:13}  {row}")
    total = "  ".join(f"{t} {sum(cpu[t].values()) * 1000 / txns:6.2f}" for t in TARGETS)
    print(f"  {'all':13}  {total}")
    return added


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--writer"]:
        site, dsn = argv[1:3]
        txns, per_txn, size, first = (int(x) for x in argv[3:7])
        return writer_main(site, dsn, txns, per_txn, size, first)
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
    p.add_argument(
        "--phases",
        action="store_true",
        help="export node A's transaction spans to a receiver here and print each phase's p50"
        " (the export costs the node some CPU)",
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
        got: dict[str, list[float]] = {t: [] for t in TARGETS}
        cpu: dict[str, dict[str, float]] = {t: {} for t in TARGETS}
        events = 0
        for r in range(opts.rounds):
            for target in TARGETS[r % 3 :] + TARGETS[: r % 3]:
                lat = bench.run(target, opts.txns)
                got[target] += lat
                for name, spent in bench.last_cpu.items():
                    cpu[target][name] = cpu[target].get(name, 0.0) + spent
                if target == "plugin":
                    events += opts.txns * opts.per_txn  # one ledger event per publish
                print(
                    f"round {r + 1}: {target:6} p50 {1000 * statistics.median(lat):6.2f} ms"
                    f"  p99 {1000 * percentile(lat, 0.99):6.2f} ms"
                )
            bench.check_replicated(events)
        for name, spy in spies:
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
                summarise_py_spy(opts.py_spy / f"node-{name}.txt", label=f"node {name}")
        added = report(bench, opts, got, cpu)
        bench.phases()
        return 1 if opts.check and added > TARGET_ADDED_P50_MS else 0
    except (BenchError, HarnessError) as e:
        print(f"bench/transactions.py: {e}", file=sys.stderr)
        return 1
    finally:
        bench.close(opts.logs)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
