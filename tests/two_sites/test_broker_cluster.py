"""A RabbitMQ cluster behind a site: site A is three broker nodes, site B
one. The listener spreads clients over A's nodes; when one dies, its
clients' connections close as they would connected to it directly, they
connect again through the listener and land on a live node, and nothing
confirmed is missing on either site."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from bridge import MARKER_QUEUE
from plugin.devtools import LocalSite, LocalSites
from plugin.topology import DEPTH_COLUMNS, replicable_depth
from sql import migrate
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.markers import marker_names
from tests.support.prometheus import value
from tests.support.two_sites import (
    amqp_url,
    assert_same_state,
    body,
    cli_status,
    enable,
    live_numbers,
    properties,
    queues_of,
    routing_key,
    scalar,
    setup_vpn,
    until,
)
from tests.support.xa_clients import Manager, app_database, app_rows, publish, resource, take
from txn.local import MARKER_ARGUMENTS


@pytest.fixture
def nodes(cluster_sites: LocalSites, tmp_path: Path) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    a, b = cluster_sites.a, cluster_sites.b
    for broker in a.rabbits:  # a node an earlier test killed comes back to its cluster
        if not broker.alive():
            broker.start()
    for site in (a, b):
        site.rabbit.reset()
        site.pg.reset()
    a_cfg = a.write_config(tmp_path / "a.toml", peer=b, dial=False)
    b_cfg = b.write_config(tmp_path / "b.toml", peer=a)
    for site in (a, b):
        migrate(site.pg.dsn())
    setup_vpn(a)  # on A's first node: its classic queues live there
    # the commit markers' stream leads on A's third node (the one the default
    # test kills): declared there before the node would declare it
    stream = pika.BlockingConnection(pika.URLParameters(a.rabbits[2].amqp_url("orders")))
    stream.channel().queue_declare(MARKER_QUEUE, durable=True, arguments=MARKER_ARGUMENTS)
    stream.close()
    enable(Vpnrepl(a_cfg))
    node_a = NodeProcess(a, a_cfg, tmp_path / "node-a.log", name="a")
    node_b = NodeProcess(b, b_cfg, tmp_path / "node-b.log", name="b")
    try:
        node_a.start()
        node_b.start()
        yield node_a, node_b
    finally:
        node_a.kill()
        node_b.kill()
    assert "Traceback" not in node_a.log_text(), node_a.log_text()


#: every client connection a test opened, closed after it whatever happened
_OPENED: list[pika.BlockingConnection] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _OPENED:
        conn = _OPENED.pop()
        with contextlib.suppress(pika.exceptions.AMQPError, OSError):
            if conn.is_open:
                conn.close()


def _client(site: LocalSite, name: str) -> tuple[pika.BlockingConnection, Any]:
    """A confirming publisher through the listener, named ``name`` (the
    listener relays the handshake: its upstream carries the name)."""
    params = pika.URLParameters(amqp_url(site))
    params.client_properties = {"connection_name": name}
    conn = pika.BlockingConnection(params)
    _OPENED.append(conn)
    ch = conn.channel()
    ch.confirm_delivery()
    return conn, ch


def _publish(ch: Any, numbers: range, confirmed: list[int]) -> None:
    """Publish ``numbers`` one by one; each that returns was confirmed."""
    for n in numbers:
        ch.basic_publish("events", routing_key(n), body(n), properties(n))
        confirmed.append(n)


def _homes(site: LocalSite, names: list[str]) -> dict[str, int] | None:
    """Which of the site's broker nodes holds each named client's upstream
    (None until the management API lists them all)."""
    index = {node.nodename: n for n, node in enumerate(site.rabbits)}
    found = {}
    for conn in site.rabbit.api("GET", "connections?columns=client_properties,node"):
        name = conn.get("client_properties", {}).get("connection_name")
        if name in names:
            found[name] = index[conn["node"]]
    return found if len(found) == len(names) else None


def test_a_dead_broker_node_costs_its_clients_a_reconnect_and_loses_nothing(
    cluster_sites: LocalSites, nodes: tuple[NodeProcess, NodeProcess]
) -> None:
    """Kill the broker node that leads the commit markers' stream and holds
    a third of the clients' upstreams: those clients reconnect through the
    listener to a live node, transactions go on committing, and every
    confirmed message is on both sites, in the classic and quorum queues
    (the stream's replicas hold it too)."""
    node_a, node_b = nodes
    site = cluster_sites.a
    _declare(site)
    markers = site.rabbit.api("GET", f"queues/orders/{MARKER_QUEUE}")
    assert markers["type"] == "stream" and markers["node"] == site.rabbits[2].nodename, markers
    names = ["c0", "c1", "c2"]
    clients = {name: _client(site, name) for name in names}
    homes = until(lambda: _homes(site, names), "the clients' upstreams", 30)
    assert sorted(homes.values()) == [0, 1, 2], homes  # one client per broker node

    confirmed: list[int] = []
    for i, (_, ch) in enumerate(clients.values()):
        _publish(ch, range(100 * i + 1, 100 * i + 51), confirmed)
    tx_conn, _ = _client(site, "transactions")
    tx = tx_conn.channel()
    tx.tx_select()
    _commit(tx, range(3000, 3005), confirmed)

    victim = next(name for name, n in homes.items() if n == 2)  # not the classic queues' node
    site.rabbits[2].kill()
    conn, ch = clients.pop(victim)
    with pytest.raises(pika.exceptions.AMQPError):  # as connected to that node directly
        _publish(ch, range(1000, 1100), confirmed)

    # it connects again through the listener, as do two more: one of the
    # three is the turn of the dead node, which refuses, and goes on to a live one
    again = {name: _client(site, name) for name in ("r0", "r1", "r2")}
    moved = until(lambda: _homes(site, list(again)), "the new upstreams", 30)
    assert set(moved.values()) <= {0, 1}, moved
    # while the cluster elects new leaders for what the dead node led, the
    # broker may close a publisher's connection (541): a client connects
    # again through the listener and goes on, as it would directly
    for i, client in enumerate([*again.items(), *clients.items()]):
        _go_on(site, client, range(2000 + 100 * i, 2000 + 100 * i + 30), confirmed)
    # local transactions go on committing: the markers' stream has a new leader
    for first in range(3100, 3115, 5):
        _go_on(site, ("transactions-again", None), range(first, first + 5), confirmed, tx=True)

    assert_same_state(node_a, node_b)
    replicated = live_numbers(node_b.site)
    missing = {(n, q) for n in confirmed for q in (*queues_of(n), "orders.qq")} - replicated
    assert not missing, sorted(missing)[:10]

    def quorum_depth() -> int:  # the management API's figure, a second old
        return int(site.rabbit.api("GET", "queues/orders/orders.qq?columns=messages")["messages"])

    # every confirmed publish, and perhaps one never confirmed
    until(lambda: quorum_depth() >= len(confirmed), "the quorum queue's depth", 30)
    # four transactions, each decided, each with its marker in the stream
    txids = scalar(site, "SELECT array_agg(txid ORDER BY created_at) FROM txn_log")
    states = scalar(site, "SELECT array_agg(DISTINCT state) FROM txn_log")
    assert len(txids) == 4 and set(states) <= {"committed", "ended"}, states
    assert marker_names(site.rabbits[0].amqp_url("orders")) == txids
    dead = f"127.0.0.1:{site.rabbits[2].amqp_port}"
    failures = value(node_a.get("/metrics"), "vpnrepl_broker_connect_failures_total", broker=dead)
    assert failures is not None and failures >= 1


def _go_on(
    site: LocalSite,
    client: tuple[str, tuple[pika.BlockingConnection, Any] | None],
    numbers: range,
    confirmed: list[int],
    tx: bool = False,
) -> None:
    """Publish ``numbers`` (one local transaction with ``tx``) as a client
    that connects again through the listener when the broker closes its
    connection, up to three times, and republishes what was not confirmed."""
    name, opened = client
    for attempt in range(4):
        conn, ch = opened if opened is not None else _client(site, f"{name}-{attempt}")
        opened = None
        try:
            if tx:
                ch = conn.channel()
                ch.tx_select()
                _commit(ch, numbers, confirmed)
            else:
                done = [n for n in confirmed if n in numbers]
                _publish(
                    ch, range(max(done, default=numbers.start - 1) + 1, numbers.stop), confirmed
                )
            conn.close()
            assert set(numbers) <= set(confirmed)
            return
        except pika.exceptions.AMQPError:
            if attempt == 3:
                raise


def _commit(tx: Any, numbers: range, confirmed: list[int]) -> None:
    """Publish ``numbers`` in one local transaction; confirmed once committed."""
    for n in numbers:
        tx.basic_publish("events", routing_key(n), body(n), properties(n))
    tx.tx_commit()
    confirmed.extend(numbers)


def _declare(site: LocalSite) -> None:
    """A quorum and a stream queue beside the classic ones, declared through
    the listener (so the declare is replicated), bound like orders.q2."""
    conn, ch = _client(site, "declarer")
    for name, kind in (("orders.qq", "quorum"), ("orders.st", "stream")):
        args = {"x-queue-type": kind, **({"x-delivery-limit": 5} if kind == "quorum" else {})}
        ch.queue_declare(name, durable=True, arguments=args)
        ch.queue_bind(name, "events", "order.#")
    conn.close()


def _read(site: LocalSite, queue: str, count: int, ack: int = 0) -> list[int]:
    """The first ``count`` numbers of ``queue`` read through the site's
    listener (a stream from its first offset); the first ``ack`` acked,
    the rest left."""
    conn, _ = _client(site, f"reader-{queue}")
    ch = conn.channel()
    ch.basic_qos(prefetch_count=count)
    got: list[int] = []
    args = {"x-stream-offset": "first"} if queue.endswith(".st") else {}
    for method, _props, payload in ch.consume(queue, arguments=args, inactivity_timeout=10):
        if method is None:
            break
        got.append(int(payload.split(b":")[0]))
        if len(got) <= ack:
            ch.basic_ack(method.delivery_tag)
        if len(got) == count:
            break
    conn.close()
    return got


@pytest.mark.fault  # a second cluster of RabbitMQ nodes' worth of time; the default suite has one
def test_quorum_and_stream_queues_are_promoted_with_their_type_and_what_they_hold(
    cluster_sites: LocalSites, nodes: tuple[NodeProcess, NodeProcess], tmp_path: Path
) -> None:
    node_a, node_b = nodes
    a, b = cluster_sites.a, cluster_sites.b
    _declare(a)
    conn, ch = _client(a, "publisher")
    confirmed: list[int] = []
    _publish(ch, range(1, 41), confirmed)
    conn.close()
    assert _read(a, "orders.qq", 10, ack=10) == list(range(1, 11))
    assert _read(a, "orders.st", 40, ack=40) == list(range(1, 41))  # acks remove nothing
    assert_same_state(node_a, node_b)

    def no_drift() -> bool:
        """The broker's depth of each type is what replicated, as status
        reads it (messages) and as reconcile's drift check does (persistent)."""
        st = cli_status(node_a)
        broker, replicated = st["broker_queues"] or {}, st["queues"]
        listed = a.rabbit.api("GET", f"queues/orders?columns={DEPTH_COLUMNS}")
        persistent = {q["name"]: replicable_depth(q) for q in listed}
        return all(
            broker.get(q) == persistent.get(q) == replicated.get(q)
            for q in ("orders.qq", "orders.st")
        )

    until(no_drift, "the quorum queue's and the stream's depths to equal the replicated", 30)
    assert {30, 40} == {cli_status(node_a)["queues"][q] for q in ("orders.qq", "orders.st")}

    node_a.kill()
    promoted = Vpnrepl(node_b.config)("promote", "orders")
    assert promoted.returncode == 0, promoted.stderr
    for name, kind in (("orders.qq", "quorum"), ("orders.st", "stream"), ("orders.q1", "classic")):
        q = b.rabbit.api("GET", f"queues/orders/{name}")
        assert q["type"] == kind, q
    assert b.rabbit.api("GET", "queues/orders/orders.qq")["arguments"]["x-delivery-limit"] == 5
    assert _read(b, "orders.qq", 30) == list(range(11, 41))
    assert _read(b, "orders.st", 40) == list(range(1, 41))


@pytest.mark.fault  # the default suite's cluster test is the one above
def test_xa_branches_on_a_quorum_queue_commit_and_roll_back_as_on_a_classic_one(
    cluster_sites: LocalSites, nodes: tuple[NodeProcess, NodeProcess]
) -> None:
    node_a, node_b = nodes
    a = cluster_sites.a
    _declare(a)
    conn, ch = _client(a, "seeder")
    _publish(ch, range(1, 6), [])  # order.created: orders.q1, q2 and the quorum queue
    conn.close()
    app = app_database(a)
    with resource(a) as (xa_conn, xa):
        work = xa_conn.channel()
        manager = Manager(xa, app, "quorum-commit")
        manager.begin(work)
        publish(work, (500,))
        taken = take(work, "orders.qq", 1)
        manager.app_insert(500)
        manager.end_and_prepare()
        manager.commit()
        assert taken == [1] and app_rows(app) == [500]

        manager = Manager(xa, app, "quorum-rollback")
        manager.begin(work)
        publish(work, (505,))
        take(work, "orders.qq", 1)
        manager.app_insert(505)
        manager.end_and_prepare()
        manager.rollback()
        work.basic_recover(requeue=True)  # the rolled-back ack's message is unacked again
    assert app_rows(app) == [500]
    assert_same_state(node_a, node_b)
    for site in (a, node_b.site):
        held = {n for n, q in live_numbers(site) if q == "orders.qq"}
        assert held == {2, 3, 4, 5, 500}, (site.name, sorted(held))
    # (sorted: where a quorum queue puts back a requeued message is the version's)
    assert sorted(_read(a, "orders.qq", 5)) == [2, 3, 4, 5, 500]


@pytest.mark.fault  # the default suite's cluster test is the first one
def test_a_quorum_queues_delivery_limit_drop_shows_as_broker_drift(
    cluster_sites: LocalSites, nodes: tuple[NodeProcess, NodeProcess]
) -> None:
    """The broker drops a message requeued past ``x-delivery-limit`` (5)
    on its own, as it expires one by TTL: not replicated, so the sites
    keep it and the broker's depth shows one less (README, "Limits")."""
    node_a, _ = nodes
    a = cluster_sites.a
    _declare(a)
    conn, ch = _client(a, "publisher")
    _publish(ch, range(1, 4), [])
    conn.close()
    conn, _ = _client(a, "requeuer")
    ch = conn.channel()
    for _ in range(7):  # the sixth delivery is past the limit: the broker drops it
        method, _props, payload = ch.basic_get("orders.qq")
        if method is None or int(payload.split(b":")[0]) != 1:
            break
        ch.basic_nack(method.delivery_tag, requeue=True)
    conn.close()

    def drifted() -> bool:
        st = cli_status(node_a)
        return (st["broker_queues"] or {}).get("orders.qq") == st["queues"]["orders.qq"] - 1

    until(drifted, "the quorum queue's broker depth one below the replicated count", 30)
    assert cli_status(node_a)["queues"]["orders.qq"] == 3
