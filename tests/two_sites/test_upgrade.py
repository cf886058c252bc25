"""Upgrading the sites one at a time, as the README's procedure says: the
standby first, then the active, without stopping replication.

The previous release is the real one: its packages are taken from this
repository's history (``git archive`` of :data:`PREVIOUS_RELEASE`, 0.2.0:
bridge protocol version 5, schema revision 0011) and run as a node and a
CLI of their own next to this release's. Either end may be the old one: a
new active sends an old standby each topology event as a no-op, and each
new end says in one log line what the old one cannot take."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from bridge.wire import PREVIOUS_PROTOCOL_VERSION, PROTOCOL_VERSION
from plugin.devtools import LocalSite
from tests import REPO
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.prometheus import value
from tests.support.two_sites import (
    SCOPE,
    VPN,
    Publisher,
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

#: release 0.2.0: bridge protocol version 5, schema revision 0011
PREVIOUS_RELEASE = "dd0b344e3f8563a0ecb5020e3ba57b13bf3f9715"


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


def previous_config(site: LocalSite, peer: LocalSite, path: Path) -> Path:
    """A config as the previous release reads it: one ``[peer]`` table
    without a name, the bridge in plain TCP (its default)."""
    text = site.config_text(tls=False)
    text += f'\n[peer]\nbridge = "127.0.0.1:{peer.bridge_port}"\nstore_dsn = "{peer.pg.dsn()}"\n'
    path.write_text(text)
    return path


def this_release_config(site: LocalSite, peer: LocalSite, path: Path) -> Path:
    """The same site's config as this release reads it (the README's upgrade
    step): the peer named, and the plain TCP bridge an explicit opt-out."""
    text = site.config_text(peer, tls=False) + "\n[insecure]\nplaintext_bridge = true\n"
    path.write_text(text)
    return path


def both_on_the_previous_release(
    site_a: LocalSite, site_b: LocalSite, tmp_path: Path, previous_release: Path
) -> tuple[Path, Path, NodeProcess, NodeProcess]:
    """Both sites on the previous release, replicating 50 messages in sync mode."""
    a_cfg = previous_config(site_a, site_b, tmp_path / "a.toml")
    b_cfg = previous_config(site_b, site_a, tmp_path / "b.toml")
    old_a = Previous(previous_release, a_cfg)
    done = old_a("init")
    assert done.returncode == 0 and "revision 0011" in done.stdout, done.stderr
    setup_vpn(site_a)
    done = old_a("vpn", "enable", VPN, "--role", "active", "--mode", "sync", "--queues", SCOPE)
    assert done.returncode == 0, done.stderr
    assert Previous(previous_release, b_cfg)("init").returncode == 0
    node_a = NodeProcess(site_a, a_cfg, tmp_path / "a-old.log", "a (previous)", previous_release)
    node_b = NodeProcess(site_b, b_cfg, tmp_path / "b-old.log", "b (previous)", previous_release)
    node_a.start()
    node_b.start()
    publish(site_a, range(0, 50))
    return a_cfg, b_cfg, node_a, node_b


def upgraded(
    site: LocalSite, peer: LocalSite, cfg: Path, old: NodeProcess, log: Path, name: str
) -> NodeProcess:
    """Stop the old node, install this release's config (a file of the
    previous release is refused: ``[peer]`` has no name), migrate the
    schema, start this release's node."""
    assert old.stop() == 0
    refused = Vpnrepl(cfg)("init")
    assert refused.returncode == 2 and "peer.name: required key is missing" in refused.stderr
    this_release_config(site, peer, cfg)
    done = Vpnrepl(cfg)("init")
    assert done.returncode == 0 and "to revision 0018" in done.stdout, done.stderr
    node = NodeProcess(site, cfg, log, name)
    node.start()
    return node


def declare_and_publish(site: LocalSite, queue: str, numbers: range) -> None:
    """A queue declared and bound through the listener (a topology event),
    then messages routed to it and to the others."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(site)))
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    ch.queue_bind(queue, "events", "order.#")
    conn.close()
    publish(site, numbers)


def test_the_standby_then_the_active_upgraded_without_stopping_replication(
    site_a: LocalSite,
    site_b: LocalSite,
    tmp_path: Path,
    previous_release: Path,
    nodes: list[NodeProcess],
) -> None:
    a_cfg, b_cfg, node_a, node_b = both_on_the_previous_release(
        site_a, site_b, tmp_path, previous_release
    )
    nodes += [node_a, node_b]

    # 1. The standby is upgraded: it speaks version 5 to the old active.
    node_b = upgraded(site_b, site_a, b_cfg, node_b, tmp_path / "b-new.log", "b")
    nodes.append(node_b)
    declare_and_publish(site_a, "orders.q3", range(50, 100))  # replicated meanwhile, sync
    assert_same_state(node_a, node_b)
    assert f"speaking version {PREVIOUS_PROTOCOL_VERSION}" in node_b.log_text()
    assert f"(protocol version {PREVIOUS_PROTOCOL_VERSION})" in node_b.log_text()
    lines = [line for line in node_b.log_text().splitlines() if "active site 'a'" in line]
    lines = [line for line in lines if "lacks topology" in line]
    assert len(lines) == 1, node_b.log_text()
    assert "only by its listings" in lines[0]

    # 2. The active is upgraded: its clients reconnect to the new node.
    node_a = upgraded(site_a, site_b, a_cfg, node_a, tmp_path / "a-new.log", "a")
    nodes.append(node_a)
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "the standby to reconnect")
    declare_and_publish(site_a, "orders.q4", range(100, 150))
    rows = assert_same_state(node_a, node_b)
    assert {queue for queue, *_ in rows} >= {"orders.q3", "orders.q4"}
    assert f"(protocol version {PROTOCOL_VERSION})" in node_a.log_text()  # the newest again
    assert ") lacks " not in node_a.log_text()
    changes = scalar(site_b, "SELECT count(*) FROM topology_change WHERE vpn = %s", VPN)
    assert changes >= 2  # orders.q4's declare and bind came in the stream


def test_an_active_upgraded_first_still_replicates_to_the_previous_release(
    site_a: LocalSite,
    site_b: LocalSite,
    tmp_path: Path,
    previous_release: Path,
    nodes: list[NodeProcess],
) -> None:
    """Against the README's order, the active first: the old standby gets
    each topology event as a no-op at its index (no gap, no resync) and the
    new active says once what it cannot receive."""
    a_cfg, _, node_a, node_b = both_on_the_previous_release(
        site_a, site_b, tmp_path, previous_release
    )
    nodes += [node_a, node_b]
    node_a = upgraded(site_a, site_b, a_cfg, node_a, tmp_path / "a-new.log", "a")
    nodes.append(node_a)
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "the standby to reconnect")
    declare_and_publish(site_a, "orders.q3", range(50, 100))
    rows = assert_same_state(node_a, node_b)
    assert "orders.q3" in {queue for queue, *_ in rows}
    lines = [line for line in node_a.log_text().splitlines() if "standby site 'b'" in line]
    lines = [line for line in lines if ") lacks " in line]
    assert len(lines) == 1 and "topology events" in lines[0], node_a.log_text()
    assert f"(protocol version {PREVIOUS_PROTOCOL_VERSION})" in node_a.log_text()
    assert "gap" not in node_b.log_text().lower()


def _sighup(node: NodeProcess) -> None:
    assert node.pid is not None
    os.kill(node.pid, signal.SIGHUP)


def _authenticated(node: NodeProcess) -> bool:
    return value(node.get("/metrics"), "vpnrepl_bridge_authenticated") == 1


def test_a_plaintext_pair_moves_to_mutual_tls_with_no_client_outage(
    site_a: LocalSite, site_b: LocalSite, tmp_path: Path, nodes: list[NodeProcess]
) -> None:
    """README "Moving a plaintext pair to mutual TLS": certificates added
    beside the opt-out, then the opt-out removed one site at a time, each
    step a config edit and a SIGHUP; a client publishes through the active
    all along, and the bridge ends as mutual TLS."""
    a_cfg = this_release_config(site_a, site_b, tmp_path / "a.toml")
    b_cfg = this_release_config(site_b, site_a, tmp_path / "b.toml")
    for cfg in (a_cfg, b_cfg):
        assert Vpnrepl(cfg)("init").returncode == 0
    setup_vpn(site_a)
    done = Vpnrepl(a_cfg)("vpn", "enable", VPN, "--role", "active", "--mode", "sync",
                          "--queues", SCOPE)  # fmt: skip
    assert done.returncode == 0, done.stderr
    node_a = NodeProcess(site_a, a_cfg, tmp_path / "a.log", "a")
    node_b = NodeProcess(site_b, b_cfg, tmp_path / "b.log", "b")
    nodes += [node_a, node_b]
    node_a.start()
    node_b.start()
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "B to follow A, plain TCP")
    client = Publisher(site_a, range(1, 1_000_000), window=20).start()

    def step(name: str, *changes: tuple[NodeProcess, LocalSite, Path, bool]) -> None:
        for node, site, cfg, plaintext in changes:
            peer = site_b if site is site_a else site_a
            text = site.config_text(peer, tls=True)
            cfg.write_text(text + ("\n[insecure]\nplaintext_bridge = true\n" if plaintext else ""))
            _sighup(node)
        confirmed = len(client.confirmed)
        until(lambda: len(client.confirmed) > confirmed + 50, f"the client to go on: {name}")
        until(lambda: vpn_status(node_a).get("bridge") == "connected", f"the bridge: {name}")
        assert client.error is None, f"{name}: {client.error}"

    step("certificates beside the opt-out", (node_a, site_a, a_cfg, True),
         (node_b, site_b, b_cfg, True))  # fmt: skip
    assert not _authenticated(node_a) and not _authenticated(node_b)
    step("the standby TLS only", (node_b, site_b, b_cfg, False))
    until(lambda: "dropping the plain TCP link" in node_b.log_text(), "B to drop plain TCP")
    assert _authenticated(node_b) and not _authenticated(node_a)
    step("the active TLS only", (node_a, site_a, a_cfg, False))
    assert _authenticated(node_a)
    # B was on TLS already: A had no plain TCP link left to drop
    assert "dropping plain TCP link" not in node_a.log_text()
    assert "new standby connections: mutual TLS" in node_a.log_text()
    client.stop()
    client.join()
    assert client.error is None and not client.nacked
    for node in (node_a, node_b):
        assert node.proc is not None and node.proc.poll() is None  # never restarted
    assert_same_state(node_a, node_b)
