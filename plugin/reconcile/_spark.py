"""Spark for the reconciliation job: a session that stays out of the
operator's way, JDBC reads that see one snapshot of a site, and a progress
bar on a terminal.

The JVM's own lines (log4j, a console progress bar) would fill the
operator's terminal, so the job launches it with its output going to a log
file of the run (warnings and errors only: ``log4j2.properties`` beside this
module), whose path an error names, and draws its own progress bar from
Spark's status tracker when stderr is a terminal. A :class:`SiteSnapshot`
holds a site's exported snapshot, which every JDBC partition's session
adopts (docs/behaviour.md, "Reconciliation": one snapshot per site).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import psycopg

from bridge import REFLECTED_INDEX, redact_url
from plugin._errors import PluginError

__all__ = ["SiteSnapshot", "SparkRun", "SparkUnavailable", "jdbc_url"]


class SparkUnavailable(PluginError):
    """Spark cannot run here (PySpark, Java or the JDBC driver missing)."""


def jdbc_url(dsn: str) -> tuple[str, dict[str, str]]:
    """A ``postgresql://`` DSN as Spark's JDBC source takes it: the URL
    without credentials, and the connection properties (user, password and
    the DSN's query parameters)."""
    parts = urlsplit(dsn)
    host = parts.hostname or "localhost"
    port = parts.port or 5432
    db = unquote(parts.path.lstrip("/")) or unquote(parts.username or "")
    props = {k: v for k, v in parse_qsl(parts.query)}
    props.pop("connect_timeout", None)  # a libpq name the JDBC driver spells otherwise
    if parts.username:
        props["user"] = unquote(parts.username)
    if parts.password:
        props["password"] = unquote(parts.password)
    return f"jdbc:postgresql://{host}:{port}/{db}", props


class SiteSnapshot:
    """One site's store frozen for the job: a ``REPEATABLE READ READ ONLY``
    transaction kept open until :meth:`close`, its exported snapshot, and
    the ledger index the VPN's live state reflects in it (the active's
    ``live_index``, the standby's ``applied_index``)."""

    def __init__(self, dsn: str, vpn: str, role: str) -> None:
        self.dsn, self.vpn, self.role = dsn, vpn, role
        try:
            self._conn = psycopg.connect(dsn, connect_timeout=10)
        except psycopg.OperationalError as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            raise PluginError(f"cannot connect to {redact_url(dsn)}: {reason}") from e
        try:
            self._conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            standard = self._conn.execute("SHOW standard_conforming_strings").fetchone()
            if standard is None or standard[0] != "on":
                raise PluginError(
                    f"{redact_url(dsn)}: standard_conforming_strings is off; reconcile "
                    "needs it on (PostgreSQL's default)"
                )
            found = self._conn.execute(
                "SELECT role FROM vpn_config WHERE name = %s AND enabled", (vpn,)
            ).fetchone()
            if found is None:
                raise PluginError(f"VPN {vpn!r} is not enabled at {redact_url(dsn)}")
            if found[0] != role:
                raise PluginError(
                    f"VPN {vpn!r} is {found[0]} at {redact_url(dsn)}, not {role}: run "
                    "reconcile with the active site's config, whose [peers.NAME] store_dsn is "
                    "the standby's store"
                )
            row = self._conn.execute(REFLECTED_INDEX[role], (vpn,)).fetchone()
            self.index = int(row[0]) if row is not None else 0
            snap = self._conn.execute("SELECT pg_export_snapshot()").fetchone()
            assert snap is not None  # noqa: S101 - the function returns a row
            self.snapshot = str(snap[0])
        except BaseException:
            self._conn.close()
            raise

    def session_init(self) -> str:
        """The init statement that puts a JDBC session in this snapshot."""
        return (
            "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; "
            f"SET TRANSACTION SNAPSHOT '{self.snapshot}'"
        )

    def close(self) -> None:
        self._conn.close()


@dataclass
class SparkRun:
    """A Spark session for one job (a context manager)."""

    master: str
    jdbc_jar: str
    progress: bool = False
    log_path: Path = field(init=False)
    spark: Any = field(init=False, default=None)
    _log: Any = field(init=False, default=None)
    _bar: _ProgressThread | None = field(init=False, default=None)

    def __enter__(self) -> SparkRun:
        try:
            from pyspark import SparkConf, SparkContext
            from pyspark.java_gateway import launch_gateway
            from pyspark.sql import SparkSession
        except ImportError as e:
            raise SparkUnavailable(
                "PySpark is not installed: install the package with its reconcile extra "
                "(pip install 'vpn-replication[reconcile]')"
            ) from e
        if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
            raise SparkUnavailable("Spark needs Java: install openjdk-17-jre-headless")
        if not Path(self.jdbc_jar).is_file():
            raise SparkUnavailable(
                f"the PostgreSQL JDBC driver is not at {self.jdbc_jar}: install Debian's "
                "libpostgresql-jdbc-java, or set [reconcile] jdbc_jar"
            )
        if self.master.startswith("local"):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        log4j = resources.files(__package__).joinpath("log4j2.properties")
        fd, name = tempfile.mkstemp(prefix="vpnrepl-spark-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the JVM's output, closed in __exit__
        conf = (
            SparkConf()
            .setMaster(self.master)
            .setAppName("vpnrepl-reconcile")
            .set("spark.jars", self.jdbc_jar)
            .set("spark.ui.enabled", "false")
            .set("spark.ui.showConsoleProgress", "false")
            .set("spark.sql.shuffle.partitions", "8")
            .set("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{log4j}")
        )
        try:
            gateway = launch_gateway(  # type: ignore[no-untyped-call]
                conf, popen_kwargs={"stdout": self._log, "stderr": self._log}
            )
            context = SparkContext(conf=conf, gateway=gateway)
        except Exception as e:
            self._log.close()
            raise SparkUnavailable(f"Spark did not start ({e}); its log: {self.log_path}") from e
        self.spark = SparkSession(context)
        if self.progress:
            self._bar = _ProgressThread(context)
            self._bar.start()
        return self

    def phase(self, text: str) -> None:
        """Name what the progress bar counts now."""
        if self._bar is not None:
            self._bar.phase = text

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
        if self.spark is not None:
            self.spark.stop()
            from pyspark import SparkContext

            gateway = SparkContext._gateway
            if gateway is not None:
                gateway.shutdown()
                SparkContext._gateway = None
                SparkContext._jvm = None
        self._log.close()
        if exc is None:
            self.log_path.unlink(missing_ok=True)

    def read_jdbc(
        self,
        site: SiteSnapshot,
        query: str,
        partition: tuple[str, int, int] | None = None,
    ) -> Any:
        """A DataFrame of ``query`` (a sub-select) on ``site``, in its
        snapshot; ``partition``: (an integer column of the query in
        ``[0, upper)``, upper, n) to read in n parallel sessions, each
        taking a range of the column."""
        url, props = jdbc_url(site.dsn)
        reader = (
            self.spark.read.format("jdbc")
            .option("url", url)
            .option("driver", "org.postgresql.Driver")
            .option("dbtable", f"({query}) AS q")
            .option("fetchsize", "1000")
            .option("sessionInitStatement", site.session_init())
        )
        for key, value in props.items():
            reader = reader.option(key, value)
        if partition is not None:
            column, upper, n = partition
            reader = (
                reader.option("partitionColumn", column)
                .option("lowerBound", "0")
                .option("upperBound", str(upper))
                .option("numPartitions", str(n))
            )
        return reader.load()


class _ProgressThread(threading.Thread):
    """Spark's task counts as a tqdm bar on stderr."""

    def __init__(self, context: Any) -> None:
        super().__init__(name="spark-progress", daemon=True)
        self._tracker = context.statusTracker()
        self._done = threading.Event()
        self.phase = "starting"

    def run(self) -> None:
        from tqdm import tqdm

        bar = tqdm(total=0, unit="task", file=sys.stderr, leave=False, desc=self.phase)
        while not self._done.wait(0.3):
            total = finished = 0
            for stage in self._tracker.getActiveStageIds():
                info = self._tracker.getStageInfo(stage)
                if info is not None:
                    total += info.numTasks
                    finished += info.numCompletedTasks
            bar.set_description_str(self.phase, refresh=False)
            bar.total, bar.n = total, finished
            bar.refresh()
        bar.close()

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=2)
