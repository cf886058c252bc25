"""``vpnrepl sandbox start --brokers 2``: each site's RabbitMQ a cluster of
two nodes, its config listing both, ``stop`` taking every server down."""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
import tomllib
import urllib.request
from pathlib import Path

import pytest

from tests.fix_cli import Vpnrepl


@pytest.mark.fault  # six servers to start; the default suite's sandbox is test_wheel's
def test_a_sandbox_of_clustered_sites_lists_every_node_and_stops_them_all() -> None:
    # under /tmp, which the postgres user reaches
    where = Path(tempfile.mkdtemp(prefix="vpnrepl-sandbox-")) / "s"
    where.parent.chmod(0o755)
    vpnrepl = Vpnrepl(where / "a.toml")
    try:
        started = vpnrepl("sandbox", "start", str(where), "--brokers", "2", config=False)
        assert started.returncode == 0, started.stderr
        assert "a cluster of 2 nodes per site" in started.stdout
        broker = tomllib.loads((where / "a.toml").read_text())["broker"]
        assert len(broker["amqp_url"]) == len(broker["management_url"]) == 2
        env = dict(
            line.removeprefix("export ").split("=", 1)
            for line in (where / "sandbox.env").read_text().splitlines()
        )
        assert len(env["SITE_A_BROKERS"].split(",")) == len(env["SITE_B_BROKERS"].split(",")) == 2
        request = urllib.request.Request(f"http://{env['SITE_A_MANAGEMENT']}/api/nodes")
        request.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
        with urllib.request.urlopen(request, timeout=30) as answer:  # noqa: S310 - loopback
            nodes = json.loads(answer.read())
        assert len(nodes) == 2 and all(n["running"] for n in nodes), nodes  # one cluster
    finally:
        stopped = vpnrepl("sandbox", "stop", str(where), config=False)
        shutil.rmtree(where.parent, ignore_errors=True)
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped (6 servers) and removed" in stopped.stdout  # 2 x (2 RabbitMQ + PostgreSQL)
