"""Commit markers in a real RabbitMQ (txn/local/_markers.py): recovery reads
every marker and removes none, a sweep removes exactly those it names and
every forged one, and a message that reached the marker queue without the
site's tag is no marker."""

from __future__ import annotations

import asyncio
import time

import pika

from bridge import MARKER_QUEUE
from plugin.devtools import LocalSite
from tests.fix_listener import ListenerThread, enable_vpn
from tests.support.two_sites import setup_vpn
from txn import MarkerKey
from txn.local import MarkerStore


def test_markers_are_read_without_removal_and_swept_by_name(site_a: LocalSite) -> None:
    """Recovery reads every marker and removes none; a sweep removes exactly
    the markers of the transactions it names, and every forged one, and
    leaves the others queued."""
    site_a.rabbit.add_vhost("v")
    store = MarkerStore(site_a.rabbit.amqp_url())
    asyncio.run(store.declare("v"))
    txids = [f"tx-{n}" for n in range(300)]
    conn = pika.BlockingConnection(pika.URLParameters(site_a.rabbit.amqp_url("v")))
    ch = conn.channel()
    ch.confirm_delivery()
    for txid in txids:
        body = store.body("v", txid)
        ch.basic_publish("", MARKER_QUEUE, body, pika.BasicProperties(delivery_mode=2))
    # forged: untagged, another key's tag, another vhost's tag, not text
    other = MarkerKey.new()
    for body in (b"tx-1", other.body("v", "tx-2"), store.body("w", "tx-3"), b"\xff tx"):
        ch.basic_publish("", MARKER_QUEUE, body, pika.BasicProperties(delivery_mode=2))

    def depth() -> int:
        return int(ch.queue_declare(MARKER_QUEUE, passive=True).method.message_count)

    assert asyncio.run(store.present("v")) == set(txids)
    assert depth() == 304

    async def overlapping() -> list[object]:
        # reads and a sweep at once: a marker one of them holds must not be
        # missing from another's answer (a missed marker aborts a commit)
        sweep = store.remove("v", {"tx-never-published"})
        return list(await asyncio.gather(*(store.present("v") for _ in range(4)), sweep))

    assert asyncio.run(overlapping()) == [set(txids)] * 4 + [0]
    assert depth() == 300  # the sweep removed the forged ones
    assert store.forged == {"v": 4}
    gone = set(txids[::3])
    assert asyncio.run(store.remove("v", gone | {"tx-never-published"})) == 100
    assert depth() == 200
    assert asyncio.run(store.present("v")) == set(txids) - gone
    assert asyncio.run(store.remove("v", set(txids))) == 200
    assert depth() == 0
    assert asyncio.run(store.present("v")) == set()
    conn.close()


def test_a_message_a_client_routes_into_the_marker_queue_is_no_marker(
    site_a: LocalSite, listener_a: ListenerThread
):
    """The listener cannot follow every route a message may take: one
    published to another exchange with a ``CC`` naming the marker queue,
    to a queue that dead-letters to the default exchange, reaches it. Recovery
    must not take it for a marker: it lacks the site's tag."""
    setup_vpn(site_a)
    enable_vpn(listener_a, site_a, "orders", queues=("orders.q1",))
    markers = MarkerStore(site_a.rabbit.amqp_url(), key=listener_a.listener.marker_key)
    asyncio.run(markers.declare("orders"))
    forged_txid = f"{listener_a.listener.ids.incarnation}.1.1.1"
    conn = pika.BlockingConnection(pika.URLParameters(listener_a.url("orders")))
    try:
        ch = conn.channel()
        ch.queue_declare(
            "orders.expires",
            durable=True,
            arguments={"x-dead-letter-exchange": "", "x-message-ttl": 0},
        )
        ch.queue_bind("orders.expires", "amq.direct", "k")
        ch.basic_publish(
            "amq.direct",
            "k",
            forged_txid.encode(),
            pika.BasicProperties(delivery_mode=2, headers={"CC": ["vpnrepl.txn-markers"]}),
        )
        ch.queue_declare("orders.expires", passive=True)  # a round trip: the publish is in
    finally:
        conn.close()
    admin = pika.BlockingConnection(pika.URLParameters(site_a.rabbit.amqp_url("orders")))
    try:
        ch = admin.channel()
        deadline = time.monotonic() + 10
        while ch.queue_declare("vpnrepl.txn-markers", passive=True).method.message_count == 0:
            assert time.monotonic() < deadline, "the dead-lettered message never reached it"
            time.sleep(0.05)
    finally:
        admin.close()
    assert asyncio.run(markers.present("orders")) == set()
    assert asyncio.run(markers.remove("orders", {"any"})) == 0
    assert markers.forged == {"orders": 1}
