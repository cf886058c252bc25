"""``vpnrepl demo``: two local sites, a workload, a disaster, a failback.

Starts private RabbitMQ and PostgreSQL servers for sites ``a`` (active) and
``b`` (standby) in a temporary directory, runs ``vpnrepl node`` for each
(each names the other as its peer), enables replication of VPN ``orders`` on
``a``, publishes and consumes through ``a``'s listener with an unchanged pika
client, and shows both sites' ``status`` converging. Then the disaster: ``a``'s
node is killed, ``b`` is promoted and serves the same client; ``a`` comes back
fenced, is demoted (its unreplicated tail exported) and follows ``b``; a
switchover makes ``a`` the active site again. Every step prints both statuses.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from plugin._errors import PluginError

from ._localnode import LocalNode
from ._localsites import LocalSite, LocalSites

__all__ = ["run_demo"]

#: how old the broker's statistics (the queue depths status shows) may be
STATS_SECONDS = 1.5
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


def _drain(site: LocalSite, queue: str, count: int) -> int:
    """Consume and ack ``count`` messages of ``queue`` through ``site``'s
    listener; returns how many the queue held before."""
    import pika

    conn = pika.BlockingConnection(
        pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{site.amqp_port}/orders")
    )
    ch = conn.channel()
    held = int(ch.queue_declare(queue, passive=True).method.message_count)
    for _ in range(count):
        method, _, _ = ch.basic_get(queue)
        ch.basic_ack(method.delivery_tag)
    conn.close()
    return held


def _statuses(*configs: Path) -> None:
    time.sleep(STATS_SECONDS)  # the broker's queue depths come from its statistics
    for cfg in configs:
        print(_cli(cfg, "status"), end="", flush=True)


def _converged(active: LocalNode, standby: LocalNode, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            a_vpns = active.status()["vpns"]
            b_vpns = standby.status()["vpns"]
            if (
                a_vpns
                and b_vpns
                and b_vpns[0]["role"] == "standby"
                and b_vpns[0]["bridge"] == "connected"
                and a_vpns[0]["ledger_index"] == b_vpns[0]["applied_index"]
            ):
                return
        time.sleep(0.2)
    raise PluginError("the standby did not catch up within a minute")


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
            a_cfg = sites.a.write_config(base / "a.toml", peer=sites.b)
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
            node_a, node_b = nodes
            _say("site b: standby of site a (learns the VPN through config-sync)")
            _workload(sites.a)
            _converged(node_a, node_b)
            _statuses(a_cfg, b_cfg)

            _say("disaster: site a's node is killed (SIGKILL)")
            node_a.kill()
            _say("site b: vpnrepl promote orders")
            print(_cli(b_cfg, "promote", "orders"), end="", flush=True)
            held = _drain(sites.b, "orders.created", 200)
            _say(
                f"the same client, pointed at site b's listener: orders.created holds {held} "
                "messages; consumed and acked 200 of them"
            )
            _statuses(b_cfg)

            _say("site a comes back: its node learns of epoch 2 and fences the VPN")
            node_a.start()
            deadline = time.monotonic() + 30
            while not node_a.status()["vpns"][0]["fenced"] and time.monotonic() < deadline:
                time.sleep(0.2)
            _statuses(a_cfg)
            _say("site a: vpnrepl demote orders (exports what b never got, then follows b)")
            print(
                _cli(a_cfg, "demote", "orders", "--export", str(base / "tail.jsonl")),
                end="",
                flush=True,
            )
            _converged(node_b, node_a)
            _statuses(b_cfg, a_cfg)

            _say("failback: site a: vpnrepl switchover orders")
            print(_cli(a_cfg, "switchover", "orders"), end="", flush=True)
            _converged(node_a, node_b)
            _statuses(a_cfg, b_cfg)
            _say("site a is the active site again; nothing confirmed was lost")
            return 0
        finally:
            for node in nodes:
                node.stop()
            sites.close()
