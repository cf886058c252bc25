"""``vpnrepl node`` as a real process, for tests that need the whole site."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from plugin.devtools import LocalNode, LocalSite
from tests.fix_cli import Vpnrepl


class NodeProcess(LocalNode):
    """The harness's node process, plus what crash tests check."""

    def wait_killed(self, timeout: float = 60.0) -> None:
        """Wait for the process to die of SIGKILL (an armed failpoint)."""
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node still alive after {timeout:g} s") from None
        assert code == -signal.SIGKILL, f"node exited {code}, not by its failpoint"


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


class Sites:
    """Both sites' nodes, each naming the other as its peer."""

    def __init__(self, a: LocalSite, b: LocalSite, tmp: Path) -> None:
        self.a_cfg = a.write_config(tmp / "a.toml", peer=b)
        self.b_cfg = b.write_config(tmp / "b.toml", peer=a)
        self.cli_a, self.cli_b = Vpnrepl(self.a_cfg), Vpnrepl(self.b_cfg)
        for cli in (self.cli_a, self.cli_b):
            assert cli("init").returncode == 0
        self.a = NodeProcess(a, self.a_cfg, tmp / "node-a.log", name="a")
        self.b = NodeProcess(b, self.b_cfg, tmp / "node-b.log", name="b")
