"""``vpnrepl node`` as a real process, for tests that need the whole site."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from plugin.devtools import LocalNode, LocalSite
from sql import migrate
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
    """Site A's node (not started): its schema made (what ``vpnrepl init``
    does, in this process: tests/site/test_cli.py runs the command itself);
    enable VPNs, then ``start()``."""
    migrate(site_a.pg.dsn())
    node = NodeProcess(site_a, vpnrepl_a.config, tmp_path / "node-a.log")
    try:
        yield node
    finally:
        node.kill()
    assert "Traceback" not in node.log_text(), node.log_text()


@pytest.fixture
def node_b(site_a: LocalSite, site_b: LocalSite, tmp_path: Path) -> Iterator[NodeProcess]:
    """Site B's node as the standby of site A (not started): its schema made."""
    config = site_b.write_config(tmp_path / "b.toml", peer=site_a)
    migrate(site_b.pg.dsn())
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
        for site in (a, b):
            migrate(site.pg.dsn())
        self.a = NodeProcess(a, self.a_cfg, tmp / "node-a.log", name="a")
        self.b = NodeProcess(b, self.b_cfg, tmp / "node-b.log", name="b")
