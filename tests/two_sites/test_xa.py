"""Client XA: a branch on the listener next to a psycopg TPC branch on an
application database, under one transaction manager (:class:`Manager`).

Publishes in a branch use numbers that are multiples of five (routing key
``order.eu.created``: only ``orders.q2`` in scope); the messages a branch
acks are seeded in ``orders.q1`` and ``orders.q2`` with other numbers.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from typing import Any

import pika
import pika.exceptions
import psycopg
import pytest

from plugin.devtools import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.prometheus import value
from tests.support.two_sites import (
    VPN,
    amqp_url,
    broker_depths,
    caught_up,
    enable,
    live_caught_up,
    live_numbers,
    number,
    queue_numbers,
    setup_vpn,
    until,
    vpn_status,
)
from tests.support.xa_clients import (
    Manager,
    app_database,
    app_rows,
    publish,
    resource,
    start_sites,
    take,
)
from txn.client import XAResource
from txn.xa import (
    Verb,
    XaHeuristic,
    XaNotFound,
    XaProtocolError,
    XaResourceError,
    XaRolledBack,
    Xid,
)


@contextlib.contextmanager
def client(site: LocalSite) -> Iterator[tuple[pika.BlockingConnection, XAResource, Any]]:
    """``resource`` and a channel for the branch's work."""
    with resource(site, timeout=20) as (conn, xa):
        yield conn, xa, conn.channel()


def xa_rows(site: LocalSite, side: str) -> list[tuple[str, str]]:
    with psycopg.connect(site.pg.dsn(), autocommit=True) as db:
        return [
            (str(x), str(s))
            for x, s in db.execute(
                "SELECT xid, state FROM txn_log WHERE xid IS NOT NULL AND side = %s"
                " ORDER BY created_at",
                (side,),
            ).fetchall()
        ]


def xa_owner(site: LocalSite, side: str, xid: Xid) -> str | None:
    with psycopg.connect(site.pg.dsn(), autocommit=True) as db:
        row = db.execute(
            "SELECT xa_owner FROM txn_log WHERE side = %s AND xid = %s", (side, str(xid))
        ).fetchone()
    assert row is not None, f"no {side} row of {xid}"
    return None if row[0] is None else str(row[0])


def numbers_live(site: LocalSite) -> set[int]:
    return {n for n, _ in live_numbers(site)}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_global_transaction_commits_and_rolls_back_atomically(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
    mode: str,
) -> None:
    """Whatever the VPN's mode, the standby holds the branch prepared before
    the prepare's answer."""
    start_sites(vpnrepl_a, node_a, node_b, mode)
    app = app_database(site_a)
    before = broker_depths(site_a)
    with client(site_a) as (conn, xa, work):
        # 1. commit: the order row, a publish and an ack, all or nothing
        manager = Manager(xa, app, "order-1")
        manager.begin(work)
        publish(work, (100,))
        acked = take(work, "orders.q1", 1)
        manager.app_insert(100)
        manager.end_and_prepare()
        # prepared on both sites, invisible to consumers, nothing in the live state
        xid = str(manager.broker_xid)
        assert xa_rows(site_a, "coordinator") == [(xid, "prepared")]
        assert xa_rows(site_b, "participant") == [(xid, "prepared")]
        assert broker_depths(site_a)["orders.q2"] == before["orders.q2"]
        assert 100 not in numbers_live(site_a) | numbers_live(site_b)
        assert xa.recover() == [manager.broker_xid]
        manager.commit()
        assert app_rows(app) == [100]
        assert broker_depths(site_a)["orders.q2"] == before["orders.q2"] + 1
        assert broker_depths(site_a)["orders.q1"] == before["orders.q1"] - 1
        caught_up(node_a, node_b)
        live_caught_up(site_a)
        for site in (site_a, site_b):
            assert 100 in numbers_live(site)
            assert (acked[0], "orders.q1") not in live_numbers(site)
        assert xa.recover() == []

        # 2. rollback after prepare: no trace on either site, the ack undone
        manager = Manager(xa, app, "order-2")
        manager.begin(work)
        publish(work, (105,))
        take(work, "orders.q1", 1)
        manager.app_insert(105)
        manager.end_and_prepare()
        manager.rollback()
        assert app_rows(app) == [100]
        caught_up(node_a, node_b)
        for site in (site_a, site_b):
            assert 105 not in numbers_live(site)
        assert xa_rows(site_a, "coordinator")[-1] == (str(manager.broker_xid), "aborted")
        until(
            lambda: xa_rows(site_b, "participant")[-1] == (str(manager.broker_xid), "aborted"),
            "B's row aborted",
        )
        work.basic_recover(requeue=True)  # the rolled-back ack's message is unacked again
    until(
        lambda: broker_depths(site_a)["orders.q1"] == before["orders.q1"] - 1,
        "the rolled-back ack's message back in its queue",
    )
    assert broker_depths(site_a)["orders.q2"] == before["orders.q2"] + 1


def test_verbs_out_of_order_unknown_branches_and_other_users_branches_get_xa_errors(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    start_sites(vpnrepl_a, node_a, node_b)
    with client(site_a) as (conn, xa, work):
        unknown = Xid.from_parts(7, "nobody", "b")
        with pytest.raises(XaNotFound):
            xa.commit(unknown)
        xid = Xid.from_parts(7, "g", "b")
        xa.start(xid, work)
        publish(work, (110,))
        from txn.xa import XaProtocolError

        with pytest.raises(XaProtocolError, match="not allowed when active"):
            xa.prepare(xid)
        xa.end(xid)
        with pytest.raises(XaProtocolError, match="not prepared"):
            xa.commit(xid)
        xa.commit(xid, one_phase=True)
        assert 110 in {number(b) for b in _drain(conn, "orders.q2")}

        # a branch is its broker user's: another user may not touch or list it
        site_a.rabbit.api("PUT", "users/mallory", {"password": "mallory-pw", "tags": ""})
        site_a.rabbit.api("PUT", f"permissions/{VPN}/mallory",
                          {"configure": ".*", "write": ".*", "read": ".*"})  # fmt: skip
        theirs = pika.BlockingConnection(
            pika.URLParameters(amqp_url(site_a).replace("guest:guest", "mallory:mallory-pw"))
        )
        try:
            other = XAResource(theirs, timeout=20)
            owned = Xid.from_parts(7, "owned", "b")
            xa.start(owned, work)
            publish(work, (115,))
            refused = pytest.raises(XaResourceError, match="another broker user")
            for verb in (other.end, other.prepare, other.rollback, other.commit):
                with refused:
                    verb(owned)
            xa.end(owned)
            xa.prepare(owned)
            assert other.recover() == [] and xa.recover() == [owned]
            for verb in (other.commit, other.rollback, other.forget):
                with refused:
                    verb(owned)
            # the standby's row names the owner: a promoted site refuses the same
            assert xa_owner(site_a, "coordinator", owned) == "guest"
            assert xa_owner(site_b, "participant", owned) == "guest"
            xa.commit(owned)
        finally:
            theirs.close()
        assert 115 in {number(b) for b in _drain(conn, "orders.q2")}


def test_a_prepare_without_the_standby_votes_no_whatever_the_policy(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    setup_vpn(site_a)
    enable(vpnrepl_a, "--mode", "async")
    node_a.start()  # no standby
    until(lambda: vpn_status(node_a).get("role") == "active", "A active")
    before = broker_depths(site_a)
    with client(site_a) as (conn, xa, work):
        xid = Xid.from_parts(1, "lonely", "b")
        xa.start(xid, work)
        publish(work, (115,))
        xa.end(xid)
        with pytest.raises(XaRolledBack, match="standby"):
            xa.prepare(xid)
        assert xa.recover() == []
    assert broker_depths(site_a) == before
    assert xa_rows(site_a, "coordinator") in ([], [(str(xid), "aborted")])


def _drain(conn: pika.BlockingConnection, queue: str) -> Iterable[bytes]:
    ch = conn.channel()
    while True:
        method, _props, payload = ch.basic_get(queue, auto_ack=True)
        if method is None:
            break
        yield payload
    ch.close()


def _raw_request(conn: pika.BlockingConnection, verb: str, body: bytes) -> dict[str, Any]:
    """Publish an XA request by hand and read its answer."""
    import json

    ch = conn.channel()
    reply = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_publish(
        "vpnrepl.xa", verb, body, pika.BasicProperties(correlation_id="c1", reply_to=reply)
    )
    for _ in range(100):
        method, props, payload = ch.basic_get(reply, auto_ack=True)
        if method is not None:
            assert props.correlation_id == "c1"
            ch.close()
            return dict(json.loads(payload))
        conn.sleep(0.1)
    raise AssertionError(f"no answer to {verb}")


def test_bad_xa_requests_get_specific_errors_and_leave_other_clients_alone(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    start_sites(vpnrepl_a, node_a, node_b)
    with client(site_a) as (conn, xa, work):
        assert _raw_request(conn, "prepare", b"not json")["code"] == "XAER_INVAL"
        answer = _raw_request(conn, "dance", b"{}")
        assert answer["code"] == "XAER_INVAL" and "unknown XA verb" in answer["text"]
        answer = _raw_request(conn, "commit", b'{"xid": "1:zz:01"}')
        assert answer["code"] == "XAER_INVAL" and "not an XA id" in answer["text"]
        with pytest.raises(XaProtocolError, match="tx.select"):
            xa._call(Verb.START, Xid.from_parts(1, "g", "b"), channel=conn.channel())

        # an answer may only go to this connection's own exclusive queue
        ch = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.basic_publish(
                "vpnrepl.xa",
                "recover",
                b"{}",
                pika.BasicProperties(correlation_id="c", reply_to="audit"),
            )
            ch.queue_declare("audit", passive=True)
        assert refused.value.reply_code == 406 and "exclusive queue" in refused.value.reply_text

        # on a confirm channel the request cannot be taken out of the stream:
        # a publish to a reserved name, refused by the listener
        confirming = conn.channel()
        confirming.confirm_delivery()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as reserved:
            confirming.basic_publish("vpnrepl.xa", "recover", b"{}")
        assert reserved.value.reply_code == 403

        # no more work on a branch's channel once it is ended, no tx.commit of its own
        xid = Xid.from_parts(1, "ended", "b")
        xa.start(xid, work)
        publish(work, (120,))
        xa.end(xid)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as closed:
            xa.prepare(xid)
            publish(work, (125,))
            work.tx_commit()
        assert closed.value.reply_code == 406 and "XA branch" in closed.value.reply_text
        # the prepared branch outlived its channel: committed from its row
        xa.commit(xid)
        other = conn.channel()
        other.tx_select()
        bound = Xid.from_parts(1, "own-commit", "b")
        xa.start(bound, other)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="commit or roll it back"):
            other.tx_commit()
        with pytest.raises(XaRolledBack, match="channel closed"):
            xa.prepare(bound)
    assert 120 in queue_numbers(site_a, "orders.q2")
    assert 125 not in queue_numbers(site_a, "orders.q2")


def test_an_operator_resolves_branches_whose_transaction_manager_is_gone(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    start_sites(vpnrepl_a, node_a, node_b)
    xids = [Xid.from_parts(1, f"orphan-{i}", "b") for i in (1, 2)]
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(site_a)))
    xa = XAResource(conn, timeout=20)
    for xid, n in zip(xids, (130, 135), strict=True):
        work = conn.channel()
        xa.start(xid, work)
        publish(work, (n,))
        xa.end(xid)
        xa.prepare(xid)
    conn.close()  # the transaction manager is gone

    listed = vpnrepl_a("xa", "list", VPN, "--json")
    assert listed.returncode == 0, listed.stderr
    import json

    doc = json.loads(listed.stdout)
    assert [(b["xid"], b["state"]) for b in doc["branches"]] == [(str(x), "prepared") for x in xids]
    done = vpnrepl_a("xa", "commit", VPN, str(xids[0]))
    assert done.returncode == 0, done.stderr
    assert "committed (recorded as heuristic)" in done.stdout
    done = vpnrepl_a("xa", "rollback", VPN, str(xids[1]))
    assert done.returncode == 0, done.stderr
    bad = vpnrepl_a("xa", "commit", VPN, "1:zz")
    assert bad.returncode == 2 and "not an XA id" in bad.stderr
    missing = vpnrepl_a("xa", "commit", VPN, str(Xid.from_parts(1, "none", "b")))
    assert missing.returncode == 1 and "XAER_NOTA" in missing.stderr

    text = vpnrepl_a("xa", "list", VPN).stdout
    # committed, or ended already: the sweep ends a row the standby acknowledged
    assert re.search(f"{xids[0]}  (committed|ended) heuristic commit", text), text
    assert f"{xids[1]}  aborted heuristic rollback" in text
    caught_up(node_a, node_b)
    assert 130 in numbers_live(site_b) and 135 not in numbers_live(site_b)
    assert queue_numbers(site_a, "orders.q2").count(130) == 1

    # the transaction manager comes back: it hears what the operator did, then forgets
    with client(site_a) as (_conn, xa2, _work):
        assert set(xa2.recover()) == set(xids)
        with pytest.raises(XaHeuristic) as heard:
            xa2.commit(xids[0])
        assert heard.value.code == "XA_HEURCOM"
        with pytest.raises(XaHeuristic) as heard:
            xa2.commit(xids[1])
        assert heard.value.code == "XA_HEURRB"
        for xid in xids:
            xa2.forget(xid)
        assert xa2.recover() == []
    metrics = node_a.get("/metrics")
    assert value(metrics, "vpnrepl_xa_total", vpn=VPN, outcome="heuristic_commit") == 1
    assert value(metrics, "vpnrepl_xa_total", vpn=VPN, outcome="heuristic_rollback") == 1
    assert value(metrics, "vpnrepl_xa_branches", vpn=VPN, kind="heuristic") == 0
