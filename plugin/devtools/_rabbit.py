"""A private RabbitMQ node from the Debian binaries: its own node name, free
ports, data directory and copy of every file the binaries would otherwise
read from ``/etc`` (``rabbitmq-env.conf`` names the system node), so a
RabbitMQ that already runs on the machine is never touched. It runs as the
invoking user with ``HOME`` in its own directory, which also gives it a
private Erlang cookie.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

from bridge import TlsConfig

from ._processes import HarnessError, free_port, kill_tree, log_tail

__all__ = ["RabbitNode"]

RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")


class RabbitNode:
    """One RabbitMQ node with the management plugin, private to this process;
    with ``tls``, it also accepts AMQPS on :attr:`amqps_port` with that
    certificate and key (client certificates are not asked for)."""

    def __init__(
        self, name: str, base: Path, tls: TlsConfig | None = None, cookie: str | None = None
    ) -> None:
        """``cookie``: the Erlang cookie, the same for the nodes of a cluster
        (None: RabbitMQ makes one of the node's own)."""
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
        if cookie is not None:
            secret = base / "home" / ".erlang.cookie"
            secret.unlink(missing_ok=True)
            secret.write_text(cookie)
            secret.chmod(0o400)
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
                output = log_tail(self.base / "stdout.log")
                raise HarnessError(f"RabbitMQ {self.nodename} exited at start:\n{output}")
            if time.monotonic() > deadline:
                raise HarnessError(f"RabbitMQ {self.nodename} wrote no pid file in {timeout:.0f} s")
            time.sleep(0.1)
        left = max(1, int(deadline - time.monotonic()))
        result = self.ctl("wait", str(self.pidfile), "--timeout", str(left), check=False)
        if result.returncode != 0:
            raise HarnessError(
                f"RabbitMQ {self.nodename} did not boot: {result.stdout.strip()}\n"
                f"{log_tail(self.base / 'stdout.log')}"
            )

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def join(self, seed: RabbitNode) -> None:
        """Join ``seed``'s cluster (this node, running, with the same cookie,
        leaves its own data behind)."""
        self.ctl("stop_app")
        self.ctl("reset")
        self.ctl("join_cluster", seed.nodename)
        self.ctl("start_app")

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
        kill_tree(self._proc.pid)
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
