"""``vpnrepl reconcile``: find (and repair) where the standby's live state
differs from the active's. Runs on the active site.

Four steps, each explained in docs/behaviour.md, "Reconciliation": compare
(Spark: per (queue, segment) a count and a digest sum, computed in each
PostgreSQL, ``pushdown``, or by Spark, ``jdbc``; differing segments row by
row: ``missing_on_standby``, ``extra_on_standby``, ``differs``); re-check
(psycopg: keys the ledger entries between the two snapshots' indexes
touched are in flight, :func:`bridge.touched`); repair (``--repair``: through
the node as ``Repair`` frames, :meth:`bridge.ActiveBridge.repair`, then
re-checked); broker drift, with the uncertain publishes
(``plugin.node._uncertain``) counted beside it (README, "Reconciliation").
Each run is a ``reconcile_run`` row on the active, exported as metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg.types.json import Jsonb

from bridge import (
    DIFFERS,
    EXTRA_ON_STANDBY,
    KINDS,
    MISSING_ON_STANDBY,
    REFLECTED_INDEX,
    ROWS_OF_KEYS,
    Difference,
    LiveKey,
    TopicFilter,
    compare_rows,
    decode_event,
    live_rows_query,
    redact_url,
    segment_hashes_query,
    segment_rows_query,
    touched,
)
from bridge.broker import ManagementAPI, ManagementUnavailable
from bridge.store import applied_position, stored_ledger_index
from plugin._errors import ConfigError, PluginError
from plugin.config import SiteConfig
from plugin.topology import DEPTH_COLUMNS, ReplicationScope, replicable_depth

from ._spark import SiteSnapshot, SparkRun

__all__ = ["ReconcileResult", "Reconciler", "store_failed_run"]

log = logging.getLogger(__name__)

#: parallel JDBC sessions per site in the ``jdbc`` method
READ_PARTITIONS = 4
#: how long the re-check waits for the standby to pass the first pass's index
CATCH_UP_SECONDS = 60.0
#: how long the check after a repair waits for the standby to have applied it
REPAIR_SETTLE_SECONDS = 30.0


@dataclass
class ReconcileResult:
    """What one run found; :meth:`as_dict` is the ``--json`` object."""

    vpn: str
    method: str
    started_at: datetime
    rows_active: int = 0
    rows_standby: int = 0
    segments: int = 0
    dirty_segments: int = 0
    #: differences that persisted through the re-check (before any repair)
    found: list[Difference] = field(default_factory=list)
    #: differences left at the end of the run (after repair)
    remaining: list[Difference] = field(default_factory=list)
    repaired: int = 0
    in_flight: int = 0
    broker_drift: dict[str, dict[str, int]] = field(default_factory=dict)
    active_index: int = 0
    standby_index: int = 0
    seconds: float = 0.0

    def count(self, kind: str, which: Sequence[Difference] | None = None) -> int:
        return sum(1 for d in (self.found if which is None else which) if d.kind == kind)

    @property
    def agree(self) -> bool:
        return not self.remaining

    def as_dict(self) -> dict[str, Any]:
        return {
            "vpn": self.vpn,
            "method": self.method,
            "rows_active": self.rows_active,
            "rows_standby": self.rows_standby,
            "segments": self.segments,
            "dirty_segments": self.dirty_segments,
            **{kind: self.count(kind) for kind in KINDS},
            "repaired": self.repaired,
            "remaining": {kind: self.count(kind, self.remaining) for kind in KINDS},
            "in_flight": self.in_flight,
            "broker_drift": self.broker_drift,
            "active_index": self.active_index,
            "standby_index": self.standby_index,
            "seconds": round(self.seconds, 3),
            "differences": [
                {"kind": d.kind, "queue": d.queue, "repl_id": d.repl_id.hex()}
                for d in self.remaining[:100]
            ],
        }


Repairer = Callable[[str, list[LiveKey]], dict[str, Any]]


class Reconciler:
    """One ``reconcile`` run of a VPN on the active site."""

    def __init__(
        self,
        cfg: SiteConfig,
        vpn: str,
        *,
        method: str,
        master: str,
        segments: int,
        progress: bool = False,
    ) -> None:
        if cfg.peer_store_dsn is None:
            raise ConfigError(
                cfg.path, cfg.peer_store_key, "reconcile reads the standby's store: set it"
            )
        self.cfg, self.vpn, self.method = cfg, vpn, method
        self.master, self.segments, self.progress = master, segments, progress
        self.drift_wait = cfg.reconcile.drift_interval
        #: uncertain publishes still live, by queue, at the last drift reading
        self._uncertain: dict[str, list[bytes]] = {}
        self.peer_dsn: str = cfg.peer_store_dsn

    # -- the whole run -----------------------------------------------------------

    def run(
        self, repair: Repairer | None = None, retire: Repairer | None = None
    ) -> ReconcileResult:
        """``repair``: sends what differs to the standby; ``retire``: consumes
        the phantoms the broker drift shows (both through the node)."""
        try:
            return self._run(repair, retire)
        except psycopg.Error as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise PluginError(f"reconcile of VPN {self.vpn!r}: a store failed: {reason}") from e

    def _run(self, repair: Repairer | None, retire: Repairer | None) -> ReconcileResult:
        t0 = time.monotonic()
        result = ReconcileResult(self.vpn, self.method, datetime.now(UTC), segments=self.segments)
        candidates = self._compare(result)
        if candidates:
            found, in_flight = self.recheck(candidates, result.active_index)
            result.found, result.in_flight = found, in_flight
        result.remaining = list(result.found)
        if repair is not None and result.found:
            keys = [(d.queue, d.repl_id) for d in result.found]
            sent = repair(self.vpn, keys)
            log.info("VPN %s: repair sent: %s", self.vpn, sent)
            result.remaining = self._settled(keys_to_candidates(keys))
            result.repaired = len(result.found) - len(result.remaining)
        result.broker_drift = self.broker_drift()
        if retire is not None:
            self._retire(result.broker_drift, retire)
        result.seconds = time.monotonic() - t0
        return result

    def _settled(self, candidates: list[Difference]) -> list[Difference]:
        """What still differs of the repaired keys once the standby applied
        the repair: it is in the stream's order, after the entries sent
        before it, and acknowledges nothing of its own, so the keys are
        read again until they agree or :data:`REPAIR_SETTLE_SECONDS` pass."""
        deadline = time.monotonic() + REPAIR_SETTLE_SECONDS
        while True:
            remaining, _ = self.recheck(candidates, self._active_ledger_index())
            if not remaining or time.monotonic() > deadline:
                return remaining
            time.sleep(0.5)

    # -- 1. compare ----------------------------------------------------------------

    def _compare(self, result: ReconcileResult) -> list[Difference]:
        with SparkRun(self.master, self.cfg.reconcile.jdbc_jar, self.progress) as spark:
            try:
                return self.compare(spark, result)
            except (PluginError, psycopg.Error):
                raise
            except Exception as e:  # a Spark (py4j) error: one line, and where its log is
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise PluginError(
                    f"the Spark job failed: {first[:300]} (Spark's log: {spark.log_path})"
                ) from e

    def compare(self, spark: SparkRun, result: ReconcileResult) -> list[Difference]:
        """The first pass on ``spark``: each site in a snapshot of its own;
        fills ``result``'s counts and indexes, returns the candidates."""
        active = SiteSnapshot(self.cfg.store_dsn, self.vpn, "active")
        try:
            standby = SiteSnapshot(self.peer_dsn, self.vpn, "standby")
        except BaseException:
            active.close()
            raise
        result.active_index, result.standby_index = active.index, standby.index
        try:
            return self._compare_on(spark, active, standby, result)
        finally:
            spark.spark.catalog.clearCache()  # the jdbc method's cached digests
            active.close()
            standby.close()

    def _compare_on(
        self, run: SparkRun, active: SiteSnapshot, standby: SiteSnapshot, result: ReconcileResult
    ) -> list[Difference]:
        from pyspark.sql import functions as F  # noqa: N812 - Spark's own idiom

        run.phase("segment hashes")
        sites = {"a": active, "b": standby}
        # One DataFrame for both sites, so that one Spark job reads them side
        # by side (every partition of both on the available cores).
        rows = None
        if self.method == "pushdown":
            segs = _union(
                run.read_jdbc(
                    s,
                    segment_hashes_query(self.vpn, self.segments),
                    ("segment", self.segments, READ_PARTITIONS),
                ).withColumn("site", F.lit(name))
                for name, s in sites.items()
            )
        else:
            rows = _union(
                self._digests_jdbc(run, s).withColumn("site", F.lit(name))
                for name, s in sites.items()
            ).cache()
            segs = rows.groupBy("site", "queue", "segment").agg(
                F.count("*").alias("n"),
                F.sum(F.col("digest").cast("decimal(38,0)")).cast("string").alias("total"),
            )
        segs = segs.cache()
        for name, n in segs.groupBy("site").agg(F.sum("n")).collect():
            if name == "a":
                result.rows_active = int(n or 0)
            else:
                result.rows_standby = int(n or 0)
        a = segs.where(F.col("site") == "a").alias("a")
        b = segs.where(F.col("site") == "b").alias("b")
        dirty = (
            a.join(b, ["queue", "segment"], "full_outer")
            .where(
                ~(
                    F.col("a.n").eqNullSafe(F.col("b.n"))
                    & F.col("a.total").eqNullSafe(F.col("b.total"))
                )
            )
            .select("queue", "segment")
        )
        dirty_rows = [(r["queue"], int(r["segment"])) for r in dirty.collect()]
        result.dirty_segments = len(dirty_rows)
        if not dirty_rows:
            return []
        run.phase("differing segments")
        if rows is None:
            keys = _union(
                run.read_jdbc(
                    s, segment_rows_query(self.vpn, self.segments, dirty_rows)
                ).withColumn("site", F.lit(name))
                for name, s in sites.items()
            )
        else:
            wanted = run.spark.createDataFrame(dirty_rows, "queue string, segment int")
            keys = rows.join(F.broadcast(wanted), ["queue", "segment"])
        keys = keys.select("site", "queue", "repl_id", "digest")
        keys_a = keys.where(F.col("site") == "a").alias("a")
        keys_b = keys.where(F.col("site") == "b").alias("b")
        differing = (
            keys_a.join(keys_b, ["queue", "repl_id"], "full_outer")
            .where(~F.col("a.digest").eqNullSafe(F.col("b.digest")))
            .select(
                "queue",
                "repl_id",
                F.col("a.digest").isNull().alias("no_a"),
                F.col("b.digest").isNull().alias("no_b"),
            )
        )
        out = []
        for r in differing.toLocalIterator():
            kind = EXTRA_ON_STANDBY if r["no_a"] else MISSING_ON_STANDBY if r["no_b"] else DIFFERS
            out.append(Difference(kind, r["queue"], bytes(r["repl_id"])))
        return out

    def _digests_jdbc(self, run: SparkRun, site: SiteSnapshot) -> Any:
        """Every live row read by Spark's JDBC source (in parallel sessions
        sharing the site's snapshot), reduced to key, segment and a digest
        Spark computes (the caller caches it, so the drill reads no row
        twice)."""
        from pyspark.sql import functions as F  # noqa: N812

        query = live_rows_query(self.vpn, self.segments, READ_PARTITIONS)
        rows = run.read_jdbc(site, query, ("part", READ_PARTITIONS, READ_PARTITIONS))
        digest = F.xxhash64(
            "repl_id", "publish_index", "exchange", "routing_key", "properties", "body"
        )
        return rows.select("queue", "repl_id", "segment", digest.alias("digest"))

    # -- 2. re-check ------------------------------------------------------------------

    def recheck(
        self, candidates: Sequence[Difference], after_index: int
    ) -> tuple[list[Difference], int]:
        """The candidates that still differ, read again once the standby has
        applied ``after_index``; and how many were in flight."""
        self._wait_standby(after_index)
        keys = [(d.queue, d.repl_id) for d in candidates]
        with psycopg.connect(self.cfg.store_dsn, connect_timeout=10) as a_conn:
            a_index, a_rows = _read_keys(a_conn, self.vpn, keys, "active")
        with psycopg.connect(self.peer_dsn, connect_timeout=10) as b_conn:
            b_index, b_rows = _read_keys(b_conn, self.vpn, keys, "standby")
        low, high = min(a_index, b_index), max(a_index, b_index)
        changed: set[LiveKey] = set()
        purged: set[str] = set()
        if high > low:
            changed, purged = self._touched_between(low, high)
        settled = [k for k in keys if k not in changed and k[0] not in purged]
        return compare_rows(a_rows, b_rows, settled), len(keys) - len(settled)

    def _touched_between(self, low: int, high: int) -> tuple[set[LiveKey], set[str]]:
        with psycopg.connect(self.cfg.store_dsn, connect_timeout=10) as conn:
            rows = conn.execute(
                "SELECT idx, event FROM ledger WHERE vpn = %s AND idx > %s AND idx <= %s"
                " ORDER BY idx",
                (self.vpn, low, high),
            ).fetchall()
        if len(rows) != high - low:
            raise PluginError(
                f"the active's ledger no longer holds entries {low + 1} to {high} of VPN "
                f"{self.vpn!r} (pruned): run reconcile again"
            )
        return touched(decode_event(bytes(data), self.vpn) for _, data in rows)

    def _wait_standby(self, index: int) -> None:
        deadline = time.monotonic() + CATCH_UP_SECONDS
        with psycopg.connect(self.peer_dsn, connect_timeout=10, autocommit=True) as conn:
            while True:
                found = applied_position(self.vpn).run(conn)
                if found is not None and found[0] >= index:
                    return
                if time.monotonic() > deadline:
                    log.warning(
                        "VPN %s: the standby did not reach index %d in %.0f s; re-checking anyway",
                        self.vpn,
                        index,
                        CATCH_UP_SECONDS,
                    )
                    return
                time.sleep(0.2)

    def _active_ledger_index(self) -> int:
        with psycopg.connect(self.cfg.store_dsn, connect_timeout=10) as conn:
            return stored_ledger_index(self.vpn).run(conn)

    # -- 4. broker drift --------------------------------------------------------------

    def broker_drift(self) -> dict[str, dict[str, int]]:
        """Queues of the scope whose broker count differs from the replicated
        live count the same way in two readings (publishes that bypassed
        the listener). Empty, with a warning, when the broker cannot be asked."""
        api = ManagementAPI(self.cfg.management_urls, timeout=10)
        try:
            first = self._drift_reading(api)
            time.sleep(self.drift_wait)
            second = self._drift_reading(api)
        except ManagementUnavailable as e:
            log.warning("VPN %s: broker drift not checked: %s", self.vpn, e)
            return {}
        out: dict[str, dict[str, int]] = {}
        for queue, (broker, live) in sorted(second.items()):
            before = first.get(queue)
            if before is None or broker == live:
                continue
            if (before[0] - before[1]) * (broker - live) > 0:  # the same direction both times
                out[queue] = {"broker": broker, "replicated": live}
                uncertain = self._uncertain.get(queue, [])
                if uncertain:
                    out[queue]["uncertain"] = len(uncertain)
                    # phantoms: exactly the uncertain ones are missing, both times
                    if before[1] - before[0] == live - broker == len(uncertain):
                        out[queue]["phantoms"] = len(uncertain)
        return out

    def _retire(self, drift: dict[str, dict[str, int]], retire: Repairer) -> None:
        keys = [
            (queue, rid)
            for queue, d in drift.items()
            if d.get("phantoms")
            for rid in self._uncertain.get(queue, [])
        ]
        if keys:
            done = retire(self.vpn, keys)
            log.info("VPN %s: phantoms retired: %s", self.vpn, done)
            for queue in {q for q, _ in keys}:
                drift[queue]["retired"] = drift[queue]["phantoms"]

    def _drift_reading(self, api: ManagementAPI) -> dict[str, tuple[int, int]]:
        with psycopg.connect(self.cfg.store_dsn, connect_timeout=10) as conn:
            live: dict[str, int] = dict(
                conn.execute(
                    "SELECT queue, count(*) FROM live_message WHERE vpn = %s GROUP BY queue",
                    (self.vpn,),
                ).fetchall()
            )
            self._uncertain = {}
            for queue, rid in conn.execute(_UNCERTAIN_LIVE, (self.vpn,)).fetchall():
                self._uncertain.setdefault(str(queue), []).append(bytes(rid))
            scope_row = conn.execute(
                "SELECT queue_patterns, topic_filters FROM vpn_config WHERE name = %s",
                (self.vpn,),
            ).fetchone()
        patterns, topics = scope_row if scope_row is not None else ([], [])
        scope = ReplicationScope(tuple(patterns), tuple(TopicFilter.parse(t) for t in topics))
        listed = api.get(f"queues/{quote(self.vpn, safe='')}?columns={DEPTH_COLUMNS}")
        out = {}
        for q in listed if isinstance(listed, list) else []:
            name = str(q.get("name", ""))
            if name in live or scope.names_queue(name):
                out[name] = (replicable_depth(q), int(live.get(name, 0)))
        return out


#: uncertain publishes still live, by queue (plugin.node._uncertain)
_UNCERTAIN_LIVE = """
SELECT u.queue, u.repl_id FROM uncertain_publish u
JOIN live_message m ON m.vpn = u.vpn AND m.queue = u.queue AND m.repl_id = u.repl_id
WHERE u.vpn = %s
"""


def keys_to_candidates(keys: Iterable[LiveKey]) -> list[Difference]:
    return [Difference(DIFFERS, q, r) for q, r in keys]


def _read_keys(
    conn: psycopg.Connection[Any], vpn: str, keys: Sequence[LiveKey], role: str
) -> tuple[int, dict[LiveKey, tuple[int, str, str, bytes, bytes]]]:
    """The index a site's live state reflects and its rows of ``keys``, in
    one snapshot."""
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
    row = conn.execute(REFLECTED_INDEX[role], (vpn,)).fetchone()
    index = int(row[0]) if row is not None else 0
    rows = {}
    for start in range(0, len(keys), 10_000):
        part = keys[start : start + 10_000]
        for queue, rid, pindex, exchange, rkey, props, body in conn.execute(
            ROWS_OF_KEYS, ([q for q, _ in part], [r for _, r in part], vpn)
        ):
            rows[(queue, bytes(rid))] = (pindex, exchange, rkey, bytes(props), bytes(body))
    conn.rollback()
    return index, rows


def _union(frames: Iterable[Any]) -> Any:
    out = None
    for frame in frames:
        out = frame if out is None else out.unionByName(frame)
    return out


def store_run(dsn: str, result: ReconcileResult) -> None:
    """Record a finished run in the active's ``reconcile_run``."""
    with psycopg.connect(dsn, connect_timeout=10) as conn:
        conn.execute(
            "INSERT INTO reconcile_run (vpn, started_at, outcome, method, rows_active,"
            " rows_standby, segments, dirty_segments, missing_on_standby, extra_on_standby,"
            " differs, repaired, broker_drift, seconds)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (
                result.vpn,
                result.started_at,
                "agree" if result.agree else "differ",
                result.method,
                result.rows_active,
                result.rows_standby,
                result.segments,
                result.dirty_segments,
                result.count(MISSING_ON_STANDBY, result.remaining),
                result.count(EXTRA_ON_STANDBY, result.remaining),
                result.count(DIFFERS, result.remaining),
                result.repaired,
                Jsonb(result.broker_drift),
                result.seconds,
            ),
        )


def store_failed_run(dsn: str, vpn: str, method: str, started: datetime, error: str) -> None:
    """Record a run that failed (best effort: the store may be why)."""
    try:
        with psycopg.connect(dsn, connect_timeout=10) as conn:
            conn.execute(
                "INSERT INTO reconcile_run (vpn, started_at, outcome, method, error)"
                " SELECT %s, %s, 'failed', %s, %s WHERE EXISTS"
                " (SELECT 1 FROM vpn_config WHERE name = %s)",
                (vpn, started, method, error, vpn),
            )
    except psycopg.Error as e:
        log.warning("the failed run was not recorded: %s", redact_url(str(e)))


def repair_through_node(dsn: str, request: str = "repair") -> Repairer:
    """A :data:`Repairer` that hands the keys to the site's running node
    (``request``: ``repair``, or ``retire-uncertain`` for phantoms)."""
    from plugin.ops import Progress, run_command

    def repair(vpn: str, keys: list[LiveKey]) -> dict[str, Any]:
        async def here(progress: Progress) -> dict[str, Any]:
            raise PluginError(
                "repairs go through the ledger and the bridge: the active site's node must"
                " be running"
            )

        args = {"keys": [[q, r.hex()] for q, r in keys]}
        return asyncio.run(run_command(dsn, request, vpn, args, here, lambda done, total: None))

    return repair
