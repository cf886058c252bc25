"""``--queues`` patterns with RabbitMQ's policy semantics: searched in the
queue name. The rewrites that keep an old pattern's meaning (the schema
migration, a peer of bridge protocol version 4), the scope report of ``vpn
enable`` and ``status``, and the whole path on the two-site harness."""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import pika
import psycopg
import pytest
import sqlalchemy as sa
from alembic import command

from plugin.devtools import LocalSite
from plugin.topology import ReplicationScope, out_of_scope, scope_report
from sql import alembic_config, sqlalchemy_url
from tests import REPO
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.two_sites import amqp_url, caught_up, cli_status, scalar, until

NAMES = [
    "orders",
    "orders.",
    "orders.q1",
    "ORDERS.q1",
    "audit.q3",
    "old-orders.q1",
    "orders\n",
    "x#y",
    "",
    "a\nb",
    "q1",
]

PATTERNS = [
    r"orders",
    r"^orders\.",
    r"orders\..*",
    r".",
    r"q1$",
    r"orders$",
    r"(?i)orders\.q1",
    r"(?i)(?s)orders.",
    "(?x) orders \\. # a comment",
    r"(?<=old-)orders",
    r"a|orders",
    r"\Aorders\Z",
    r"(?m)^b",
    r"",
]


def _migration() -> Any:
    """Schema revision 0008, whose rewrite of stored patterns (whole-name to
    searched, and back for its downgrade) is tested here."""
    path = REPO / "sql" / "versions" / "0008_scope_search.py"
    spec = importlib.util.spec_from_file_location("scope_search_0008", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MIGRATION = _migration()
anchored, unanchored = MIGRATION.anchored, MIGRATION.unanchored


@pytest.mark.parametrize("pattern", PATTERNS)
def test_anchored_searches_exactly_what_the_pattern_matched_whole(pattern: str) -> None:
    for name in NAMES:
        was = re.fullmatch(pattern, name) is not None
        assert (re.search(anchored(pattern), name) is not None) is was, (pattern, name)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_unanchored_matches_whole_exactly_what_the_pattern_finds(pattern: str) -> None:
    for name in NAMES:
        found = re.search(pattern, name) is not None
        assert (re.fullmatch(unanchored(pattern), name) is not None) is found, (pattern, name)


def test_inline_flags_stay_in_front_and_a_verbose_comment_cannot_swallow_the_wrapper() -> None:
    assert anchored("(?i)orders") == "(?i)\\A(?:orders)\\Z"
    assert anchored("(?x) a # c") == "(?x)\\A(?: a # c\n)\\Z"
    with pytest.raises(re.error):  # what the rewrite avoids: flags mid-pattern
        re.compile("\\A(?:(?i)orders)\\Z")


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_migrations_downgrade_undoes_its_rewrite(pattern: str) -> None:
    assert unanchored(anchored(pattern)) == pattern


def test_a_pattern_is_searched_as_a_rabbitmq_policy_pattern() -> None:
    scope = ReplicationScope((r"^orders\.",))
    qs = frozenset({"orders.q1", "orders.q2", "audit.q3", "old-orders.q1", "orders"})
    assert scope.in_scope("", "k", qs) == {"orders.q1", "orders.q2"}
    assert ReplicationScope((".",)).in_scope("", "k", qs) == qs
    assert ReplicationScope(("q1",)).in_scope("", "k", qs) == {"orders.q1", "old-orders.q1"}


def test_the_scope_report_names_queues_in_and_out_and_patterns_that_match_nothing() -> None:
    report = scope_report(
        ReplicationScope((r"^orders\.", r"^invoices\.")),
        ["orders.q1", "audit.q3", "orders.q2"],
    )
    assert report.in_scope == ("orders.q1", "orders.q2")
    assert report.out_of_scope == ("audit.q3",)
    assert report.unmatched == (r"^invoices\.",)
    lines = "\n".join(report.lines())
    assert "in scope: orders.q1, orders.q2" in lines
    assert "NOT in scope (not replicated): audit.q3" in lines
    assert "warning: --queues '^invoices\\.' matches none of the VPN's queues now" in lines


def test_out_of_scope_lists_persistent_messages_no_pattern_takes() -> None:
    scope = ReplicationScope((r"^orders\.",))
    persistent = {"orders.q1": 4, "audit.q3": 2, "empty": 0, "topic.q": 3}
    assert out_of_scope(scope, persistent, {"orders.q1": 4, "topic.q": 3}) == {"audit.q3": 2}


# ---------------------------------------------------------------- schema


def _migrate(dsn: str, revision: str, *, down: bool = False) -> None:
    engine = sa.create_engine(sqlalchemy_url(dsn), poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            (command.downgrade if down else command.upgrade)(cfg, revision)
    finally:
        engine.dispose()


def test_an_upgraded_database_keeps_its_patterns_meaning(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    _migrate(dsn, "0007")
    with psycopg.connect(site_a.pg.dsn(), autocommit=True) as db:
        db.execute(
            "INSERT INTO vpn_config (name, role, mode, sync_timeout_ms, on_sync_timeout,"
            " queue_patterns, epoch) VALUES ('old', 'active', 'async', 2000, 'degrade', %s, 1)",
            (["orders", "(?i)audit\\..*"],),
        )
    _migrate(dsn, "0008")
    patterns = scalar(site_a, "SELECT queue_patterns FROM vpn_config WHERE name = 'old'")
    assert patterns == ["\\A(?:orders)\\Z", "(?i)\\A(?:audit\\..*)\\Z"]
    scope = ReplicationScope(tuple(patterns))
    qs = frozenset({"orders", "orders.q1", "AUDIT.x", "xaudit.y"})
    assert scope.in_scope("", "k", qs) == {"orders", "AUDIT.x"}  # as before the upgrade
    _migrate(dsn, "0007", down=True)
    assert scalar(site_a, "SELECT queue_patterns FROM vpn_config WHERE name = 'old'") == [
        "orders",
        "(?i)audit\\..*",
    ]


# ---------------------------------------------------------------- two sites

VPN = "orders"


def _topology(site: LocalSite) -> None:
    site.rabbit.add_vhost(VPN)
    conn = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url(VPN)))
    ch = conn.channel()
    for q in ("orders.q1", "audit.q3"):
        ch.queue_declare(q, durable=True)
    conn.close()


def test_a_prefix_pattern_replicates_its_queues_and_status_names_the_others(
    vpnrepl_a: Vpnrepl, node_a: NodeProcess, node_b: NodeProcess
) -> None:
    _topology(node_a.site)
    enabled = vpnrepl_a("vpn", "enable", VPN, "--role", "active", "--mode", "sync",
                        "--queues", r"^orders\.", "--queues", r"^invoices\.")  # fmt: skip
    assert enabled.returncode == 0, enabled.stderr
    assert "in scope: orders.q1" in enabled.stdout
    assert "NOT in scope (not replicated): audit.q3" in enabled.stdout
    assert "warning: --queues '^invoices\\.' matches none" in enabled.stdout
    node_a.start()
    node_b.start()
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(node_a.site)))
    ch = conn.channel()
    ch.confirm_delivery()
    persistent = pika.BasicProperties(delivery_mode=2)
    for n in range(5):
        ch.basic_publish("", "orders.q1", b"o%d" % n, persistent, mandatory=True)
        ch.basic_publish("", "audit.q3", b"a%d" % n, persistent, mandatory=True)
    conn.close()
    caught_up(node_a, node_b)
    for site in (node_a.site, node_b.site):
        assert (
            scalar(
                site,
                "SELECT count(*) FROM live_message WHERE vpn = %s AND queue = 'orders.q1'",
                VPN,
            )
            == 5
        )
        assert (
            scalar(
                site, "SELECT count(*) FROM live_message WHERE vpn = %s AND queue = 'audit.q3'", VPN
            )
            == 0
        )
    # the management API counts lag by its statistics interval
    status = until(
        lambda: (s := cli_status(node_a))["out_of_scope"] == {"audit.q3": 5} and s,
        "status to name audit.q3 as out of scope",
        60,
    )
    assert status["queues"] == {"orders.q1": 5}
    assert status["scope"]["queues"] == [r"^orders\.", r"^invoices\."]
    # and the table says it in words
    table = vpnrepl_a("status")
    assert table.returncode == 0, table.stderr
    assert "  audit.q3: 5 persistent at the broker, NOT in scope (not replicated)" in table.stdout
    assert "  orders.q1: 5 replicated live" in table.stdout


def test_enabling_a_vpn_whose_vhost_does_not_exist_yet_says_so(vpnrepl_a: Vpnrepl) -> None:
    assert vpnrepl_a("init").returncode == 0
    enabled = vpnrepl_a("vpn", "enable", "not-yet", "--role", "active", "--queues", "^orders\\.")
    assert enabled.returncode == 0, enabled.stderr  # the report is advice; the VPN is enabled
    assert "the broker has no vhost 'not-yet' yet: no queue to check the scope on" in enabled.stdout
