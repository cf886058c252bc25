"""Disaster recovery on the two-site harness, with unchanged pika clients:
the active's node is killed mid-stream, the standby is promoted, and what
the clients were told is checked against what the promoted site's broker
holds while the old active is still down; then the old active comes back
fenced."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pika
import pika.exceptions
import pytest

from plugin._localsites import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.two_sites import (
    IN_SCOPE,
    VPN,
    Publisher,
    amqp_url,
    cli_status,
    number,
    queues_of,
    setup_vpn,
    until,
    vpn_status,
)


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


@pytest.fixture
def sites(site_a: LocalSite, site_b: LocalSite, tmp_path: Path) -> Iterator[Sites]:
    s = Sites(site_a, site_b, tmp_path)
    try:
        yield s
    finally:
        s.a.kill()
        s.b.kill()
    for node in (s.a, s.b):
        assert "Traceback" not in node.log_text(), node.log_text()


def admin_active(site: LocalSite) -> int:
    url = f"http://127.0.0.1:{site.admin_port}/vpns/{quote(VPN, safe='')}/active"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - loopback
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def broker_contents(site: LocalSite, queue: str) -> list[int]:
    """The numbers in ``queue`` of ``site``'s broker, in queue order (read
    through the site's listener: a client of the promoted site)."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(site)))
    ch = conn.channel()
    got: list[int] = []
    while True:
        method, props, payload = ch.basic_get(queue)
        if method is None:
            break
        assert props.message_id == f"m-{number(payload):06d}"
        assert "x-vpnrepl-id" not in (props.headers or {})
        got.append(number(payload))
    conn.close()  # unacked: the messages go back to the queue
    return got


class AckingConsumer(threading.Thread):
    """Consumes ``queue`` through the site's listener, acking each delivery
    on its own; ``acked`` holds the numbers whose ack was sent, until the
    connection goes away (``error``)."""

    def __init__(self, site: LocalSite, queue: str) -> None:
        super().__init__(name=f"acking-{queue}", daemon=True)
        self.site, self.queue = site, queue
        self.acked: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = pika.BlockingConnection(pika.URLParameters(amqp_url(self.site)))
            ch = conn.channel()
            ch.basic_qos(prefetch_count=50)
            for method, _, payload in ch.consume(self.queue, inactivity_timeout=60):
                if method is None:
                    return
                ch.basic_ack(method.delivery_tag)
                self.acked.append(number(payload))
        except BaseException as e:  # the node was killed: what the test expects
            self.error = e


def test_failover_in_sync_mode_loses_nothing_a_client_was_told(sites: Sites) -> None:
    setup_vpn(sites.a.site)
    done = sites.cli_a("vpn", "enable", VPN, "--role", "active", "--queues", r"orders\..*",
                       "--mode", "sync", "--on-sync-timeout", "reject")  # fmt: skip
    assert done.returncode == 0, done.stderr
    sites.a.start()
    sites.b.start()
    until(lambda: vpn_status(sites.b).get("bridge") == "connected", "B to follow A")
    assert admin_active(sites.a.site) == 200 and admin_active(sites.b.site) == 503

    publisher = Publisher(sites.a.site, range(1, 20_001), window=200).start()
    consumer = AckingConsumer(sites.a.site, "orders.q1")
    consumer.start()
    until(lambda: len(publisher.confirmed) >= 1500, "1500 confirmed publishes")
    until(lambda: len(consumer.acked) >= 200, "200 acked deliveries")
    sites.a.kill()  # mid-stream: the publisher and the consumer lose their connections
    publisher.join()
    consumer.join(60)
    assert publisher.error is not None and "connection lost" in publisher.error
    assert not publisher.nacked
    assert consumer.error is not None  # its connection went with the node

    # promotion on B while A is still down, through B's running node
    promoted = sites.cli_b("promote", VPN)
    assert promoted.returncode == 0, promoted.stderr
    assert f"VPN '{VPN}' promoted to active at epoch 2" in promoted.stdout
    status = cli_status(sites.b)
    assert (status["role"], status["epoch"], status["promotion"]["state"]) == ("active", 2, "done")
    assert [(e["epoch"], e["site"]) for e in status["epochs"]][-1] == (2, "b")
    assert admin_active(sites.b.site) == 200

    removed = set(consumer.acked)
    for queue in IN_SCOPE:
        got = broker_contents(sites.b.site, queue)
        assert len(got) == len(set(got)), f"{queue}: a message twice"
        assert got == sorted(got), f"{queue}: not in publish order"
        confirmed = {n for n in publisher.confirmed if queue in queues_of(n)}
        missing = confirmed - set(got) - (removed if queue == "orders.q1" else set())
        assert not missing, (
            f"{queue}: confirmed and not consumed, missing on B: {sorted(missing)[:10]}"
        )
        # anything else is a publish the client was never told about (in flight at the kill)
        assert set(got) <= set(range(1, 20_001))
    # acks A had not made durable at the kill bring their messages back: counted
    back = removed & set(broker_contents(sites.b.site, "orders.q1"))
    print(f"acked on A but still on B after the promotion: {len(back)} of {len(removed)}")

    # the old active comes back: its peer holds the VPN at a higher epoch
    sites.a.start()
    until(lambda: cli_status(sites.a)["fenced"], "A to learn it is fenced")
    assert admin_active(sites.a.site) == 503
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(pika.URLParameters(amqp_url(sites.a.site)))
    assert "is now active on site 'b' (epoch 2)" in sites.a.log_text()
