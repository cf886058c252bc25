"""``vpnrepl node`` as a real process, for tests that need the whole site."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from plugin._localsites import LocalSite
from tests.fix_cli import Vpnrepl


class NodeProcess:
    def __init__(self, site: LocalSite, config: Path, log: Path) -> None:
        self.site = site
        self.config = config
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0, failpoint: str | None = None) -> None:
        """Start the node and wait until it is healthy; ``failpoint`` arms a
        crash at that step (``txn/_failpoints.py``)."""
        exe = Vpnrepl(self.config)("--help", config=False).args[0]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("VPNREPL_FAILPOINT", None)
        if failpoint is not None:
            env["VPNREPL_FAILPOINT"] = failpoint
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [exe, "--config", str(self.config), "node"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"node exited {self.proc.returncode}:\n{self.log_text()}")
            try:
                if self.get("/health") == "ok\n":
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"node not healthy in {timeout} s:\n{self.log_text()}")
            time.sleep(0.1)

    def get(self, path: str) -> str:
        url = f"http://127.0.0.1:{self.site.admin_port}{path}"
        with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - loopback
            return resp.read().decode()

    def status(self) -> dict:
        return json.loads(self.get("/status"))

    def log_text(self) -> str:
        """The node's output so far ("" if it was never started)."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def wait_killed(self, timeout: float = 60.0) -> None:
        """Wait for the process to die of SIGKILL (an armed failpoint)."""
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node still alive after {timeout:g} s") from None
        assert code == -signal.SIGKILL, f"node exited {code}, not by its failpoint"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture
def node_a(site_a: LocalSite, vpnrepl_a: Vpnrepl, tmp_path: Path) -> Iterator[NodeProcess]:
    """Site A's node (not started): init done; enable VPNs, then ``start()``."""
    assert vpnrepl_a("init").returncode == 0
    node = NodeProcess(site_a, vpnrepl_a.config, tmp_path / "node-a.log")
    try:
        yield node
    finally:
        node.kill()
    assert "Traceback" not in node.log_text(), node.log_text()


@pytest.fixture
def node_b(site_a: LocalSite, site_b: LocalSite, tmp_path: Path) -> Iterator[NodeProcess]:
    """Site B's node as the standby of site A (not started): init done."""
    config = site_b.write_config(tmp_path / "b.toml", peer=site_a)
    assert Vpnrepl(config)("init").returncode == 0
    node = NodeProcess(site_b, config, tmp_path / "node-b.log")
    try:
        yield node
    finally:
        node.kill()
    assert "Traceback" not in node.log_text(), node.log_text()
