"""Commit markers in a real RabbitMQ (txn/local/_markers.py): a lookup sees
every marker published since a time and removes none, a message that
reached the marker stream without the site's tag is no marker, and the
classic queue of earlier releases is read until it is retired."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pika
import pika.exceptions
import pytest

from bridge import MARKER_QUEUE
from plugin.devtools import LocalSite
from tests.fix_listener import ListenerThread, enable_vpn
from tests.support.markers import marker_bodies
from tests.support.two_sites import setup_vpn
from txn import MarkerKey
from txn.local import LEGACY_MARKER_QUEUE, MarkerStore, _markers as markers_module


def _declared(site: LocalSite) -> tuple[MarkerStore, pika.BlockingConnection, Any]:
    """A store of vhost ``v``'s markers, its stream declared, and a
    confirming channel to publish into it directly."""
    site.rabbit.add_vhost("v")
    store = MarkerStore(site.rabbit.amqp_url())
    asyncio.run(store.declare("v"))
    conn = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url("v")))
    ch = conn.channel()
    ch.confirm_delivery()
    return store, conn, ch


def test_a_lookup_sees_every_marker_since_its_time_and_removes_none(site_a: LocalSite) -> None:
    """Markers are read, never taken: four lookups at once each see all of
    them, and a read leaves them in the stream; forged messages are no
    markers and are counted once however often they are read."""
    began = time.time()
    store, conn, ch = _declared(site_a)
    txids = [f"tx-{n}" for n in range(300)]
    for txid in txids:
        ch.basic_publish("", MARKER_QUEUE, store.body("v", txid))
    # forged: untagged, another key's tag, another vhost's tag, not text
    other = MarkerKey.new()
    for body in (b"tx-1", other.body("v", "tx-2"), store.body("w", "tx-3"), b"\xff tx"):
        ch.basic_publish("", MARKER_QUEUE, body)
    conn.close()

    async def overlapping() -> list[set[str]]:
        return list(await asyncio.gather(*(store.present("v", began) for _ in range(4))))

    assert asyncio.run(overlapping()) == [set(txids)] * 4
    assert store.forged == {"v": 4}
    assert asyncio.run(store.present("v", began)) == set(txids)
    assert store.forged == {"v": 4}  # counted once
    # a lookup for some names keeps only those, and stops once it found them all
    assert asyncio.run(store.present("v", began, {"tx-7", "tx-never"})) == {"tx-7"}
    assert asyncio.run(store.present("v", began, {"tx-7", "tx-9"})) == {"tx-7", "tx-9"}
    assert asyncio.run(store.remove("v", set(txids))) == 0  # a stream keeps its markers
    bodies = marker_bodies(site_a.rabbit.amqp_url("v"))
    assert [b for b in bodies if store.key.name_of("v", b) in txids] == [
        store.body("v", t) for t in txids
    ]


def test_a_lookup_dated_after_the_brokers_clock_reads_the_whole_stream(
    site_a: LocalSite, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A transaction dated an hour ahead of the broker's clock (PostgreSQL's
    clock stepped forward): its lookup never sees its probe from that time,
    so it reads the stream from its start and finds the marker, rather than
    answer "no marker" (which would abort a committed transaction)."""
    store, conn, ch = _declared(site_a)
    ch.basic_publish("", MARKER_QUEUE, store.body("v", "tx-ahead"))
    conn.close()
    monkeypatch.setattr(markers_module, "READ_IDLE_SECONDS", 1.0)
    assert asyncio.run(store.present("v", time.time() + 3600)) == {"tx-ahead"}
    assert "PostgreSQL clock is ahead of RabbitMQ's" in caplog.text


def test_a_lookup_reads_from_its_time(site_a: LocalSite, monkeypatch: pytest.MonkeyPatch) -> None:
    """Markers older than the lookup's time (less the clock slack, here
    none) are not read: a lookup costs the markers since its transaction
    began, not the stream's whole retention."""
    store, conn, ch = _declared(site_a)
    ch.basic_publish("", MARKER_QUEUE, store.body("v", "old"))
    time.sleep(2.1)  # the stream's offsets by time are in whole seconds
    since = time.time()
    ch.basic_publish("", MARKER_QUEUE, store.body("v", "new"))
    conn.close()
    monkeypatch.setattr(markers_module, "CLOCK_SLACK_SECONDS", 0.0)
    assert asyncio.run(store.present("v", since)) == {"new"}
    monkeypatch.setattr(markers_module, "CLOCK_SLACK_SECONDS", 60.0)
    assert asyncio.run(store.present("v", since)) == {"old", "new"}


def test_the_legacy_queue_is_read_until_retired(site_a: LocalSite) -> None:
    """A vhost upgraded from the classic marker queue: its markers count
    until recovery acks those no prepared transaction needs; the queue is
    deleted once the last one is settled."""
    site_a.rabbit.add_vhost("v")
    store = MarkerStore(site_a.rabbit.amqp_url())
    conn = pika.BlockingConnection(pika.URLParameters(site_a.rabbit.amqp_url("v")))
    ch = conn.channel()
    ch.queue_declare(LEGACY_MARKER_QUEUE, durable=True, arguments={"x-queue-type": "classic"})
    ch.confirm_delivery()
    for txid in ("tx-1", "tx-2", "tx-3"):
        ch.basic_publish("", LEGACY_MARKER_QUEUE, store.body("v", txid))
    ch.basic_publish("", LEGACY_MARKER_QUEUE, b"forged")

    def legacy_depth() -> int:
        return int(ch.queue_declare(LEGACY_MARKER_QUEUE, passive=True).method.message_count)

    now = time.time()
    assert asyncio.run(store.present("v", now)) == {"tx-1", "tx-2", "tx-3"}
    assert legacy_depth() == 4  # read, not taken
    assert asyncio.run(store.retire_legacy("v", keep={"tx-2"})) is False
    assert legacy_depth() == 1
    assert store.forged == {"v": 1}
    assert asyncio.run(store.present("v", now)) == {"tx-2"}  # still proves tx-2's commit
    assert asyncio.run(store.remove("v", {"tx-2"})) == 1
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as gone:
        legacy_depth()
    assert gone.value.reply_code == 404
    conn.close()
    assert asyncio.run(store.present("v", now)) == set()
    assert asyncio.run(store.retire_legacy("v", keep=())) is True


def test_a_message_a_client_routes_into_the_marker_stream_is_no_marker(
    site_a: LocalSite, listener_a: ListenerThread
):
    """The listener cannot follow every route a message may take: one
    published to another exchange with a ``CC`` naming the marker stream,
    to a queue that dead-letters to the default exchange, reaches it. A
    lookup must not take it for a marker: it lacks the site's tag."""
    setup_vpn(site_a)
    enable_vpn(listener_a, site_a, "orders", queues=("orders.q1",))
    markers = MarkerStore(site_a.rabbit.amqp_url(), key=listener_a.listener.marker_key)
    began = time.time()
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
            pika.BasicProperties(delivery_mode=2, headers={"CC": [MARKER_QUEUE]}),
        )
        ch.queue_declare("orders.expires", passive=True)  # a round trip: the publish is in
    finally:
        conn.close()
    admin = pika.BlockingConnection(pika.URLParameters(site_a.rabbit.amqp_url("orders")))
    try:
        deadline = time.monotonic() + 10
        while admin.channel().queue_declare("orders.expires", passive=True).method.message_count:
            assert time.monotonic() < deadline, "the message was never dead-lettered"
            time.sleep(0.05)
    finally:
        admin.close()
    reached = forged_txid.encode() in marker_bodies(site_a.rabbit.amqp_url("orders"))
    # RabbitMQ 3.10 does not dead-letter into a stream; a release that does
    # puts it there, and either way it is no marker
    assert asyncio.run(markers.present("orders", began)) == set()
    assert markers.forged == ({"orders": 1} if reached else {})
