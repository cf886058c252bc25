"""A failover never depends on the last definitions listing: queues,
exchanges and bindings a client made through the listener after the
standby's last listing, and a queue deleted just before the disaster, are
what the promoted site's broker has, with the type and arguments the
client declared, and every confirmed message is in its queue.

The standby's only listing is the one it took when the bridge connected,
before any of these existed (checked: the test would prove nothing if a
listing had caught them); the active's node is killed within two seconds
of the last change and stays down while the promoted site is checked."""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import quote

import pika

from plugin.devtools import LocalSite
from tests.fix_node import Sites
from tests.support.two_sites import SCOPE, VPN, amqp_url, queue_numbers, scalar, until, vpn_status
from tests.two_sites.test_failover import sites  # noqa: F401 - the fixture

FANOUT = "orders.fan"
CLASSIC_ARGS = {"x-message-ttl": 3_600_000, "x-queue-mode": "lazy"}


def queue_on(site: LocalSite, name: str) -> dict[str, Any] | None:
    found = [q for q in site.rabbit.api("GET", f"queues/{VPN}") if q["name"] == name]
    return found[0] if found else None


def bindings_on(site: LocalSite) -> set[tuple[str, str, str]]:
    listed = site.rabbit.api("GET", f"bindings/{VPN}")
    return {(b["source"], b["destination"], b["routing_key"]) for b in listed if b["source"]}


def test_a_topology_younger_than_the_last_listing_survives_the_loss_of_the_active(
    sites: Sites,  # noqa: F811 - the fixture imported above
) -> None:
    site_a, site_b = sites.a.site, sites.b.site
    site_a.rabbit.add_vhost(VPN)
    done = sites.cli_a("vpn", "enable", VPN, "--role", "active", "--mode", "sync",
                       "--queues", SCOPE)  # fmt: skip
    assert done.returncode == 0, done.stderr
    sites.a.start()
    sites.b.start()
    until(lambda: vpn_status(sites.b).get("bridge") == "connected", "the standby to connect")

    # Everything below is younger than the standby's listing.
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(site_a)))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.exchange_declare(FANOUT, "fanout", durable=True)
    ch.queue_declare("orders.q1", durable=True, arguments=CLASSIC_ARGS)
    ch.queue_declare("orders.q2", durable=True, arguments={"x-queue-type": "quorum"})
    ch.queue_declare("orders.gone", durable=True)
    for queue in ("orders.q1", "orders.q2", "orders.gone"):
        ch.queue_bind(queue, FANOUT, routing_key="")
    confirmed: list[int] = []
    persistent = pika.BasicProperties(delivery_mode=2)
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < 3.0:
        ch.basic_publish(FANOUT, "", str(n).encode(), persistent)  # confirmed: sync mode
        confirmed.append(n)
        n += 1
    ch.queue_bind("orders.q1", "amq.topic", "late.key")  # a second before the disaster
    ch.queue_delete("orders.gone")
    for _ in range(20):
        ch.basic_publish(FANOUT, "", str(n).encode(), persistent)
        confirmed.append(n)
        n += 1
    conn.close()
    time.sleep(1.0)
    sites.a.kill()  # the active's node is gone for good (its broker stays: it is not asked)

    stored = json.loads(scalar(site_b, "SELECT definitions FROM vpn_config WHERE name = %s", VPN))
    assert not [q for q in stored["queues"] if q["name"].startswith("orders.")], (
        "the standby listed the young topology: this test proves nothing"
    )
    held = vpn_status(sites.b)["definitions"]
    # exchange, three queues, three bindings, the late binding, the delete
    assert held["listed"] and held["streamed_changes"] == 9, held
    assert 'vpnrepl_topology_changes_streamed{vpn="orders"} 9.0' in sites.b.get("/metrics")
    done = sites.cli_b("promote", VPN)
    assert done.returncode == 0, done.stderr + done.stdout

    q1, q2 = queue_on(site_b, "orders.q1"), queue_on(site_b, "orders.q2")
    assert q1 is not None and q1["durable"] and q1["arguments"] == CLASSIC_ARGS
    assert q1["type"] == "classic"
    assert q2 is not None and q2["type"] == "quorum" and q2["durable"]
    assert queue_on(site_b, "orders.gone") is None
    exchange = site_b.rabbit.api("GET", f"exchanges/{VPN}/{quote(FANOUT, safe='')}")
    assert exchange["type"] == "fanout" and exchange["durable"]
    assert bindings_on(site_b) >= {
        (FANOUT, "orders.q1", ""),
        (FANOUT, "orders.q2", ""),
        ("amq.topic", "orders.q1", "late.key"),
    }
    assert not {b for b in bindings_on(site_b) if b[1] == "orders.gone"}
    for queue in ("orders.q1", "orders.q2"):
        got = queue_numbers(site_b, queue)
        assert got == confirmed, f"{queue}: {len(got)} of {len(confirmed)} confirmed messages"
    assert sites.a.proc is not None and sites.a.proc.poll() is not None  # still down
