"""A prepared global transaction survives SIGKILL of the client process, of
the active node and of the standby node, and a promotion: what the sites
hold is checked while the killed side is still down, then the transaction
manager's recovery commits it and its publishes appear exactly once, on the
active broker and in the standby's live state.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pika.exceptions
import psycopg
import pytest

from plugin.devtools import LocalSite
from tests import REPO
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.two_sites import (
    VPN,
    amqp_url,
    caught_up,
    cli_status,
    live_caught_up,
    live_numbers,
    queue_numbers,
    until,
    vpn_status,
)
from tests.support.xa_clients import (
    Manager,
    app_database,
    app_prepared,
    app_rows,
    publish,
    recover_commit,
    resource,
    start_sites,
)
from txn.xa import XaHeuristic, Xid


def prepared_rows(site: LocalSite, side: str) -> list[str]:
    with psycopg.connect(site.pg.dsn(), autocommit=True) as db:
        return [
            str(x)
            for (x,) in db.execute(
                "SELECT xid FROM txn_log WHERE side = %s AND state = 'prepared'"
                " AND xid IS NOT NULL ORDER BY created_at",
                (side,),
            ).fetchall()
        ]


def client_process(site: LocalSite, app: str, gtrid: str, n: int, *ack: str) -> Any:
    """The client of ``tests/support/xa_clients.py`` in a process of its own, once it
    has prepared its global transaction."""
    root = REPO
    proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module
        [
            sys.executable,
            "-m",
            "tests.support.xa_clients",
            amqp_url(site),
            app,
            gtrid,
            str(n),
            *ack,
        ],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "prepared", f"the client said {line!r} (exit {proc.poll()})"
    return proc


def kill(*procs: Any) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def assert_once(a: NodeProcess, b: NodeProcess, n: int) -> None:
    """``n`` is once in A's broker and once in both sites' live state."""
    caught_up(a, b)
    live_caught_up(a.site)
    assert queue_numbers(a.site, "orders.q2").count(n) == 1
    for site in (a.site, b.site):
        assert [m for m, q in live_numbers(site) if m == n] == [n], site.name


def test_a_prepared_transaction_survives_the_client_process_killed(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    start_sites(vpnrepl_a, node_a, node_b, sync_timeout_ms=3000)
    app = app_database(site_a)
    q1_before = queue_numbers(site_a, "orders.q1")
    plain = client_process(site_a, app, "kill-1", 200)
    acking = client_process(site_a, app, "kill-2", 205, "orders.q1")
    kill(plain, acking)
    # the client is gone: both branches prepared on both sites, nothing visible
    xids = [str(Xid.from_parts(1, g, "broker")) for g in ("kill-1", "kill-2")]
    until(lambda: prepared_rows(site_a, "coordinator") == xids, "A's branches prepared")
    assert prepared_rows(site_b, "participant") == xids
    assert len(app_prepared(app)) == 2
    assert not {200, 205} & {n for n, _ in live_numbers(site_a) | live_numbers(site_b)}
    assert not {200, 205} & set(queue_numbers(site_a, "orders.q2"))
    # the broker rolled the acking branch's ack back when its channel closed
    assert sorted(queue_numbers(site_a, "orders.q1")) == sorted(q1_before)

    # the transaction manager's recovery, from a new connection
    with resource(site_a) as (_conn, xa):
        recover_commit(xa, app, "kill-1")
        with pytest.raises(XaHeuristic, match="acknowledgement") as hazard:
            recover_commit(xa, app, "kill-2")
        assert hazard.value.code == "XA_HEURHAZ"
        # listed with its hazard until the transaction manager forgets it
        assert xa.recover() == [Xid.from_parts(1, "kill-2", "broker")]
        assert cli_status(node_a)["xa"]["hazards"] == 1
        xa.forget(Xid.from_parts(1, "kill-2", "broker"))
        assert xa.recover() == []
    assert app_rows(app) == [200, 205]
    assert_once(node_a, node_b, 200)
    assert_once(node_a, node_b, 205)
    # the requeued message is live on both sites still: the broker holds it
    assert sorted(queue_numbers(site_a, "orders.q1")) == sorted(q1_before)
    assert cli_status(node_a)["xa"]["hazards"] == 0


def test_a_prepared_transaction_survives_the_active_node_killed(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    start_sites(vpnrepl_a, node_a, node_b, sync_timeout_ms=3000)
    app = app_database(site_a)
    proc = client_process(site_a, app, "node-a", 210)
    node_a.kill()
    kill(proc)
    # A's node is down: the branch is prepared in both sites' databases
    xid = str(Xid.from_parts(1, "node-a", "broker"))
    assert prepared_rows(site_a, "coordinator") == [xid]
    assert prepared_rows(site_b, "participant") == [xid]
    assert 210 not in set(queue_numbers(site_a, "orders.q2"))
    node_a.start()  # recovery leaves the branch to its transaction manager
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "the standby to reconnect")
    assert prepared_rows(site_a, "coordinator") == [xid]
    with resource(site_a) as (_conn, xa):
        recover_commit(xa, app, "node-a")
        assert xa.recover() == []
    assert_once(node_a, node_b, 210)
    with resource(site_a) as (_conn, xa):  # a repeated commit finds nothing to do
        with pytest.raises(Exception, match="XA branch"):
            xa.commit(Xid.from_parts(1, "node-a", "broker"))
    assert_once(node_a, node_b, 210)


def test_a_prepared_transaction_survives_the_standby_node_killed(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    start_sites(vpnrepl_a, node_a, node_b, sync_timeout_ms=3000)
    app = app_database(site_a)
    with resource(site_a) as (conn, xa):
        work = conn.channel()
        manager = Manager(xa, app, "node-b")
        manager.begin(work)
        publish(work, (215,))
        manager.app_insert(215)
        manager.end_and_prepare()
        node_b.kill()
        xid = str(manager.broker_xid)
        # B's node is down: its database holds the prepared branch
        assert prepared_rows(site_b, "participant") == [xid]
        assert prepared_rows(site_a, "coordinator") == [xid]
        node_b.start()
        until(lambda: vpn_status(node_a).get("bridge") == "connected", "the standby to reconnect")
        assert manager.broker_xid in xa.recover()
        manager.commit()  # on the branch's own channel, still open
    assert app_rows(app) == [215]
    assert_once(node_a, node_b, 215)
    until(lambda: prepared_rows(site_b, "participant") == [], "B's row settled")


def test_a_branch_prepared_before_a_disaster_is_resolved_on_the_promoted_site(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    start_sites(vpnrepl_a, node_a, node_b, sync_timeout_ms=3000)
    app = app_database(site_a)
    held = queue_numbers(site_a, "orders.q1")[:2]  # the branches ack these two
    committing = client_process(site_a, app, "disaster-1", 220, "orders.q1")
    rolling_back = client_process(site_a, app, "disaster-2", 225, "orders.q1")
    node_a.kill()  # the disaster: A's node, and its clients with it
    site_a.rabbit.kill()
    kill(committing, rolling_back)
    promoted = Vpnrepl(node_b.config)("promote", VPN)
    assert promoted.returncode == 0, promoted.stderr
    # the acked messages wait for their branches: not in B's broker yet
    assert not set(held) & set(queue_numbers(site_b, "orders.q1"))
    assert {220, 225}.isdisjoint(queue_numbers(site_b, "orders.q2"))
    # B's node dies once it put the rolled-back branch's held message back
    node_b.stop()
    node_b.start(failpoint="xa.after-restore")
    rollback = Xid.from_parts(1, "disaster-2", "broker")
    with resource(site_b) as (_conn, xa):
        assert set(xa.recover()) == {Xid.from_parts(1, "disaster-1", "broker"), rollback}
        recover_commit(xa, app, "disaster-1")
        with psycopg.connect(app, autocommit=True) as db:
            db.tpc_rollback(db.xid(1, "disaster-2", "app"))
        with pytest.raises(pika.exceptions.AMQPError):
            xa.rollback(rollback)
    node_b.wait_killed()
    # while it is down: the message is back once, the branch still prepared
    back = [n for n in held if n not in _acked_by(site_b)]
    assert len(back) == 1
    assert queue_numbers(site_b, "orders.q1").count(back[0]) == 1
    assert prepared_rows(site_b, "coordinator") == [str(rollback)]
    node_b.start()
    with resource(site_b) as (_conn, xa):
        assert xa.recover() == [rollback]
        xa.rollback(rollback)  # the transaction manager's retry puts nothing back twice
        assert xa.recover() == []
    assert app_rows(app) == [220]
    assert queue_numbers(site_b, "orders.q2").count(220) == 1
    assert 225 not in queue_numbers(site_b, "orders.q2")
    q1 = queue_numbers(site_b, "orders.q1")
    # one acked message is gone with its committed branch, the other is back, once
    assert [n for n in held if n in q1] == back
    assert q1.count(back[0]) == 1
    live = {n for n, q in live_numbers(site_b) if q == "orders.q1"}
    assert len(set(held) & live) == 1


def _acked_by(site: LocalSite) -> set[int]:
    """Numbers a committed branch acked: gone from ``site``'s live state."""
    live = {n for n, q in live_numbers(site) if q == "orders.q1"}
    return {n for n in range(1, 31) if n % 5} - live
