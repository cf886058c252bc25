"""The harness starts four real servers, isolated from any system ones, and
can crash and restart each of them with its data intact."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pika
import psycopg
import pytest

from plugin.devtools import LocalSite, LocalSites, sweep_orphans


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
    # The queue is declared, and the node stopped cleanly, before the
    # crash: a durable queue declared milliseconds before a SIGKILL was once
    # missing after the restart (its definition not on disk yet), and what
    # this test is about is the confirmed message.
    _publish_persistent(site_a, "durable.q", b"before the clean restart")
    site_a.rabbit.restart()
    assert _get(site_a, "durable.q") == b"before the clean restart"
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


_ORPHAN_MAKER = """
import sys, time
from plugin.devtools import LocalSites
sites = LocalSites()
sites.a.pg.start()
sites.a.rabbit.start()
print(sites.base, sites.a.pg.postmaster_pid(), sites.a.rabbit.pidfile.read_text().split()[0])
sys.stdout.flush()
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_servers_of_a_killed_harness_are_swept_by_the_next_one() -> None:
    """A test run or benchmark SIGKILLed mid-way leaves its servers running;
    the next harness kills them and removes their directory, and leaves a
    live harness's servers alone."""
    child = subprocess.Popen(  # noqa: S603 - fixed argv
        [sys.executable, "-c", _ORPHAN_MAKER], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    base_text, pg_pid, rabbit_pid = child.stdout.readline().split()
    base, servers = Path(base_text), (int(pg_pid), int(rabbit_pid))
    try:
        assert all(_running(p) for p in servers)
        assert base not in sweep_orphans()  # its owner is alive: untouched
        assert all(_running(p) for p in servers)
        child.kill()
        child.wait(timeout=10)
        assert all(_running(p) for p in servers)  # orphans now
        assert base in sweep_orphans()
        deadline = time.monotonic() + 30
        while any(_running(p) for p in servers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_running(p) for p in servers)
        assert not base.exists()
    finally:
        child.kill()
        child.wait(timeout=10)
        child.stdout.close()
        for pid in servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
