"""Uncertain publishes: a broker killed under a publisher leaves replicated
publishes it never confirmed; the listener records them, ``status`` and
``/metrics`` count them, and ``reconcile --repair`` retires the ones the
broker does not hold (phantoms) from both sites' live state."""

from __future__ import annotations

import json
from typing import Any

import pika
import psycopg
import pytest

from plugin.devtools import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.prometheus import value
from tests.support.two_sites import (
    VPN,
    Publisher,
    assert_same_state,
    cli_status,
    enable,
    number,
    setup_vpn,
    until,
    vpn_status,
)
from tests.two_sites.test_reconcile import DRIFT, _reader_dsn


def uncertain_numbers(site: LocalSite) -> dict[str, set[int]]:
    """Queue -> numbers recorded uncertain and still live."""
    out: dict[str, set[int]] = {}
    with psycopg.connect(site.pg.dsn(), autocommit=True) as db:
        for queue, body in db.execute(
            "SELECT u.queue, m.body FROM uncertain_publish u JOIN live_message m"
            " ON m.vpn = u.vpn AND m.queue = u.queue AND m.repl_id = u.repl_id"
        ).fetchall():
            out.setdefault(str(queue), set()).add(number(bytes(body)))
    return out


def take_from_broker(site: LocalSite, queue: str, numbers: set[int]) -> int:
    """Ack ``numbers`` in ``queue`` at the broker itself (bypassing the
    listener): as if the broker had never taken them."""
    conn = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url(VPN)))
    ch = conn.channel()
    taken = 0
    for method, _props, payload in ch.consume(queue, inactivity_timeout=3):
        if method is None:
            break
        if number(payload) in numbers:
            ch.basic_ack(method.delivery_tag)
            taken += 1
            if taken == len(numbers):
                break
    conn.close()
    return taken


def kill_the_broker_under_a_publisher(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> tuple[Publisher, dict[str, set[int]]]:
    """RabbitMQ A killed under 500 publishes in flight, then started again:
    the publisher, and the uncertain publishes A recorded."""
    setup_vpn(site_a)
    enable(vpnrepl_a)
    vpnrepl_a.set_peer_store(_reader_dsn(site_b))
    with open(vpnrepl_a.config, "a") as f:
        f.write(DRIFT)
    node_a.start()
    node_b.start()
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "the standby to connect")
    publisher = Publisher(site_a, range(1, 50_001), window=500).start()
    until(lambda: len(publisher.confirmed) >= 2000, "2000 confirmed publishes")
    site_a.rabbit.kill()
    publisher.join()
    assert publisher.error is not None
    site_a.rabbit.start()
    until(lambda: uncertain_numbers(site_a), "the uncertain publishes to be recorded", 30)
    return publisher, uncertain_numbers(site_a)


def test_a_killed_broker_leaves_uncertain_publishes_counted(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    publisher, uncertain = kill_the_broker_under_a_publisher(
        site_a, site_b, vpnrepl_a, node_a, node_b
    )
    # recorded: only publishes the client was not told about
    recorded = set().union(*uncertain.values())
    assert not recorded & publisher.confirmed
    assert "recorded as uncertain" in node_a.log_text()
    count = sum(len(v) for v in uncertain.values())
    assert cli_status(node_a)["uncertain_publishes"] == count
    assert value(node_a.get("/metrics"), "vpnrepl_uncertain_publishes", vpn=VPN) == count


@pytest.mark.fault
def test_reconcile_repair_retires_the_phantoms_from_both_sites(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    _, uncertain = kill_the_broker_under_a_publisher(site_a, site_b, vpnrepl_a, node_a, node_b)
    count = sum(len(v) for v in uncertain.values())
    # the broker took some of them (or all, or none): make the rest of one
    # queue's phantoms too, as if the broker had taken none
    queue = "orders.q1"
    ghosts = uncertain[queue]
    take_from_broker(site_a, queue, ghosts)
    done = vpnrepl_a("reconcile", VPN, "--repair", "--json")
    assert done.returncode in (0, 3), done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    drift = doc["broker_drift"][queue]
    assert drift["phantoms"] == drift["retired"] == len(ghosts)
    rows = assert_same_state(node_a, node_b)
    assert not {number(bytes(r[6])) for r in rows if r[0] == queue} & ghosts
    assert queue not in uncertain_numbers(site_a)
    # (the other queue's, retired too if the broker had taken none of them)
    retired = sum(d.get("retired", 0) for d in doc["broker_drift"].values())
    assert cli_status(node_a)["uncertain_publishes"] == count - retired
