"""Two nodes on site A, one on B: the site keeps serving when its leading
node is killed, paused past its lease, or when the other node dies; what
every client was told is checked against what each site holds while the
failed node is still down (or still paused)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from plugin.devtools import LocalSite
from sql import migrate
from tests.fault.checker import Fault
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess, Sites
from tests.support.nodes import (
    AckingConsumer,
    Client,
    ConfirmingPublisher,
    SiteNodes,
    TxPublisher,
    judged,
)
from tests.support.two_sites import (
    VPN,
    caught_up,
    enable,
    live_caught_up,
    setup_vpn,
    until,
    vpn_status,
)

#: the lease the tests run with (the default, 15 s, leaves room for a loaded machine)
LEASE = 3.0
#: how long after a kill clients may wait to be served again: the issue's
#: lease + 5 s, and room for this shared two-core machine's load
SERVED_AGAIN = LEASE + 5.0 + 10.0


class Pair:
    def __init__(self, a: SiteNodes, b: NodeProcess) -> None:
        self.a, self.b = a, b
        self.cli_a = Vpnrepl(a.config)


@pytest.fixture
def pair(site_a: LocalSite, site_b: LocalSite, tmp_path: Path) -> Iterator[Pair]:
    for site in (site_a, site_b):
        migrate(site.pg.dsn())
    a = SiteNodes(site_a, site_b, tmp_path, lease_seconds=LEASE)
    b_config = tmp_path / "b.toml"
    b_config.write_text(site_b.config_text(site_a, peer_bridges=a.bridge_ports()))
    b = NodeProcess(site_b, b_config, tmp_path / "node-b.log", name="b")
    try:
        yield Pair(a, b)
    finally:
        for node in (*a.nodes.values(), b):
            if node.proc is not None and node.proc.poll() is None:
                with_signal(node, signal.SIGCONT)
            node.kill()
    for node in (*a.nodes.values(), b):
        assert "Traceback" not in node.log_text(), node.log_text()


def with_signal(node: NodeProcess, sig: signal.Signals) -> None:
    assert node.pid is not None
    os.kill(node.pid, sig)


def leads(node: NodeProcess) -> bool:
    return bool(node.status().get("leads"))


def started(pair: Pair, *options: str) -> None:
    """The VPN enabled on A, a1 leading, a2 relaying, B following."""
    setup_vpn(pair.a.site)
    enable(pair.cli_a, *options)
    pair.a["a1"].start()
    assert leads(pair.a["a1"])
    pair.a["a2"].start()  # healthy once it knows the leader it relays to
    assert pair.a["a2"].status() == {**pair.a["a2"].status(), "leads": False, "leader": "a1"}
    pair.b.start()
    until(lambda: vpn_status(pair.b).get("bridge") == "connected", "B to follow A")


def check_sites(
    pair: Pair, leader: str, mode: str, policy: str, clients: list[Client], faults: list[Fault]
) -> None:
    """The fault suite's checker, once B applied all of A's ledger and A's
    live state caught up: nothing told lost on A or B, no transaction
    half-applied, B's live state A's."""
    caught_up(pair.a[leader], pair.b)
    live_caught_up(pair.a.site)
    verdict = judged(
        mode, policy, clients, faults, pair.a.amqp_ports(leader), pair.a.site, pair.b.site
    )
    assert not verdict, verdict


@pytest.mark.parametrize(
    "mode", ["sync", pytest.param("async", marks=pytest.mark.fault)]
)  # the async variant under -m fault: the default suite keeps one
def test_killing_the_leader_or_the_other_node_loses_nothing_and_the_site_serves_on(
    pair: Pair, mode: str
) -> None:
    started(pair, "--mode", mode, "--on-sync-timeout", "reject")
    a1, a2 = pair.a["a1"], pair.a["a2"]

    # the node that does not lead dies: its relayed clients move, nothing stops
    direct = ConfirmingPublisher(pair.a.amqp_ports("a1"), 1)
    relayed = ConfirmingPublisher(pair.a.amqp_ports("a2"), 50_001)
    for client in (direct, relayed):
        client.start()
    until(lambda: len(direct.told) >= 100 and len(relayed.told) >= 100, "confirms on both")
    killed_a2 = killed = time.monotonic()
    a2.kill()
    until(lambda: relayed.first_after(killed) and direct.first_after(killed), "confirms after")
    assert not direct.closes, "a client of the leader saw the other node die"
    assert relayed.closes, "a relayed client kept a connection through a dead node"
    a2.start()

    # the leader dies under confirmed, transactional and consuming clients
    tx = TxPublisher(pair.a.amqp_ports("a2"), 500_001)
    consumer = AckingConsumer(pair.a.amqp_ports("a1"), "orders.q1")
    for client in (tx, consumer):
        client.start()
    until(lambda: len(tx.told) >= 50 and len(consumer.told) >= 50, "commits and acks")
    killed = time.monotonic()
    a1.kill()
    until(lambda: leads(a2), "a2 to lead", 60)
    until(
        lambda: all(c.first_after(killed) for c in (direct, relayed, tx)),
        "every client served again",
        60,
    )
    served = {c.name: round(c.served_again(killed) or 0.0, 1) for c in (direct, relayed, tx)}
    print(f"served again after the leader's kill (s): {served}")
    assert max(served.values()) <= SERVED_AGAIN, served
    for client in (direct, relayed, tx, consumer):
        client.finish()
    # (under sync + reject a publish may be nacked while B finds the new
    # leader: the checker counts a nack as nothing told)

    # a1 is still down: each site holds what the clients were told
    faults = [Fault("kill a2", killed_a2, killed_a2 + 1), Fault("kill a1", killed, killed + 1)]
    check_sites(pair, "a2", mode, "reject", [direct, relayed, tx, consumer], faults)

    # `vpnrepl nodes` says who leads, under which term, and who went quiet
    shown = pair.cli_a("nodes", "--json")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    rows = {n["name"]: n for n in doc["nodes"]}
    assert (rows["a2"]["leads"], rows["a2"]["vpns"], rows["a1"]["leads"]) == (True, [VPN], False)
    assert rows["a2"]["term"] == doc["lease"]["term"] == 2  # a1 led, then a2
    assert rows["a1"]["last_heartbeat_seconds"] > rows["a2"]["last_heartbeat_seconds"]
    table = pair.cli_a("nodes").stdout
    assert "a2" in table and "leader" in table and "relays" in table


def test_a_leader_paused_past_its_lease_confirms_nothing_the_new_leader_does_not_hold(
    pair: Pair,
) -> None:
    """a1 is paused with a publish in hand and woken as soon as a2 leads,
    before a2 wrote anything: a1's ledger commit under its old term is
    refused (without the fence it would take the index a2 writes next, and
    a2 would stop), a1 closes its clients with 320 and relays to a2."""
    started(pair, "--mode", "async")
    a1, a2 = pair.a["a1"], pair.a["a2"]
    old = ConfirmingPublisher(pair.a.amqp_ports("a1"), 1)
    old.start()
    until(lambda: len(old.told) >= 200, "confirms from a1")
    with_signal(a1, signal.SIGSTOP)
    paused = time.monotonic()
    until(lambda: leads(a2), "a2 to take the lead from the paused a1", 60)
    print(f"a2 led {time.monotonic() - paused:.1f} s after a1's pause")
    with_signal(a1, signal.SIGCONT)
    until(lambda: any("320" in c for c in old.closes), "a1 to close its clients with 320")
    until(lambda: not leads(a1), "a1 to relay", 30)
    assert "lost the lead of site" in a1.log_text()
    with psycopg.connect(pair.a.site.pg.dsn()) as db:
        holder, term = db.execute(
            "SELECT holder, term FROM lease WHERE scope = 'site'"
        ).fetchone() or ("", 0)
    assert holder.startswith("a2.") and term >= 2

    # both clients are served by a2: the old one through a1's relay
    new = ConfirmingPublisher(pair.a.amqp_ports("a2"), 300_001)
    new.start()
    woke = time.monotonic()
    try:
        until(lambda: len(new.told) >= 200 and old.first_after(woke), "confirms from a2 to both")
    except AssertionError as e:
        raise AssertionError(
            f"{e}: new {len(new.told)} told, {len(new.nacked)} nacked, closes {new.closes[-3:]}; "
            f"old {len(old.told)} told, {len(old.nacked)} nacked, closes {old.closes[-3:]}"
        ) from None
    for client in (old, new):
        client.finish()
    assert not old.nacked and not new.nacked
    check_sites(pair, "a2", "async", "reject", [old, new], [Fault("pause a1", paused, woke)])
    # one writer at a time: A's ledger is dense, no index written twice
    with psycopg.connect(pair.a.site.pg.dsn()) as db:
        count, low, top = db.execute(
            "SELECT count(*), min(idx), max(idx) FROM ledger WHERE vpn = %s", (VPN,)
        ).fetchone() or (0, 0, 0)
    assert count == top - low + 1


def test_the_site_rides_out_a_restart_of_its_postgresql(pair: Pair) -> None:
    """The site's database restarts (an HA pair failing over behind one
    address looks the same to a node): the nodes stay up, a leader leads on
    (the same one, or another under a new term when the restart outlasted
    the lease), clients are served again, and nothing they were told is
    lost."""
    started(pair, "--mode", "sync", "--on-sync-timeout", "degrade")
    publisher = ConfirmingPublisher(pair.a.amqp_ports("a2"), 1)
    publisher.start()
    until(lambda: len(publisher.told) >= 200, "confirms before the restart")
    restarted = time.monotonic()
    pair.a.site.pg.restart()
    until(lambda: publisher.first_after(restarted + 0.5), "confirms after the restart", 60)
    until(lambda: pair.a.leader() is not None, "a node to lead", 60)
    assert all(node.alive() for node in pair.a.nodes.values())
    publisher.finish()
    restart = [Fault("restart PostgreSQL A", restarted, restarted + 5)]
    check_sites(pair, pair.a.leader() or "a1", "sync", "degrade", [publisher], restart)


def test_a_node_restarted_after_a_crash_takes_its_own_lease_back_at_once(
    site_a: LocalSite, site_b: LocalSite, tmp_path: Path
) -> None:
    """A one-node site ([listen], the default 15 s lease): the process dies
    and is started again (systemd's Restart=). No session of the dead
    process is left, so the new one takes the lease at once instead of
    waiting it out; a holder whose sessions live (paused) is waited out."""
    sites = Sites(site_a, site_b, tmp_path)
    setup_vpn(site_a)
    enable(sites.cli_a)
    try:
        sites.a.start()
        sites.a.kill()
        restarted = time.monotonic()
        sites.a.start()
        took = time.monotonic() - restarted
    finally:
        sites.a.kill()
    with psycopg.connect(site_a.pg.dsn()) as db:
        holder, term = db.execute(
            "SELECT holder, term FROM lease WHERE scope = 'site'"
        ).fetchone() or ("", 0)
    assert holder.startswith("node.") and term == 2
    assert took < 15.0, f"the restarted node waited {took:.1f} s: it waited the lease out"
