"""``vpnrepl demo``: two local sites, a workload, and (once it lands) a promotion.

Starts private RabbitMQ and PostgreSQL servers for sites ``a`` (active) and
``b`` (standby) in a temporary directory, runs ``vpnrepl node`` for each,
enables replication of VPN ``orders`` on ``a``, publishes and consumes through
``a``'s listener with an unchanged pika client, and shows both sites'
``status`` converging. Promotion (``vpnrepl promote``) has not landed yet: the
demo says so and exits 1 rather than pretend.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._errors import PluginError
from ._localsites import LocalNode, LocalSite, LocalSites

__all__ = ["run_demo"]

MESSAGES = 2000
CONSUME = 800


def _say(text: str) -> None:
    print(f"demo: {text}", flush=True)


def _cli(config: Path, *args: str) -> str:
    result = subprocess.run(  # noqa: S603 - our own console script
        [sys.executable, "-m", "plugin", "--config", str(config), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if result.returncode != 0:
        raise PluginError(f"vpnrepl {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def _topology(site: LocalSite) -> None:
    """The VPN's topology, declared by its owner at the broker before the
    nodes start (the node loads it from the management API)."""
    import pika

    site.rabbit.add_vhost("orders")
    direct = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url("orders")))
    ch = direct.channel()
    ch.exchange_declare("events", "topic", durable=True)
    for queue in ("orders.created", "orders.audit"):
        ch.queue_declare(queue, durable=True)
        ch.queue_bind(queue, "events", "order.#")
    direct.close()


def _workload(site: LocalSite) -> None:
    import pika  # the demo's client, unchanged: it only points at the listener

    conn = pika.BlockingConnection(
        pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{site.amqp_port}/orders")
    )
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(MESSAGES):
        ch.basic_publish(
            "events", "order.created", b"order %d" % i, pika.BasicProperties(delivery_mode=2)
        )
    _say(f"published {MESSAGES} persistent messages through site a's listener, all confirmed")
    for _ in range(CONSUME):
        method, _, _ = ch.basic_get("orders.created")
        ch.basic_ack(method.delivery_tag)
    _say(f"consumed and acked {CONSUME} of them from orders.created")
    conn.close()


def run_demo() -> int:
    with tempfile.TemporaryDirectory(prefix="vpnrepl-demo-") as tmp:
        base = Path(tmp)
        base.chmod(0o755)  # PostgreSQL runs as `postgres` and must reach its directory
        (base / "sites").mkdir()
        sites = LocalSites(base / "sites")
        nodes: list[LocalNode] = []
        try:
            _say("starting two RabbitMQ nodes and two PostgreSQL clusters")
            sites.start()
            a_cfg = sites.a.write_config(base / "a.toml")
            b_cfg = sites.b.write_config(base / "b.toml", peer=sites.a)
            for cfg in (a_cfg, b_cfg):
                _cli(cfg, "init")
            _cli(
                a_cfg,
                "vpn",
                "enable",
                "orders",
                "--role",
                "active",
                "--mode",
                "sync",
                "--queues",
                r"orders\..*",
            )
            _topology(sites.a)
            _say("site a: VPN orders enabled as active, sync mode")
            for site, cfg in ((sites.a, a_cfg), (sites.b, b_cfg)):
                nodes.append(LocalNode(site, cfg, base / f"node-{site.name}.log"))
                nodes[-1].start()
            _say("site b: standby of site a (learns the VPN through config-sync)")
            _workload(sites.a)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                a_vpns = nodes[0].status()["vpns"]
                b_vpns = nodes[1].status()["vpns"]
                if (
                    isinstance(a_vpns, list)
                    and isinstance(b_vpns, list)
                    and a_vpns
                    and b_vpns
                    and a_vpns[0]["ledger_index"] == b_vpns[0]["applied_index"]
                ):
                    break
                time.sleep(0.2)
            print(_cli(a_cfg, "status"), end="", flush=True)
            print(_cli(b_cfg, "status"), end="", flush=True)
            _say("promotion of site b: `vpnrepl promote` is not implemented yet")
            return 1
        finally:
            for node in nodes:
                node.stop()
            sites.close()
