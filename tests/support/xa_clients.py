"""A small transaction manager for the XA tests: a broker branch through
the listener (:class:`txn.XAResource`) and an application database branch
(psycopg's TPC), committed together.

Run as a program it is the client process the crash tests kill: it
prepares a global transaction, writes ``prepared`` to stdout and waits.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pika
import psycopg

from plugin.devtools import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.two_sites import (
    Publisher,
    amqp_url,
    body,
    caught_up,
    enable,
    number,
    properties,
    routing_key,
    setup_vpn,
    until,
    vpn_status,
)
from txn.client import XAResource
from txn.xa import Xid

APP_DB = "app"
#: messages the XA tests' branches ack: not multiples of five (orders.q1 and .q2)
SEEDED = [n for n in range(1, 31) if n % 5]


def start_sites(
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
    mode: str = "sync",
    sync_timeout_ms: int = 5000,
) -> None:
    """The VPN replicated A to B in ``mode``, both nodes running, SEEDED
    published and on the standby."""
    setup_vpn(node_a.site)
    enable(vpnrepl_a, "--mode", mode, "--sync-timeout-ms", str(sync_timeout_ms))
    node_a.start()
    node_b.start()
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "the standby to connect")
    publisher = Publisher(node_a.site, SEEDED).run()
    assert publisher.error is None and publisher.confirmed == set(SEEDED)
    caught_up(node_a, node_b)


@contextlib.contextmanager
def resource(
    site: LocalSite, timeout: float = 30
) -> Iterator[tuple[pika.BlockingConnection, XAResource]]:
    """A connection through ``site``'s listener and its XA resource."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(site)))
    try:
        yield conn, XAResource(conn, timeout=timeout)
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def app_database(site: LocalSite) -> str:
    """A fresh application database on ``site``'s PostgreSQL; its DSN."""
    with psycopg.connect(site.pg.dsn("postgres"), autocommit=True) as admin:
        for (gid,) in admin.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = %s", (APP_DB,)
        ).fetchall():
            with psycopg.connect(site.pg.dsn(APP_DB), autocommit=True) as db:
                db.execute(f"ROLLBACK PREPARED '{gid}'")  # noqa: S608 - a gid PostgreSQL listed
        admin.execute(f"DROP DATABASE IF EXISTS {APP_DB}")
        admin.execute(f"CREATE DATABASE {APP_DB}")
    dsn = site.pg.dsn(APP_DB)
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute("CREATE TABLE orders (n int PRIMARY KEY)")
    return dsn


def app_rows(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as db:
        return [int(n) for (n,) in db.execute("SELECT n FROM orders ORDER BY n").fetchall()]


def app_prepared(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as db:
        return [str(g) for (g,) in db.execute("SELECT gid FROM pg_prepared_xacts").fetchall()]


def publish(ch: Any, numbers: Iterable[int]) -> None:
    for n in numbers:
        ch.basic_publish("events", routing_key(n), body(n), properties(n))


def take(ch: Any, queue: str, count: int) -> list[int]:
    """Get and ack ``count`` messages of ``queue`` (inside the branch)."""
    got = []
    for _ in range(count):
        method, _props, payload = ch.basic_get(queue)
        if method is None:
            break
        ch.basic_ack(method.delivery_tag)
        got.append(number(payload))
    return got


class Manager:
    """One global transaction ``gtrid`` over the broker and the app database."""

    def __init__(self, xa: XAResource, app_dsn: str, gtrid: str) -> None:
        self.xa = xa
        self.db = psycopg.connect(app_dsn)
        self.broker_xid = Xid.from_parts(1, gtrid, "broker")
        self.db_xid = self.db.xid(1, gtrid, "app")

    def begin(self, work: Any) -> None:
        self.db.tpc_begin(self.db_xid)
        self.xa.start(self.broker_xid, work)

    def app_insert(self, n: int) -> None:
        self.db.execute("INSERT INTO orders (n) VALUES (%s)", (n,))

    def end_and_prepare(self) -> None:
        self.xa.end(self.broker_xid)
        self.xa.prepare(self.broker_xid)
        self.db.tpc_prepare()

    def commit(self) -> None:
        self.db.tpc_commit()
        self.xa.commit(self.broker_xid)
        self.db.close()

    def rollback(self) -> None:
        self.db.tpc_rollback()
        self.xa.rollback(self.broker_xid)
        self.db.close()


def recover_commit(xa: XAResource, app_dsn: str, gtrid: str) -> None:
    """A transaction manager's recovery of a global transaction it decided
    to commit: both branches from fresh connections."""
    with psycopg.connect(app_dsn, autocommit=True) as db:
        db.tpc_commit(db.xid(1, gtrid, "app"))
    broker = Xid.from_parts(1, gtrid, "broker")
    assert broker in xa.recover()
    xa.commit(broker)


def main(argv: list[str]) -> None:
    """``url app_dsn gtrid n [acked queue]``: prepare and wait to be killed."""
    url, app_dsn, gtrid, n = argv[:4]
    conn = pika.BlockingConnection(pika.URLParameters(url))
    xa = XAResource(conn, timeout=30)
    work = conn.channel()
    manager = Manager(xa, app_dsn, gtrid)
    manager.begin(work)
    publish(work, (int(n),))
    if len(argv) > 4:
        take(work, argv[4], 1)
    manager.app_insert(int(n))
    manager.end_and_prepare()
    print("prepared", flush=True)
    while True:
        conn.process_data_events(time_limit=1)
        time.sleep(0.1)


if __name__ == "__main__":
    main(sys.argv[1:])
