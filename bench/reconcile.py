"""How long reconciliation takes to find divergence, against a plain Spark
JDBC read of both sites' live state, in one run.

The issue's bar: with 1,000,000 live 1 KiB messages per site and divergence
injected, finding it takes at most 2.5x the time of a plain Spark JDBC read
of both sites' live state (every column, bodies included) in the same run;
and the absolute time with ``local[2]`` on this machine. Both comparison
methods run side by side:

* **pushdown** — each PostgreSQL computes per (queue, segment) a count and a
  digest sum; only those rows cross to Spark; the differing segments are
  read again as (key, digest) rows;
* **jdbc** — Spark's JDBC source reads every row (4 parallel sessions per
  site in one snapshot), Spark computes the digests and the segments;
* **plain read** — the baseline: the same JDBC source reads every row of
  both sites (4 sessions each) and sums the body lengths, so every byte
  crosses.

"Find" is the job's first pass and its re-check (``Reconciler.compare`` and
``recheck``): what ``vpnrepl reconcile`` does before it repairs or checks
the broker. The Spark session is started once and shared (its start, about
8 s, is printed separately; a ``vpnrepl reconcile`` pays it once per run).
Each round runs the three in rotating order, so drift of the machine hits
all of them; the script checks that every method found exactly what was
injected. Timings are printed, never asserted.

Set-up: two private PostgreSQL clusters (``LocalSites``; no RabbitMQ, no
node), the schema, VPN ``bench`` active on site A and standby on site B,
``--messages`` live rows of ``--size``-byte bodies over 4 queues on both
(generated inside PostgreSQL), then on B: ``--inject`` rows deleted, as
many bodies altered, half as many extra rows.

Run from the repository root: ``.venv/bin/python bench/reconcile.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import psycopg

# bench/ is first on sys.path when this runs as a script, and bench/bridge.py
# (the bridge benchmark) would shadow the bridge package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge import (
    VpnSettings,  # noqa: E402
    live_rows_query,  # noqa: E402
)
from plugin import DEFAULT_JDBC_JAR, ReconcileConfig, SiteConfig  # noqa: E402
from plugin.devtools import LocalSites  # noqa: E402
from plugin.ops import connect, enable_vpn  # noqa: E402
from plugin.reconcile import Reconciler, ReconcileResult, SiteSnapshot, SparkRun  # noqa: E402
from sql import migrate  # noqa: E402

VPN = "bench"
QUEUES = 4

_FILL = """
INSERT INTO live_message (vpn, queue, repl_id, publish_index, exchange, routing_key,
                          properties, body)
SELECT %(vpn)s, 'q' || (g %% %(queues)s),
       decode('0000000000000001' || lpad(to_hex(g), 16, '0'), 'hex'), g,
       'events', 'order.created', '\\x10000209'::bytea || int8send(g),
       substring(decode(repeat(md5(g::text), %(reps)s), 'hex') FROM 1 FOR %(size)s)
FROM generate_series(1, %(messages)s) AS g
"""


def prepare(dsn: str, role: str, messages: int, size: int) -> None:
    migrate(dsn)
    with connect(dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args(VPN, role))
        conn.execute("ALTER TABLE live_message SET UNLOGGED")  # loads faster; reads the same
        conn.execute(
            _FILL,
            {"vpn": VPN, "queues": QUEUES, "messages": messages, "size": size,
             "reps": size // 16 + 1},
        )  # fmt: skip
        conn.execute("ANALYZE live_message")


def inject(dsn: str, n: int) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as db:
        gone = db.execute(
            "DELETE FROM live_message WHERE vpn = %s AND publish_index %% 9973 = 1"
            " AND publish_index <= %s * 9973",
            (VPN, n),
        ).rowcount
        altered = db.execute(
            "UPDATE live_message SET body = body || 'x' WHERE vpn = %s"
            " AND publish_index %% 9973 = 5 AND publish_index <= %s * 9973",
            (VPN, n),
        ).rowcount
        extra = db.execute(
            "INSERT INTO live_message SELECT vpn, queue, decode('00000000000000ff' ||"
            " substring(encode(repl_id, 'hex') FROM 17), 'hex'), publish_index, exchange,"
            " routing_key, properties, body FROM live_message WHERE vpn = %s"
            " AND publish_index %% 9973 = 7 AND publish_index <= %s * 9973",
            (VPN, n // 2),
        ).rowcount
    return {"missing_on_standby": gone, "differs": altered, "extra_on_standby": extra}


def plain_read(spark: SparkRun, sites: list[SiteSnapshot]) -> int:
    """Both sites' rows, every column, in one Spark job (as the
    comparison reads them: side by side, 4 sessions per site)."""
    from pyspark.sql import functions as F  # noqa: N812

    frames = [spark.read_jdbc(s, live_rows_query(VPN, 1024, 4), ("part", 4, 4)) for s in sites]
    row = frames[0].unionByName(frames[1]).agg(F.count("*"), F.sum(F.length("body"))).first()
    return int(row[0])


def find(job: Reconciler, spark: SparkRun) -> ReconcileResult:
    result = ReconcileResult(VPN, job.method, datetime.now(UTC))
    candidates = job.compare(spark, result)
    result.found, result.in_flight = job.recheck(candidates, result.active_index)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=1_000_000, help="live rows per site")
    p.add_argument("--size", type=int, default=1024, help="body bytes (default 1024)")
    p.add_argument("--inject", type=int, default=100, help="rows deleted and altered on B")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    p.add_argument("--segments", type=int, default=1024, help="segments (default 1024)")
    args = p.parse_args(argv)

    sites = LocalSites()
    try:
        t0 = time.monotonic()
        sites.a.pg.start()
        sites.b.pg.start()
        for site in (sites.a, sites.b):
            site.pg.reset()
        a_dsn, b_dsn = sites.a.pg.dsn(), sites.b.pg.dsn()
        prepare(a_dsn, "active", args.messages, args.size)
        prepare(b_dsn, "standby", args.messages, args.size)
        injected = inject(b_dsn, args.inject)
        print(
            f"{args.messages} live rows of {args.size} bytes per site loaded in "
            f"{time.monotonic() - t0:.0f} s; injected on B: {injected}",
            flush=True,
        )
        cfg = SiteConfig(
            path="bench", site_name="a", amqp_urls=("amqp://x@127.0.0.1/",),
            management_urls=("http://x@127.0.0.1/",), listen_amqp=None,  # type: ignore[arg-type]
            listen_bridge=None, listen_admin=None,  # type: ignore[arg-type]
            store_dsn=a_dsn, peer_bridge=None, tls=None, peer_store_dsn=b_dsn,
            reconcile=ReconcileConfig(jdbc_jar=DEFAULT_JDBC_JAR),
        )  # fmt: skip
        jobs = {
            m: Reconciler(cfg, VPN, method=m, master=args.master, segments=args.segments)
            for m in ("pushdown", "jdbc")
        }
        t0 = time.monotonic()
        with SparkRun(args.master, DEFAULT_JDBC_JAR) as spark:
            print(f"Spark ({args.master}) up in {time.monotonic() - t0:.1f} s", flush=True)
            times: dict[str, list[float]] = {"plain read": [], "pushdown": [], "jdbc": []}
            order = list(times)
            for r in range(args.rounds):
                for name in order[r % 3 :] + order[: r % 3]:
                    t = time.monotonic()
                    if name == "plain read":
                        snaps = [
                            SiteSnapshot(a_dsn, VPN, "active"),
                            SiteSnapshot(b_dsn, VPN, "standby"),
                        ]
                        try:
                            rows = plain_read(spark, snaps)
                        finally:
                            for s in snaps:
                                s.close()
                        note = f"{rows} rows"
                    else:
                        result = find(jobs[name], spark)
                        got = {k: result.count(k) for k in injected}
                        if got != injected:
                            print(f"  {name} found {got}, injected {injected}", file=sys.stderr)
                            return 1
                        note = f"{result.dirty_segments} dirty segments, found {got}"
                    took = time.monotonic() - t
                    times[name].append(took)
                    print(f"round {r + 1}: {name:10s} {took:6.1f} s  ({note})", flush=True)
        base = statistics.median(times["plain read"])
        print(f"\nmedians over {args.rounds} rounds, {args.master}, {os.cpu_count()} CPUs:")
        for name, ts in times.items():
            med = statistics.median(ts)
            ratio = med / base
            bar = (
                ""
                if name == "plain read"
                else ("  (target <= 2.5x)" if ratio <= 2.5 else "  ABOVE TARGET 2.5x")
            )
            print(f"  {name:10s} {med:6.1f} s  {ratio:4.2f}x the plain read{bar}")
        return 0
    finally:
        sites.close()


if __name__ == "__main__":
    sys.exit(main())
