"""The harness starts four real servers, isolated from any system ones, and
can crash and restart each of them with its data intact."""

from __future__ import annotations

import pika
import psycopg
import pytest

from plugin._localsites import LocalSite, LocalSites


def _publish_persistent(site: LocalSite, queue: str, body: bytes) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url()))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(queue, durable=True)
        ch.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
    finally:
        conn.close()


def _get(site: LocalSite, queue: str) -> bytes | None:
    conn = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url()))
    try:
        _, _, body = conn.channel().basic_get(queue, auto_ack=True)
        return body
    finally:
        conn.close()


def test_four_servers_are_distinct_and_not_the_system_ones(sites: LocalSites) -> None:
    ports = {sites.a.rabbit.amqp_port, sites.b.rabbit.amqp_port, sites.a.pg.port, sites.b.pg.port}
    assert len(ports) == 4
    assert not ports & {5672, 5432, 15672}
    assert sites.a.rabbit.nodename != sites.b.rabbit.nodename
    for site in (sites.a, sites.b):
        overview = site.rabbit.api("GET", "overview")
        assert overview["node"] == site.rabbit.nodename


@pytest.mark.parametrize("which", ["a", "b"])
def test_write_and_read_through_each_site(sites: LocalSites, which: str) -> None:
    site: LocalSite = getattr(sites, which)
    site.rabbit.reset()
    site.pg.reset()
    _publish_persistent(site, "harness.q", b"hello " + which.encode())
    assert _get(site, "harness.q") == b"hello " + which.encode()
    with psycopg.connect(site.pg.dsn()) as conn:
        conn.execute("CREATE TABLE t (v text)")
        conn.execute("INSERT INTO t VALUES (%s)", (which,))
    with psycopg.connect(site.pg.dsn()) as conn:
        assert conn.execute("SELECT v FROM t").fetchall() == [(which,)]


def test_rabbit_sigkill_then_restart_keeps_persistent_messages(site_a: LocalSite) -> None:
    _publish_persistent(site_a, "durable.q", b"survives")
    site_a.rabbit.kill()
    assert not site_a.rabbit.alive()
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(pika.URLParameters(site_a.rabbit.amqp_url()))
    site_a.rabbit.start()
    assert _get(site_a, "durable.q") == b"survives"


def test_postgres_sigkill_then_restart_keeps_committed_rows(site_b: LocalSite) -> None:
    with psycopg.connect(site_b.pg.dsn()) as conn:
        conn.execute("CREATE TABLE t (v int)")
        conn.execute("INSERT INTO t VALUES (42)")
    site_b.pg.kill()
    assert not site_b.pg.alive()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(site_b.pg.dsn(), connect_timeout=3)
    site_b.pg.start()
    with psycopg.connect(site_b.pg.dsn()) as conn:
        assert conn.execute("SELECT v FROM t").fetchall() == [(42,)]


def test_reset_removes_vhosts_and_queues(site_a: LocalSite) -> None:
    site_a.rabbit.add_vhost("orders")
    _publish_persistent(site_a, "left.over", b"x")
    site_a.rabbit.reset()
    assert [v["name"] for v in site_a.rabbit.api("GET", "vhosts")] == ["/"]
    assert site_a.rabbit.api("GET", "queues/%2F") == []
