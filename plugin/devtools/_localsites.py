"""Local RabbitMQ nodes and PostgreSQL clusters for the demo, tests and benchmarks.

Every server runs from the Debian binaries in its own temporary directory,
with its own node name, ports (chosen free, on 127.0.0.1) and data directory,
and with its own copy of every file the binaries would otherwise read from
``/etc`` (RabbitMQ's ``rabbitmq-env.conf`` names the system node). So a
RabbitMQ on 5672 or a PostgreSQL on 5432 that already runs on the machine is
never touched, and any of our four servers can be stopped, SIGKILLed and
restarted on the same ports and data.

Run as root, PostgreSQL's ``initdb``/``pg_ctl`` (which refuse root) run as the
``postgres`` user; RabbitMQ runs as the invoking user with ``HOME`` in its own
directory, which also gives it a private Erlang cookie.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg

from bridge import TlsConfig
from plugin._errors import PluginError
from plugin.tls import init_certificates

__all__ = [
    "HarnessError",
    "LocalNode",
    "LocalSite",
    "LocalSites",
    "PostgresCluster",
    "RabbitNode",
    "sweep_orphans",
]

log = logging.getLogger(__name__)

RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
# RabbitMQ's CLI tools take distribution ports 35672-35682 and the system node
# 25672; never hand those out.
_RESERVED_PORTS = {25672, *range(35672, 35683), 5672, 15672, 5432, 4369}
_handed_out: set[int] = set()


class HarnessError(PluginError):
    """A local server failed to start, stop or answer."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on and we have not handed out."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _RESERVED_PORTS and port not in _handed_out and port < 60000:
            _handed_out.add(port)
            return port


def _pg_bindir() -> Path:
    found = shutil.which("pg_config")
    if found:
        out = subprocess.run(  # noqa: S603 - pg_config from PATH, fixed arguments
            [found, "--bindir"], capture_output=True, text=True, check=False
        )
        candidate = Path(out.stdout.strip())
        if (candidate / "initdb").exists():
            return candidate
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3])
    )
    if not versions:
        raise HarnessError("PostgreSQL server binaries not found (install `postgresql`)")
    return versions[-1].parent


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stat_fields(stat: Path) -> list[str]:
    """The fields of a ``/proc/PID/stat`` after the command name (state,
    parent pid, ...; the name may hold spaces and parentheses)."""
    return stat.read_text().rsplit(")", 1)[1].split()


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = _stat_fields(stat)
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, found = [pid], []
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants at once (a crash, not a shutdown)."""
    for p in process_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_dead(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            pass
        time.sleep(0.05)
    raise HarnessError(f"process {pid} did not exit within {timeout:.0f} s")


class RabbitNode:
    """One RabbitMQ node with the management plugin, private to this process;
    with ``tls``, it also accepts AMQPS on :attr:`amqps_port` with that
    certificate and key (client certificates are not asked for)."""

    def __init__(self, name: str, base: Path, tls: TlsConfig | None = None) -> None:
        self.name = name
        self.nodename = f"{name}@localhost"
        self.base = base
        self.amqp_port, self.management_port, self.dist_port = free_port(), free_port(), free_port()
        self.amqps_port = free_port() if tls is not None else None
        self._proc: subprocess.Popen[bytes] | None = None
        for sub in ("mnesia", "log", "home"):
            (base / sub).mkdir(parents=True, exist_ok=True)
        conf = (
            f"listeners.tcp.1 = 127.0.0.1:{self.amqp_port}\n"
            f"management.tcp.ip = 127.0.0.1\n"
            f"management.tcp.port = {self.management_port}\n"
            "disk_free_limit.absolute = 50MB\n"
            # queue depths in the management API (status) a second old, not five
            "collect_statistics_interval = 1000\n"
        )
        if tls is not None:
            conf += (
                f"listeners.ssl.1 = 127.0.0.1:{self.amqps_port}\n"
                f"ssl_options.certfile = {tls.cert}\n"
                f"ssl_options.keyfile = {tls.key}\n"
                "ssl_options.verify = verify_none\n"
                "ssl_options.fail_if_no_peer_cert = false\n"
            )
            if tls.ca is not None:
                conf += f"ssl_options.cacertfile = {tls.ca}\n"
        (base / "rabbitmq.conf").write_text(conf)
        (base / "enabled_plugins").write_text("[rabbitmq_management].\n")
        (base / "rabbitmq-env.conf").write_text("")

    @property
    def pidfile(self) -> Path:
        return self.base / "rabbit.pid"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")}
        env.update(
            HOME=str(self.base / "home"),
            ERL_EPMD_ADDRESS="127.0.0.1",
            RABBITMQ_CONF_ENV_FILE=str(self.base / "rabbitmq-env.conf"),
            RABBITMQ_NODENAME=self.nodename,
            RABBITMQ_NODE_PORT=str(self.amqp_port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(self.base / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.base / "log"),
            RABBITMQ_CONFIG_FILE=str(self.base / "rabbitmq.conf"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.base / "enabled_plugins"),
            RABBITMQ_PID_FILE=str(self.pidfile),
        )
        return env

    def amqp_url(self, vhost: str = "/") -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/{quote(vhost, safe='')}"

    def amqps_url(self, vhost: str = "/") -> str:
        if self.amqps_port is None:
            raise HarnessError(f"RabbitMQ {self.nodename} was made without TLS")
        return f"amqps://guest:guest@127.0.0.1:{self.amqps_port}/{quote(vhost, safe='')}"

    @property
    def management_url(self) -> str:
        return f"http://guest:guest@127.0.0.1:{self.management_port}/"

    def launch(self) -> None:
        """Start the node without waiting (see :meth:`wait_ready`)."""
        if self.alive():
            return
        self.pidfile.unlink(missing_ok=True)
        out = open(self.base / "stdout.log", "ab")
        self._proc = subprocess.Popen(  # noqa: S603 - fixed argv
            [str(RABBIT_BIN / "rabbitmq-server")],
            env=self.env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        out.close()

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.pidfile.exists():
            if self._proc is not None and self._proc.poll() is not None:
                raise HarnessError(
                    f"RabbitMQ {self.nodename} exited at start:\n{_tail(self.base / 'stdout.log')}"
                )
            if time.monotonic() > deadline:
                raise HarnessError(f"RabbitMQ {self.nodename} wrote no pid file in {timeout:.0f} s")
            time.sleep(0.1)
        left = max(1, int(deadline - time.monotonic()))
        result = self.ctl("wait", str(self.pidfile), "--timeout", str(left), check=False)
        if result.returncode != 0:
            raise HarnessError(
                f"RabbitMQ {self.nodename} did not boot: {result.stdout.strip()}\n"
                f"{_tail(self.base / 'stdout.log')}"
            )

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(  # noqa: S603 - fixed argv
            [str(RABBIT_BIN / "rabbitmqctl"), "-n", self.nodename, *args],
            env=self.env(),
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        if check and result.returncode != 0:
            raise HarnessError(f"rabbitmqctl {' '.join(args)}: {result.stderr.strip()}")
        return result

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """A clean shutdown."""
        if not self.alive():
            return
        self.ctl("stop", check=False)
        assert self._proc is not None  # noqa: S101 - alive() checked
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the node (the Erlang VM and its helpers), as a crash would."""
        if self._proc is None:
            return
        _kill_tree(self._proc.pid)
        self._proc.wait(timeout=30)

    def restart(self) -> None:
        self.stop()
        self.start()

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """Call the management HTTP API; returns the decoded JSON (or None)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(  # noqa: S310 - our own loopback URL
            f"http://127.0.0.1:{self.management_port}/api/{path}", data=data, method=method
        )
        req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise HarnessError(f"management API {method} {path}: HTTP {e.code}") from e
        return json.loads(raw) if raw else None

    def reset(self) -> None:
        """Back to a fresh node: only the default vhost, and nothing in it."""
        for vhost in self.api("GET", "vhosts"):
            if vhost["name"] != "/":
                self.api("DELETE", f"vhosts/{quote(vhost['name'], safe='')}")
        for q in self.api("GET", "queues/%2F"):
            self.api("DELETE", f"queues/%2F/{quote(q['name'], safe='')}")
        for x in self.api("GET", "exchanges/%2F"):
            if x["name"] and not x["name"].startswith("amq."):
                self.api("DELETE", f"exchanges/%2F/{quote(x['name'], safe='')}")

    def add_vhost(self, vhost: str) -> None:
        self.api("PUT", f"vhosts/{quote(vhost, safe='')}")
        self.api(
            "PUT",
            f"permissions/{quote(vhost, safe='')}/guest",
            {"configure": ".*", "write": ".*", "read": ".*"},
        )


class PostgresCluster:
    """One PostgreSQL cluster, initdb'd in its own directory."""

    def __init__(self, name: str, base: Path) -> None:
        self.name = name
        self.base = base
        self.port = free_port()
        self.datadir = base / "data"
        self._bindir = _pg_bindir()
        self._as_postgres = os.geteuid() == 0
        #: environment the server starts with besides this process's (the
        #: fault suite's clock jump preloads libfaketime)
        self.extra_env: dict[str, str] = {}
        base.mkdir(parents=True, exist_ok=True)
        if self._as_postgres:
            shutil.chown(base, "postgres", "postgres")

    def _run(self, *argv: str) -> None:
        cmd = [str(self._bindir / argv[0]), *argv[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        result = subprocess.run(  # noqa: S603 - fixed argv
            cmd,
            capture_output=True,
            text=True,
            check=False,
            cwd=self.base,
            timeout=120,
            env={**os.environ, **self.extra_env},
        )
        if result.returncode != 0:
            raise HarnessError(
                f"PostgreSQL {self.name}: {argv[0]} failed: {result.stderr.strip()}\n"
                f"{_tail(self.base / 'server.log')}"
            )

    def dsn(self, dbname: str = "vpnrepl") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> None:
        if not self.datadir.exists():
            self._run(
                "initdb",
                "-D",
                str(self.datadir),
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
            )
        options = (
            f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 "
            "-c max_connections=200 -c shared_buffers=64MB -c max_prepared_transactions=20"
        )
        self._run(
            "pg_ctl",
            "-D",
            str(self.datadir),
            "-o",
            options,
            "-l",
            str(self.base / "server.log"),
            "-w",
            "-t",
            "60",
            "start",
        )

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.datadir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def alive(self) -> bool:
        pid = self.postmaster_pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self) -> None:
        if self.alive():
            self._run("pg_ctl", "-D", str(self.datadir), "-m", "fast", "-w", "stop")

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend, as a crash would."""
        pid = self.postmaster_pid()
        if pid is None or not self.alive():
            return
        _kill_tree(pid)
        _wait_dead(pid)

    def restart(self) -> None:
        self.stop()
        self.start()

    def reset(self, dbname: str = "vpnrepl") -> None:
        """Drop and recreate ``dbname``: a fresh database for the next test."""
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{dbname}"')


class LocalSite:
    """One site's servers plus the ports its vpnrepl node listens on."""

    def __init__(self, name: str, base: Path) -> None:
        self.name = name
        self.base = base
        self.rabbit = RabbitNode(f"vpnrepl-{name}-{os.getpid()}", base / "rabbit")
        self.pg = PostgresCluster(name, base / "pg")
        self.amqp_port, self.bridge_port, self.admin_port = free_port(), free_port(), free_port()
        #: the directory of the bridge certificates (``vpnrepl tls init``'s)
        self.pki: Path | None = None

    def config_text(
        self, peer: LocalSite | None = None, tls: bool = True, dial: bool = True
    ) -> str:
        """This site's config; ``peer``: the site it replicates with (which
        it dials unless ``dial`` is false: a site that only serves it)."""
        text = (
            f'[site]\nname = "{self.name}"\n\n'
            f'[broker]\namqp_url = "{self.rabbit.amqp_url()}"\n'
            f'management_url = "{self.rabbit.management_url}"\n\n'
            f'[listen]\namqp = "127.0.0.1:{self.amqp_port}"\n'
            f'bridge = "127.0.0.1:{self.bridge_port}"\n'
            f'admin = "127.0.0.1:{self.admin_port}"\n\n'
            f'[store]\ndsn = "{self.pg.dsn()}"\n'
        )
        if peer is not None:
            text += f"\n[peers.{peer.name}]\n"
            if dial:
                text += f'bridge = "127.0.0.1:{peer.bridge_port}"\n'
            text += f'store_dsn = "{peer.pg.dsn()}"\n'

        if tls and self.pki is not None:
            text += (
                f'\n[tls]\ncert = "{self.pki / self.name}.crt"\n'
                f'key = "{self.pki / self.name}.key"\nca = "{self.pki}/ca.crt"\n'
            )
        return text

    def write_config(
        self, path: Path, peer: LocalSite | None = None, tls: bool = True, dial: bool = True
    ) -> Path:
        """The site's config (:meth:`config_text`): mutual TLS with the
        harness's certificates (``tls=False``: no ``[tls]``, for a caller
        that adds its own)."""
        path.write_text(self.config_text(peer, tls, dial))
        return path


class LocalNode:
    """One ``vpnrepl node`` process for a :class:`LocalSite` (its config file
    written by :meth:`LocalSite.write_config`), as the demo, the tests and the
    benchmarks run it: output to ``log``, in a session of its own (a Ctrl-C
    on the terminal is for the caller to pass on), healthy once its admin
    endpoint answers ``/health``."""

    def __init__(
        self,
        site: LocalSite,
        config: Path,
        log: Path,
        name: str | None = None,
        code: Path | None = None,
    ) -> None:
        """``code``: a directory holding another release's packages to run
        instead of these (an upgrade test's previous release)."""
        self.site = site
        self.config = config
        self.log = log
        self.name = name or site.name
        self.code = code
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = 60.0, failpoint: str | None = None) -> None:
        """Start the node and wait until it is healthy; ``failpoint`` arms a
        crash at that step (``txn/_failpoints.py``)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("VPNREPL_FAILPOINT", None)
        if failpoint is not None:
            env["VPNREPL_FAILPOINT"] = failpoint
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(  # noqa: S603 - our own package
                [sys.executable, "-m", "plugin", "--config", str(self.config), "node"],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.code,  # ``-m plugin`` imports from there first
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise HarnessError(
                    f"node {self.name} exited {self.proc.returncode}:\n{self.tail()}"
                )
            with suppress(OSError):
                if self.get("/health") == "ok\n":
                    return
            if time.monotonic() > deadline:
                raise HarnessError(f"node {self.name} not healthy in {timeout:g} s:\n{self.tail()}")
            time.sleep(0.1)

    def get(self, path: str) -> str:
        """GET ``path`` of the node's admin endpoint."""
        url = f"http://127.0.0.1:{self.site.admin_port}{path}"
        with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - loopback
            return str(resp.read().decode())

    def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.get("/status"))
        return doc

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        """The node's output so far ("" if it was never started)."""
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (a clean stop); SIGKILL if it is not gone within
        ``timeout``. Returns the exit status (0 if it never ran)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return int(self.proc.returncode)

    def kill(self) -> None:
        """SIGKILL the node, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


_SITES_PREFIX = "vpnrepl-sites-"
_OWNER_FILE = "owner"


def _started_at(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (``/proc/PID/stat`` field 22), or
    None when it is gone: with the pid it names one process, even after the
    pid is reused."""
    try:
        return _stat_fields(Path("/proc") / str(pid) / "stat")[19]
    except (OSError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        raw = (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def kill_servers_in(base: Path) -> int:
    """SIGKILL the RabbitMQ nodes and PostgreSQL clusters of the sites in
    ``base`` (found by their pid files; a process is killed only if its
    command line names ``base``, so a reused pid is never hit). Returns how
    many were running."""
    killed = 0
    for pidfile in (*base.glob("*/rabbit/rabbit.pid"), *base.glob("*/pg/data/postmaster.pid")):
        try:
            pid = int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if str(base) in _cmdline(pid):
            _kill_tree(pid)
            killed += 1
    return killed


def sweep_orphans(tmp: Path | None = None) -> list[Path]:
    """Kill the servers of harnesses whose process died without closing them
    (a test run or benchmark SIGKILLed), and remove their directories.

    Each :class:`LocalSites` with a directory of its own writes its owner's
    pid and start time there; a directory whose owner is gone is an orphan.
    A server is killed only if its command line names the orphan's
    directory, so a reused pid is never hit. Returns the directories removed.
    """
    removed = []
    for base in sorted((tmp or Path(tempfile.gettempdir())).glob(f"{_SITES_PREFIX}*")):
        try:
            pid_text, started = (base / _OWNER_FILE).read_text().split()
            owner = int(pid_text)
        except (OSError, ValueError):
            continue  # not ours, or not written yet
        if _started_at(owner) == started:
            continue  # its owner still runs
        if kill_servers_in(base):
            log.warning("killed the servers a dead harness left in %s", base)
        shutil.rmtree(base, ignore_errors=True)
        removed.append(base)
    return removed


class LocalSites:
    """Two sites, ``a`` and ``b``: two RabbitMQ nodes and two PostgreSQL clusters.

    With no ``base`` given, the servers live in a temporary directory of
    their own, which :meth:`close` removes; one that a killed process never
    closed is cleaned up by the next :meth:`start` (:func:`sweep_orphans`).
    """

    def __init__(self, base: Path | None = None) -> None:
        self._own_base = base is None
        self.base = Path(tempfile.mkdtemp(prefix=_SITES_PREFIX)) if base is None else base
        self.base.chmod(0o755)  # the postgres user must reach its directory
        if self._own_base:
            me = os.getpid()
            (self.base / _OWNER_FILE).write_text(f"{me} {_started_at(me)}\n")
        self.a = LocalSite("a", self.base / "a")
        self.b = LocalSite("b", self.base / "b")
        # the bridge's certificates: a private CA and one naming each site
        pki = self.base / ".pki"
        if not (pki / "b.crt").exists():
            init_certificates(pki, [self.a.name, self.b.name])
        self.a.pki = self.b.pki = pki
        self.startup_seconds = 0.0

    def start(self) -> None:
        t0 = time.monotonic()
        sweep_orphans()
        for node in (self.a.rabbit, self.b.rabbit):
            node.launch()
        with ThreadPoolExecutor(4) as pool:
            futures = [
                pool.submit(self.a.pg.start),
                pool.submit(self.b.pg.start),
                pool.submit(self.a.rabbit.wait_ready),
                pool.submit(self.b.rabbit.wait_ready),
            ]
            for f in futures:
                f.result()
        for site in (self.a, self.b):
            site.pg.reset()
        self.startup_seconds = time.monotonic() - t0
        log.info("two sites started in %.1f s", self.startup_seconds)

    def close(self) -> None:
        for site in (self.a, self.b):
            for server in (site.rabbit, site.pg):
                try:
                    server.kill()
                except HarnessError as e:
                    log.warning("%s", e)
        if self._own_base:
            shutil.rmtree(self.base, ignore_errors=True)


@contextmanager
def local_sites() -> Iterator[LocalSites]:
    sites = LocalSites()
    try:
        sites.start()
        yield sites
    finally:
        sites.close()


class OtlpReceiver:
    """A local OTLP/HTTP trace receiver, standing in for an operator's
    collector in the tests and benchmarks: every ``POST`` (``path``, body)
    goes to ``take`` (in the server's thread), and is answered with an empty
    ``ExportTraceServiceResponse``. ``url`` is for ``[telemetry]
    otlp_traces_url``."""

    def __init__(self, take: Callable[[str, bytes], None]) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceResponse,
        )

        reply = ExportTraceServiceResponse().SerializeToString()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                take(self.path, self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
