"""Upgrading the sites one at a time, as the README's procedure says: the
standby first, then the active, without stopping replication.

The previous release is the real one: its packages are taken from this
repository's history (``git archive`` of :data:`PREVIOUS_RELEASE`, the last
commit of bridge protocol version 4 and schema revision 0007) and run as a
node and a CLI of their own next to this release's."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from bridge import PREVIOUS_PROTOCOL_VERSION, PROTOCOL_VERSION
from plugin._localsites import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.two_sites import (
    IN_SCOPE,
    SCOPE,
    VPN,
    amqp_url,
    assert_same_state,
    body,
    properties,
    routing_key,
    scalar,
    setup_vpn,
    until,
    vpn_status,
)

#: the last commit of bridge protocol version 4 (schema revision 0007)
PREVIOUS_RELEASE = "c0443f4dcb48c38113151e5dbe9aa0f29f63ed86"
REPO = Path(__file__).resolve().parent.parent


def _previous_commit() -> str:
    """The full name of the previous release's commit; the checkout must
    have the project's history (a clean clone has)."""
    done = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{PREVIOUS_RELEASE}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"the previous release {PREVIOUS_RELEASE[:7]} is not in this checkout's history "
            f"(a shallow clone?): {done.stderr.strip()}"
        )
    return done.stdout.strip()


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's packages, unpacked from the repository."""
    where = tmp_path_factory.mktemp("previous-release")
    archive = where / "release.tar"
    commit = _previous_commit()
    subprocess.run(
        ["git", "-C", str(REPO), "archive", "-o", str(archive), commit,
         "bridge", "plugin", "txn", "sql"],
        check=True,
    )  # fmt: skip
    with tarfile.open(archive) as tar:
        tar.extractall(where, filter="data")
    frames = (where / "bridge" / "_frames.py").read_text()
    assert f"PROTOCOL_VERSION: Final = {PREVIOUS_PROTOCOL_VERSION}" in frames
    return where


class Previous:
    """The previous release's CLI, run as an admin would have run it."""

    def __init__(self, code: Path, config: Path) -> None:
        self.code, self.config = code, config

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "plugin", "--config", str(self.config), *args]
        return subprocess.run(
            argv, cwd=self.code, capture_output=True, text=True, timeout=120, check=False
        )


def publish(site: LocalSite, numbers: range) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(site)))
    ch = conn.channel()
    ch.confirm_delivery()
    for n in numbers:
        ch.basic_publish("events", routing_key(n), body(n), properties(n), mandatory=True)
    conn.close()


@pytest.fixture
def nodes(site_a: LocalSite, site_b: LocalSite, tmp_path: Path) -> Iterator[list[NodeProcess]]:
    started: list[NodeProcess] = []
    yield started
    for node in started:
        node.kill()
    for node in started:
        assert "Traceback" not in node.log_text(), node.log_text()


def test_the_standby_then_the_active_upgraded_without_stopping_replication(
    site_a: LocalSite,
    site_b: LocalSite,
    tmp_path: Path,
    previous_release: Path,
    nodes: list[NodeProcess],
) -> None:
    a_cfg = site_a.write_config(tmp_path / "a.toml", peer=site_b)
    b_cfg = site_b.write_config(tmp_path / "b.toml", peer=site_a)
    # Both sites on the previous release, replicating.
    old_a = Previous(previous_release, a_cfg)
    done = old_a("init")
    assert done.returncode == 0 and "revision 0007" in done.stdout, done.stderr
    setup_vpn(site_a)
    done = old_a("vpn", "enable", VPN, "--role", "active", "--mode", "sync", "--queues", SCOPE)
    assert done.returncode == 0, done.stderr
    assert Previous(previous_release, b_cfg)("init").returncode == 0
    node_a = NodeProcess(site_a, a_cfg, tmp_path / "a-old.log", "a (previous)", previous_release)
    node_b = NodeProcess(site_b, b_cfg, tmp_path / "b-old.log", "b (previous)", previous_release)
    nodes += [node_a, node_b]
    node_a.start()
    node_b.start()
    publish(site_a, range(0, 50))

    # 1. The standby is upgraded: stop, migrate, start this release.
    assert node_b.stop() == 0
    assert Vpnrepl(b_cfg)("init").returncode == 0
    node_b = NodeProcess(site_b, b_cfg, tmp_path / "b-new.log", "b")
    nodes.append(node_b)
    node_b.start()
    publish(site_a, range(50, 100))  # replicated meanwhile, in sync mode
    assert_same_state(node_a, node_b)
    assert f"speaking version {PREVIOUS_PROTOCOL_VERSION}" in node_b.log_text()
    assert f"(protocol version {PREVIOUS_PROTOCOL_VERSION})" in node_b.log_text()
    # the old active's whole-name pattern, stored with its meaning
    stored = scalar(site_b, "SELECT queue_patterns FROM vpn_config WHERE name = %s", VPN)
    assert stored == [f"\\A(?:{SCOPE})\\Z"]

    # 2. The active is upgraded: its clients reconnect to the new node.
    assert node_a.stop() == 0
    done = Vpnrepl(a_cfg)("init")
    assert done.returncode == 0 and "to revision 0011" in done.stdout, done.stderr
    node_a = NodeProcess(site_a, a_cfg, tmp_path / "a-new.log", "a")
    nodes.append(node_a)
    node_a.start()
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "the standby to reconnect")
    publish(site_a, range(100, 150))
    rows = assert_same_state(node_a, node_b)
    assert len(rows) == sum(len(("orders.q2",) if n % 5 == 0 else IN_SCOPE) for n in range(150))
    assert f"(protocol version {PROTOCOL_VERSION})" in node_a.log_text()  # the newest again
    assert scalar(site_a, "SELECT queue_patterns FROM vpn_config WHERE name = %s", VPN) == [
        f"\\A(?:{SCOPE})\\Z"
    ]
