"""The least ``bench/transactions.py`` could add to ``tx.commit`` on this machine.

``bench/transactions.py`` times a client's ``tx.commit`` (10 persistent
1 KiB publishes per transaction) through two replicating sites, sync mode,
against the same client talking to the broker directly. The issue names
what a replicated commit must do before the client hears ``commit-ok``,
and each of these steps waits for the one before it:

1. **prepare** — the transaction's events durable on the active site and
   on the standby (two databases, at the same time);
2. **broker commit** — the held ``tx.commit`` with a commit marker
   published in the same broker transaction;
3. **commit** — the decision durable on both sites and applied by the
   standby: on A the events as ledger rows with the ledger index and the
   coordinator row's move, on B the messages as ``live_message`` rows with
   the applied index and the participant row's move (two databases, at the
   same time).

This script does exactly that without any vpn-replication code on the
path: the client (pika's ``BlockingConnection``, as in the benchmark)
talks to RabbitMQ A directly, and two writer processes, one per site's
PostgreSQL (the real schema, ``vpnrepl init``), do the database work when
told over a pipe — parameters built before the clock starts, each step
one prepared, autocommitted statement (rows through ``unnest`` of binary
arrays), so one round trip and one commit per step and site. A pipe
message stands in for the bridge, a writer process for each site's node.
Nothing here relays AMQP frames, parses them, encrypts, or keeps the
in-memory state a real node needs; so the added p50 printed here bounds
from below what ``bench/transactions.py`` can print on this machine for an
implementation in this stack (Python, psycopg, PostgreSQL) that keeps the
steps the issue names in that order.

Run from the repository root: ``.venv/bin/python bench/txn_floor.py``.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pika
import psycopg
from _common import BenchError, vpnrepl

from plugin._localsites import HarnessError, LocalSites

VPN = "orders"
QUEUE = "bench.txn-floor"
MARKERS = "bench.txn-floor-markers"
TARGET_ADDED_P50_MS = 5.0

_PREPARE = (
    "INSERT INTO txn_log (txid, vpn, side, state, events, ledger_floor)"
    " VALUES (%b, %b, %b, 'prepared', %b, 0)"
)
#: each site's commit step is one statement (one round trip, one commit)
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


# ---------------------------------------------------------------- the writers


def writer_main(site: str, dsn: str, txns: int, per_txn: int, size: int, first: int) -> int:
    """One site's writer: build every transaction's parameters, say
    ``ready``, then for each line ``prepare N`` / ``commit N`` on stdin do
    that step of transaction N as one autocommitted statement (prepared,
    binary parameters) and answer ``ok``."""
    body = os.urandom(size)
    properties = b"\x90\x00\x00\x02"  # delivery mode 2, as the client sends
    steps = []
    for t in range(txns):
        txid = str(uuid.uuid4())
        idx = list(range(first + t * per_txn, first + (t + 1) * per_txn))
        ids = [_repl_id(n) for n in idx]
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
    return 0


class Writer:
    """A writer subprocess, started and made ready before the clock starts."""

    def __init__(self, site: str, dsn: str, txns: int, opts: argparse.Namespace, first: int):
        argv = [sys.executable, __file__, "--writer", site, dsn]
        argv += [str(txns), str(opts.per_txn), str(opts.size), str(first)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdin is not None and self.proc.stdout is not None  # noqa: S101
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        ready, _, _ = select.select([self.stdout], [], [], 120)
        line = self.stdout.readline().strip() if ready else b""
        if line != b"ready":
            self.proc.kill()
            raise BenchError(f"writer {site} did not start: {line!r}")

    def tell(self, step: str, n: int) -> None:
        self.stdin.write(f"{step} {n}\n".encode())
        self.stdin.flush()

    def done(self) -> None:
        line = self.stdout.readline().strip()
        if line != b"ok":
            raise BenchError(f"writer failed (exit {self.proc.poll()}): {line!r}")

    def close(self) -> None:
        self.stdin.close()
        if self.proc.wait(60) != 0:
            raise BenchError(f"writer exited with {self.proc.returncode}")


# ---------------------------------------------------------------- the runs


class Bench:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.sites = LocalSites()
        self.index = 0  # the last ledger index the writers used
        self.steps: dict[str, list[float]] = {"prepare": [], "broker commit": [], "commit": []}

    def start(self) -> None:
        t0 = time.monotonic()
        self.sites.start()
        a, b = self.sites.a, self.sites.b
        a.rabbit.add_vhost(VPN)
        for queue in (QUEUE, MARKERS):
            a.rabbit.api("PUT", f"queues/{VPN}/{queue}", {"durable": True})
        base = self.sites.base
        cfg_a = a.write_config(base / "a.toml")
        cfg_b = b.write_config(base / "b.toml", peer=a)
        vpnrepl(cfg_a, "init")
        vpnrepl(cfg_a, "vpn", "enable", VPN, "--role", "active", "--mode", "sync")
        vpnrepl(cfg_b, "init")
        vpnrepl(cfg_b, "vpn", "enable", VPN, "--role", "standby")
        print(f"two sites up in {time.monotonic() - t0:.0f} s (no nodes: none is used)")

    def run(self, mode: str, txns: int) -> list[float]:
        """One run's ``tx.commit`` latencies; each step's go into ``self.steps``."""
        opts = self.opts
        writers: list[Writer] = []
        if mode == "floor":
            first = self.index + 1
            self.index += txns * opts.per_txn
            writers = [
                Writer(site.name, site.pg.dsn(), txns, opts, first)
                for site in (self.sites.a, self.sites.b)
            ]
        conn = pika.BlockingConnection(
            pika.ConnectionParameters("127.0.0.1", self.sites.a.rabbit.amqp_port, VPN)
        )
        ch = conn.channel()
        ch.tx_select()
        body = b"x" * opts.size
        props = pika.BasicProperties(delivery_mode=2)
        latencies = []
        for n in range(txns):
            for _ in range(opts.per_txn):
                ch.basic_publish("", QUEUE, body, props)
            t0 = time.perf_counter()
            for w in writers:
                w.tell("prepare", n)
            for w in writers:
                w.done()
            t1 = time.perf_counter()
            if writers:
                ch.basic_publish("", MARKERS, str(n).encode(), props)
            ch.tx_commit()
            t2 = time.perf_counter()
            for w in writers:
                w.tell("commit", n)
            for w in writers:
                w.done()
            t3 = time.perf_counter()
            latencies.append(t3 - t0)
            if writers:
                self.steps["prepare"].append(t1 - t0)
                self.steps["broker commit"].append(t2 - t1)
                self.steps["commit"].append(t3 - t2)
        ch.queue_purge(QUEUE)
        ch.queue_purge(MARKERS)
        ch.tx_commit()
        conn.close()
        for w in writers:
            w.close()
        return latencies


def _repl_id(n: int) -> bytes:
    return n.to_bytes(16, "big")


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
    opts = p.parse_args(argv)
    if min(opts.rounds, opts.txns, opts.per_txn, opts.size) < 1:
        p.error("--rounds, --txns, --per-txn and --size must be >= 1")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"load average before start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    bench = Bench(opts)
    try:
        bench.start()
        got: dict[str, list[float]] = {"direct": [], "floor": []}
        for r in range(opts.rounds):
            for mode in ("direct", "floor") if r % 2 == 0 else ("floor", "direct"):
                lat = bench.run(mode, opts.txns)
                got[mode] += lat
                print(f"round {r + 1}: {mode:6} p50 {1000 * statistics.median(lat):6.2f} ms")
        d50, f50 = statistics.median(got["direct"]), statistics.median(got["floor"])
        added = 1000 * (f50 - d50)
        print(
            f"\n{opts.per_txn} x {opts.size} B persistent per transaction, "
            f"{opts.rounds} x {opts.txns} transactions per mode"
        )
        print(f"tx.commit direct                 p50 {1000 * d50:6.2f} ms")
        print(f"prepare + commit + both commits  p50 {1000 * f50:6.2f} ms")
        for step, times in bench.steps.items():
            print(f"  {step:14} p50 {1000 * statistics.median(times):6.2f} ms")
        verdict = "below" if added <= TARGET_ADDED_P50_MS else "ABOVE"
        print(
            f"floor of the added p50 {added:+.2f} ms ({verdict} the issue's "
            f"{TARGET_ADDED_P50_MS:g} ms before any vpn-replication code runs)"
        )
        return 0
    except (BenchError, HarnessError, psycopg.Error) as e:
        print(f"bench/txn_floor.py: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench/txn_floor.py: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        bench.sites.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
