"""The admin's CLI against a real PostgreSQL: init, vpn enable/disable,
status (``--json``, and ``--watch N`` refreshing it until interrupted).

It runs ``vpnrepl`` as the admin does, so it tests the command line as a
whole: the parser, the commands, their exit statuses and one-line errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from plugin.devtools import LocalSite
from tests.fix_cli import Vpnrepl
from tests.support.two_sites import until

CONTRACT_COMMANDS = ["init", "node", "vpn", "status", "promote", "demote", "reconcile", "demo"]


def test_help_lists_every_contract_command(tmp_path: Path) -> None:
    result = Vpnrepl(tmp_path / "unused.toml")("--help", config=False)
    assert result.returncode == 0
    for command in CONTRACT_COMMANDS:
        assert f"    {command} " in result.stdout, command


def test_init_creates_the_schema_and_is_idempotent(vpnrepl_a: Vpnrepl, site_a: LocalSite) -> None:
    first = vpnrepl_a("init")
    assert first.returncode == 0, first.stderr
    assert "upgraded from empty to revision 0018" in first.stdout
    second = vpnrepl_a("init")
    assert second.returncode == 0, second.stderr
    assert "schema is current (revision 0018)" in second.stdout
    with psycopg.connect(site_a.pg.dsn()) as conn:
        tables = {
            r[0]
            for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        }
    assert {
        "vpn_config",
        "vpn_state",
        "ledger",
        "live_message",
        "txn_log",
        "node_incarnation",
        "alembic_version",
    } <= tables


def test_enable_then_status_json_shows_role_and_mode(vpnrepl_a: Vpnrepl) -> None:
    assert vpnrepl_a("init").returncode == 0
    result = vpnrepl_a(
        "vpn",
        "enable",
        "orders",
        "--role",
        "active",
        "--mode",
        "sync",
        "--sync-timeout-ms",
        "750",
        "--on-sync-timeout",
        "reject",
        "--queues",
        r"orders\..*",
        "--topics",
        "amq.topic:orders.#",
    )
    assert result.returncode == 0, result.stderr
    assert "VPN 'orders' enabled" in result.stdout
    assert vpnrepl_a("vpn", "enable", "audit", "--role", "standby").returncode == 0

    status = vpnrepl_a("status", "--json")
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    assert doc["site"] == "a"
    by_name = {v["name"]: v for v in doc["vpns"]}
    orders = by_name["orders"]
    assert (orders["role"], orders["mode"], orders["epoch"]) == ("active", "sync", 1)
    assert orders["sync_timeout_ms"] == 750
    assert orders["on_sync_timeout"] == "reject"
    assert orders["scope"] == {"queues": [r"orders\..*"], "topics": ["amq.topic:orders.#"]}
    for key in (
        "sync_eligible",
        "bridge",
        "ledger_index",
        "applied_index",
        "lag_events",
        "lag_seconds",
        "in_doubt_txns",
        "queues",
    ):
        assert key in orders, key
    assert orders["in_doubt_txns"] == 0 and orders["queues"] == {}
    assert (by_name["audit"]["role"], by_name["audit"]["mode"]) == ("standby", "async")
    assert orders["expose_id"] is False  # consumers do not see the id header by default

    text = vpnrepl_a("status")
    assert text.returncode == 0
    assert re.search(
        r"^orders\s+active\s+1\s+sync\s+eligible\s+disconnected\s+0\s+0", text.stdout, re.M
    )
    assert re.search(r"^audit\s+standby\s+\d+\s+async\s+-\s", text.stdout, re.M)


def test_reenable_updates_what_it_names_keeps_the_rest_and_refuses_a_role_change(
    vpnrepl_a: Vpnrepl,
) -> None:
    assert vpnrepl_a("init").returncode == 0
    first = vpnrepl_a("vpn", "enable", "orders", "--role", "active", "--queues", r"orders\..*")
    assert first.returncode == 0, first.stderr
    again = vpnrepl_a("vpn", "enable", "orders", "--role", "active", "--mode", "sync")
    assert again.returncode == 0 and "updated" in again.stdout
    flip = vpnrepl_a("vpn", "enable", "orders", "--role", "standby")
    assert flip.returncode == 1
    assert "already enabled as active" in flip.stderr and "promote" in flip.stderr
    doc = json.loads(vpnrepl_a("status", "--json").stdout)
    assert [(v["role"], v["mode"]) for v in doc["vpns"]] == [("active", "sync")]
    exposed = vpnrepl_a("vpn", "enable", "orders", "--role", "active", "--expose-id")
    assert exposed.returncode == 0, exposed.stderr
    # the mode and the scope given before are kept: an option left out
    # changes nothing (a mode change must not widen the scope)
    doc = json.loads(vpnrepl_a("status", "--json").stdout)
    assert [(v["mode"], v["expose_id"]) for v in doc["vpns"]] == [("sync", True)]
    assert doc["vpns"][0]["scope"]["queues"] == ["orders\\..*"]
    hidden = vpnrepl_a("vpn", "enable", "orders", "--role", "active", "--no-expose-id")
    assert hidden.returncode == 0, hidden.stderr
    doc = json.loads(vpnrepl_a("status", "--json").stdout)
    assert [(v["mode"], v["expose_id"]) for v in doc["vpns"]] == [("sync", False)]


def test_disable_removes_the_vpn_from_status(vpnrepl_a: Vpnrepl) -> None:
    assert vpnrepl_a("init").returncode == 0
    assert vpnrepl_a("vpn", "enable", "orders", "--role", "active").returncode == 0
    assert vpnrepl_a("vpn", "disable", "orders").returncode == 0
    assert json.loads(vpnrepl_a("status", "--json").stdout)["vpns"] == []
    again = vpnrepl_a("vpn", "disable", "orders")
    assert again.returncode == 1
    assert "'orders' is not enabled" in again.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--queues", "orders.(["], "--queues 'orders.([': not a valid regex"),
        (["--topics", "no-colon"], "--topics 'no-colon': expected EXCHANGE:PATTERN"),
        (["--topics", "x:a.b*.c"], "must stand alone"),
        (["--sync-timeout-ms", "0"], "--sync-timeout-ms must be"),
        (["--mode", "eventual"], "argument --mode: invalid choice"),
    ],
)
def test_bad_vpn_arguments_exit_2_naming_the_option(
    vpnrepl_a: Vpnrepl, args: list[str], needle: str
) -> None:
    result = vpnrepl_a("vpn", "enable", "orders", "--role", "active", *args)
    assert result.returncode == 2
    assert needle in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_status_before_init_says_to_run_init(vpnrepl_a: Vpnrepl) -> None:
    result = vpnrepl_a("status", "--json")
    assert result.returncode == 1
    assert "run `vpnrepl init`" in result.stderr


def test_unreachable_database_is_a_clear_failure_without_the_password(
    tmp_path: Path, site_a: LocalSite
) -> None:
    text = site_a.config_text().replace(
        site_a.pg.dsn(), "postgresql://admin:hunter2@127.0.0.1:1/vpnrepl"
    )
    cfg = tmp_path / "down.toml"
    cfg.write_text(text)
    result = Vpnrepl(cfg)("status")
    assert result.returncode == 1
    assert "cannot connect to postgresql://admin:***@127.0.0.1:1/vpnrepl" in result.stderr
    assert "hunter2" not in result.stderr


def test_a_node_without_bridge_certificates_refuses_to_start(
    tmp_path: Path, site_a: LocalSite
) -> None:
    cfg = tmp_path / "plain.toml"
    cfg.write_text(site_a.config_text(tls=False))
    result = Vpnrepl(cfg)("node")
    assert result.returncode == 2
    assert f"{cfg}: tls: the bridge is mutual TLS between named sites" in result.stderr
    assert "[insecure] plaintext_bridge = true" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_config_errors_exit_2_naming_file_and_key(tmp_path: Path, site_a: LocalSite) -> None:
    cfg = tmp_path / "typo.toml"
    cfg.write_text(site_a.config_text().replace("management_url", "managment_url"))
    result = Vpnrepl(cfg)("status")
    assert result.returncode == 2
    assert f"{cfg}: broker.managment_url: unknown key" in result.stderr
    cfg.write_text(site_a.config_text().replace("[store]\ndsn", "[store]\nfoo"))
    result = Vpnrepl(cfg)("init")
    assert result.returncode == 2
    assert "store.foo: unknown key" in result.stderr
    missing = Vpnrepl(tmp_path / "nope.toml")("status")
    assert missing.returncode == 2 and "file not found" in missing.stderr
    no_config = Vpnrepl(cfg)("status", config=False)
    assert no_config.returncode == 2 and "--config SITE.TOML is required" in no_config.stderr


def test_promote_refuses_what_is_not_a_standby_with_one_line(vpnrepl_a: Vpnrepl) -> None:
    assert vpnrepl_a("init").returncode == 0
    assert vpnrepl_a("vpn", "enable", "orders", "--role", "active").returncode == 0
    for vpn, why in (("orders", "is already active on this site"), ("nope", "is not known")):
        result = vpnrepl_a("promote", vpn)
        assert result.returncode == 1
        [line] = [x for x in result.stderr.splitlines() if x.startswith("vpnrepl: error:")]
        assert why in line
    assert vpnrepl_a("promote").returncode == 2  # usage: the VPN is missing
    demote = vpnrepl_a("demote", "orders")
    assert demote.returncode == 1
    assert "is active and not fenced here: demote turns a fenced former active" in demote.stderr
    missing = vpnrepl_a("republish", "/nonexistent/tail.jsonl")
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_reconcile_without_the_standbys_store_names_the_missing_key(
    vpnrepl_a: Vpnrepl, tmp_path: Path
) -> None:
    assert vpnrepl_a("init").returncode == 0
    text = vpnrepl_a.config.read_text()
    without = tmp_path / "no-peer-store.toml"
    without.write_text("".join(line for line in text.splitlines(True) if "store_dsn" not in line))
    result = Vpnrepl(without)("reconcile", "orders")
    assert result.returncode == 2
    assert "peers.b.store_dsn: reconcile reads the standby's store: set it" in result.stderr


def test_status_shows_broker_depth_next_to_replicated_count(
    vpnrepl_a: Vpnrepl, site_a: LocalSite
) -> None:
    import pika

    site_a.rabbit.add_vhost("orders")
    conn = pika.BlockingConnection(pika.URLParameters(site_a.rabbit.amqp_url("orders")))
    ch = conn.channel()
    ch.queue_declare("bypass.q", durable=True)
    for _ in range(3):  # straight to the broker: not replicated
        ch.basic_publish("", "bypass.q", b"x", pika.BasicProperties(delivery_mode=2))
    conn.close()
    assert vpnrepl_a("init").returncode == 0
    assert vpnrepl_a("vpn", "enable", "orders", "--role", "active").returncode == 0
    [vpn] = json.loads(vpnrepl_a("status", "--json").stdout)["vpns"]
    assert vpn["queues"] == {}
    for _ in range(50):  # the management API's message counts lag by a few seconds
        if vpn["broker_queues"] == {"bypass.q": 3}:
            break
        time.sleep(0.2)
        [vpn] = json.loads(vpnrepl_a("status", "--json").stdout)["vpns"]
    assert vpn["broker_queues"] == {"bypass.q": 3}


@pytest.mark.parametrize(
    ("value", "needle"),
    [("0", "0.5 to 86400 seconds"), ("soon", "'soon' is not a number of seconds")],
)
def test_a_bad_watch_interval_is_a_usage_error(vpnrepl_a: Vpnrepl, value: str, needle: str) -> None:
    result = vpnrepl_a("status", "--watch", value)
    assert result.returncode == 2
    assert "--watch" in result.stderr and needle in result.stderr


class _Watch:
    """``vpnrepl status --watch 0.5`` writing to a file the test can read
    while it runs (a loaded machine refreshes late, not never)."""

    def __init__(self, config: Path, out: Path, *args: str) -> None:
        exe = shutil.which("vpnrepl") or str(Path(sys.executable).with_name("vpnrepl"))
        self.out = out
        self._stdout = out.open("w")
        self.proc = subprocess.Popen(
            [exe, "--config", str(config), "status", "--watch", "0.5", *args],
            stdout=self._stdout,
            stderr=subprocess.PIPE,
            text=True,
            # a watch that outlives its Ctrl-C dumps its threads' stacks on SIGABRT
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )

    def until(self, check: Callable[[str], bool], what: str) -> None:
        def seen() -> bool:
            assert self.proc.poll() is None, f"the watch ended before {what}"
            return check(self.out.read_text())

        until(seen, what, timeout=60.0)

    def stop(self) -> tuple[str, str]:
        """Ctrl-C, as a user ends a watch; a watch still running 30 s later
        fails the test with the stacks it was stuck in."""
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            _, err = self.proc.communicate(timeout=30)
            raise AssertionError(f"the watch outlived its Ctrl-C by 30 s:\n{err}") from None
        finally:
            self._stdout.close()
        assert self.proc.returncode == 0, err  # Ctrl-C is how a watch ends: not a failure
        return self.out.read_text(), err


def test_watch_refreshes_until_interrupted(vpnrepl_a: Vpnrepl, tmp_path: Path) -> None:
    assert vpnrepl_a("init").returncode == 0
    assert vpnrepl_a("vpn", "enable", "orders", "--role", "active").returncode == 0
    watch = _Watch(vpnrepl_a.config, tmp_path / "table.txt")
    watch.until(lambda out: out.count("site a\n") >= 2, "second refresh")
    assert vpnrepl_a("vpn", "enable", "audit", "--role", "standby").returncode == 0
    watch.until(lambda out: re.search(r"^audit\s+standby\s", out, re.M) is not None, "audit")
    out, err = watch.stop()
    assert out.count("site a\n") >= 3, out
    assert "every 0.5 s (Ctrl-C stops)" in out
    assert "Traceback" not in err

    watch = _Watch(vpnrepl_a.config, tmp_path / "json.txt", "--json")
    watch.until(lambda out: out.count("\n") >= 2, "two JSON documents")
    out, _ = watch.stop()
    docs = [json.loads(line) for line in out.splitlines()]
    assert len(docs) >= 2
    assert all([v["name"] for v in d["vpns"]] == ["audit", "orders"] for d in docs)
