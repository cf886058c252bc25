"""Config-sync between two real sites (both nodes, both brokers).

The standby's VPN settings follow the active's at every listing, and a
client user created on the active's broker (not ``guest``) logs in to the
standby's broker with its own password, also from the copy of the
definitions the standby keeps for a promotion. Site A re-reads its settings
every second (``topology_refresh_seconds = 1``) and relists them to B each
time, so a change reaches B within seconds instead of half a minute.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pika
import pika.exceptions
import psycopg
import pytest

from bridge.broker import ManagementAPI, reimport
from plugin.devtools import HarnessError, LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.two_sites import SCOPE, VPN, enable, scalar, setup_vpn, until

USERS = ("alice", "carol", "dave")
SETTINGS = (
    "SELECT mode, sync_timeout_ms, on_sync_timeout, queue_patterns, topic_filters, expose_id"
    " FROM vpn_config WHERE name = %s AND role = 'standby'"
)


def relist_every_second(node: NodeProcess) -> None:
    text = node.config.read_text()
    node.config.write_text(text.replace("[broker]\n", "[broker]\ntopology_refresh_seconds = 1\n"))


def row(site: LocalSite, statement: str, *params: Any) -> tuple[Any, ...] | None:
    with psycopg.connect(site.pg.dsn(), autocommit=True) as db:
        return db.execute(statement, params).fetchone()


def stored_copy(site: LocalSite) -> bytes:
    """The definitions the standby keeps for a promotion."""
    return bytes(scalar(site, "SELECT definitions FROM vpn_config WHERE name = %s", VPN))


def logs_in(site: LocalSite, name: str, password: str) -> bool:
    """Whether ``name`` opens an AMQP connection to the site's broker, on the VPN."""
    params = pika.ConnectionParameters(
        "127.0.0.1",
        site.rabbit.amqp_port,
        VPN,
        pika.PlainCredentials(name, password),
        connection_attempts=1,
        socket_timeout=5,
    )
    try:
        conn = pika.BlockingConnection(params)
    except pika.exceptions.AMQPConnectionError:
        return False
    conn.close()
    return True


@pytest.fixture
def client_users(site_a: LocalSite, site_b: LocalSite) -> Any:
    """The brokers' reset keeps users: remove this module's afterwards."""
    yield USERS
    for site in (site_a, site_b):
        for name in USERS:
            with contextlib.suppress(HarnessError):
                site.rabbit.api("DELETE", f"users/{name}")


def test_the_standby_settings_follow_every_change_on_the_active(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    relist_every_second(node_a)
    setup_vpn(site_a)
    enable(vpnrepl_a)
    node_a.start()
    node_b.start()
    first: tuple[Any, ...] = ("async", 2000, "degrade", [SCOPE], [], False)
    until(lambda: row(site_b, SETTINGS, VPN) == first, "B to adopt the VPN")

    changed = vpnrepl_a(
        "vpn",
        "enable",
        VPN,
        "--role",
        "active",
        "--mode",
        "sync",
        "--sync-timeout-ms",
        "1500",
        "--on-sync-timeout",
        "reject",
        "--queues",
        r"orders\.q1",
        "--topics",
        "events:order.eu.#",
        "--expose-id",
    )
    assert changed.returncode == 0, changed.stderr
    second = ("sync", 1500, "reject", [r"orders\.q1"], ["events:order.eu.#"], True)
    until(lambda: row(site_b, SETTINGS, VPN) == second, "B to follow the new settings", 30)
    epoch = "SELECT epoch FROM vpn_config WHERE name = %s"
    assert scalar(site_b, epoch, VPN) == scalar(site_a, epoch, VPN)
    shown = [v for v in node_b.status()["vpns"] if v["name"] == VPN][0]
    assert (shown["role"], shown["mode"], shown["expose_id"]) == ("standby", "sync", True)
    assert shown["scope"] == {"queues": [r"orders\.q1"], "topics": ["events:order.eu.#"]}

    time.sleep(3)  # three more listings: the change is logged when it arrives, not again
    lines = [ln for ln in node_b.log_text().splitlines() if "settings follow the active" in ln]
    assert len(lines) == 1, lines
    assert "mode 'async' -> 'sync'" in lines[0] and "expose_id False -> True" in lines[0]

    defaults = ("--mode", "async", "--sync-timeout-ms", "2000", "--on-sync-timeout", "degrade")
    # every queue again ('' clears a list), no topic filters, the id hidden
    scope = ("--queues", "", "--topics", "", "--no-expose-id")
    assert vpnrepl_a("vpn", "enable", VPN, "--role", "active", *defaults, *scope).returncode == 0
    back: tuple[Any, ...] = ("async", 2000, "degrade", [], [], False)
    until(lambda: row(site_b, SETTINGS, VPN) == back, "B to follow the defaults", 30)
    assert node_b.log_text().count("settings follow the active") == 2
    assert node_b.stop() == 0 and node_a.stop() == 0


def test_a_client_user_logs_in_to_the_standby_broker_now_and_after_a_reimport(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
    client_users: Any,
) -> None:
    relist_every_second(node_a)
    a, b = site_a.rabbit, site_b.rabbit
    setup_vpn(site_a)
    a.api("PUT", "users/alice", {"password": "alice-pw-1", "tags": ""})
    a.api("PUT", f"permissions/{VPN}/alice", {"configure": "^alice", "write": ".*", "read": ".*"})
    topic = {"exchange": "events", "write": "^order\\.", "read": ".*"}
    a.api("PUT", f"topic-permissions/{VPN}/alice", topic)
    a.api("PUT", "users/carol", {"password": "carol-pw", "tags": ""})  # another vhost only
    a.api("PUT", "permissions/%2F/carol", {"configure": ".*", "write": ".*", "read": ".*"})
    b_guest = b.api("GET", "users/guest")["password_hash"]
    enable(vpnrepl_a)
    node_a.start()
    node_b.start()

    until(lambda: logs_in(site_b, "alice", "alice-pw-1"), "alice to log in to B's broker")
    a.api("PUT", "users/dave", {"password": "dave-pw", "tags": "monitoring"})  # after enabling
    a.api("PUT", f"permissions/{VPN}/dave", {"configure": "", "write": "", "read": ".*"})
    until(lambda: logs_in(site_b, "dave", "dave-pw"), "dave to log in to B's broker", 30)

    def access(site: LocalSite, kind: str) -> list[dict[str, str]]:
        found = site.rabbit.api("GET", f"vhosts/{VPN}/{kind}")
        return sorted((p for p in found if p["user"] != "guest"), key=lambda p: p["user"])

    assert access(site_b, "permissions") == access(site_a, "permissions")
    assert access(site_b, "topic-permissions") == access(site_a, "topic-permissions") != []
    # no [configsync] copy_tags: dave's tag stays on the active; ours marks him
    assert b.api("GET", "users/dave")["tags"] == ["vpnrepl-config-sync"]
    with pytest.raises(HarnessError, match="HTTP 404"):
        b.api("GET", "users/carol")
    assert b.api("GET", "users/guest")["password_hash"] == b_guest  # B's own user is B's

    stored = stored_copy(site_b)
    alice_hash = a.api("GET", "users/alice")["password_hash"]
    assert alice_hash.encode() in stored and b"carol" not in stored
    for password in (b"alice-pw-1", b"dave-pw", b"carol-pw", b"guest:guest"):
        assert password not in stored

    # a new password on the active replaces the standby's
    a.api("PUT", "users/alice", {"password": "alice-pw-2", "tags": ""})
    until(lambda: logs_in(site_b, "alice", "alice-pw-2"), "alice's new password on B", 30)
    assert not logs_in(site_b, "alice", "alice-pw-1")
    new_hash = a.api("GET", "users/alice")["password_hash"]
    until(lambda: new_hash.encode() in stored_copy(site_b), "B to keep the newest copy", 30)
    log_b, log_a = node_b.log_text(), node_a.log_text()
    assert log_b.count("left as they are here") == 1  # guest: said once, not every listing
    for text in (log_a, log_b):
        for secret in (alice_hash, new_hash, b_guest, "alice-pw", "dave-pw"):
            assert secret not in text
    assert node_b.stop() == 0 and node_a.stop() == 0

    # The active is gone; B's broker lost the VPN and alice: the promotion's
    # re-import from the stored copy brings both back.
    b.api("DELETE", f"vhosts/{VPN}")
    b.api("DELETE", "users/alice")
    assert not logs_in(site_b, "alice", "alice-pw-2")
    assert reimport(ManagementAPI(b.management_url), VPN, site_b.pg.dsn()) is True
    assert logs_in(site_b, "alice", "alice-pw-2")
    assert {q["name"] for q in b.api("GET", f"queues/{VPN}")} == {"orders.q1", "orders.q2", "audit"}
    assert reimport(ManagementAPI(b.management_url), "no-such-vpn", site_b.pg.dsn()) is False
