"""Operator commands reach the site's node through its database
(plugin/ops/_requests.py), against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import psycopg
import pytest

from bridge.store import SITE, holds_term, lease_of, renew_lease, take_lease
from plugin import PluginError, StateError
from plugin.devtools import LocalSite
from plugin.ops import SITE_LOCK, Progress, RequestServer, run_command
from sql import migrate
from tests.fix_sites import role_dsn


def lock_free(dsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        try:
            conn.execute(f"LOCK TABLE {SITE_LOCK} IN EXCLUSIVE MODE NOWAIT")
        except psycopg.errors.LockNotAvailable:
            return False
        conn.rollback()
        return True


def hold_site_lock(dsn: str) -> psycopg.Connection[Any]:
    """A session holding the site lock as a node does (closing it lets go)."""
    conn = psycopg.connect(dsn)
    conn.execute(f"LOCK TABLE {SITE_LOCK} IN EXCLUSIVE MODE NOWAIT")
    return conn


def _record(ticks: list[tuple[int, int]]) -> Progress:
    return lambda done, total: ticks.append((done, total))


def test_without_a_node_the_cli_does_the_work_holding_the_site_lock(dsn: str) -> None:
    seen: list[bool] = []

    async def local(progress: Progress) -> dict[str, Any]:
        seen.append(await asyncio.to_thread(lock_free, dsn))
        progress(1, 1)
        return {"done": "here"}

    ticks: list[tuple[int, int]] = []
    result = asyncio.run(run_command(dsn, "promote", "orders", {}, local, _record(ticks)))
    assert result == {"done": "here"} and ticks == [(1, 1)]
    assert seen == [False]  # a node starting meanwhile would have waited
    assert lock_free(dsn)


async def _through_node(dsn: str, handler: Any, command: str = "promote") -> Any:
    server = RequestServer(dsn, {"promote": handler})
    await server.start()
    try:

        async def local(progress: Progress) -> dict[str, Any]:
            raise AssertionError("a node runs: the CLI must not do the work itself")

        ticks: list[tuple[int, int]] = []
        result = await run_command(dsn, command, "orders", {"x": 1}, local, _record(ticks))
        return result, ticks
    finally:
        await server.close()


def test_with_a_node_running_the_request_is_carried_out_by_the_node(dsn: str) -> None:
    async def handler(vpn: str, args: Mapping[str, Any], progress: Progress) -> dict[str, Any]:
        for done in range(0, 101, 50):
            progress(done, 100)
            await asyncio.sleep(0.6)  # progress is written at most twice a second
        return {"vpn": vpn, "args": dict(args)}

    result, ticks = asyncio.run(_through_node(dsn, handler))
    assert result == {"vpn": "orders", "args": {"x": 1}}
    assert ticks and ticks[-1] == (100, 100)
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT command, vpn, state FROM operator_request").fetchone()
    assert row == ("promote", "orders", "done")


def test_a_refusal_on_the_node_reaches_the_cli_as_its_error(dsn: str) -> None:
    async def handler(vpn: str, args: Mapping[str, Any], progress: Progress) -> dict[str, Any]:
        raise StateError("VPN 'orders' is already active on this site")

    with pytest.raises(StateError, match="already active"):
        asyncio.run(_through_node(dsn, handler))
    with pytest.raises(StateError, match="does not know the command 'frobnicate'"):
        asyncio.run(_through_node(dsn, handler, command="frobnicate"))


def test_a_node_that_stops_mid_command_is_reported_and_its_request_failed(dsn: str) -> None:
    async def scenario() -> None:
        started = asyncio.Event()

        async def handler(vpn: str, args: Mapping[str, Any], progress: Progress) -> dict[str, Any]:
            started.set()
            await asyncio.sleep(3600)
            return {}

        server = RequestServer(dsn, {"promote": handler})
        await server.start()

        async def local(progress: Progress) -> dict[str, Any]:
            raise AssertionError("not without the node")

        cli = asyncio.ensure_future(run_command(dsn, "promote", "orders", {}, local, print))
        await asyncio.wait_for(started.wait(), 30)
        await server.close()  # the node is gone: its lock with it
        with pytest.raises(PluginError, match="stopped while it ran promote orders"):
            await asyncio.wait_for(cli, 30)
        # the next node fails what was left running
        again = RequestServer(dsn, {})
        await again.start()
        await again.close()

    asyncio.run(scenario())
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT state, error FROM operator_request").fetchone()
    assert row is not None and row[0] == "failed" and "run the command again" in row[1]


def _peer_dsn(site: LocalSite) -> str:
    """A role on ``site``'s store with the README's peer grants."""
    return role_dsn(
        site,
        "vpnrepl_peer",
        "SELECT ON live_message, vpn_state TO {role}",
        "SELECT (name, enabled, role, epoch, queue_patterns, topic_filters) ON vpn_config"
        " TO {role}",
        "EXECUTE ON FUNCTION vpnrepl_request(text, text, jsonb) TO {role}",
        "SELECT ON operator_request TO {role}",
    )


def test_the_peers_role_may_request_only_the_switchover_steps(dsn: str, site_a: LocalSite) -> None:
    """The peer site's role reaches this site's database for a switchover:
    it cannot ask for a promote or a demote, nor write requests directly,
    and what it asks is recorded with its name."""
    peer = _peer_dsn(site_a)
    with psycopg.connect(peer, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"):
            conn.execute("INSERT INTO operator_request (command, vpn) VALUES ('promote', 'orders')")
        # nor read the key that makes commit markers (it could forge them)
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"):
            conn.execute("SELECT secret FROM marker_key")
        for command in ("promote", "demote", "xa-decide", "repair", "retire-uncertain"):
            with pytest.raises(
                psycopg.errors.InsufficientPrivilege, match="only the switchover steps"
            ):
                conn.execute("SELECT vpnrepl_request(%s, 'orders', '{}')", (command,))
        row = conn.execute(
            "SELECT vpnrepl_request('switchover-prepare', 'orders', '{}')"
        ).fetchone()
        assert row is not None
    with psycopg.connect(dsn) as conn:
        by = conn.execute(
            "SELECT command, requested_by FROM operator_request WHERE id = %s", (row[0],)
        ).fetchone()
    assert by == ("switchover-prepare", "vpnrepl_peer")

    async def refused() -> None:
        async def local(progress: Progress) -> dict[str, Any]:
            raise AssertionError("no node ran: the peer must not act here")

        await run_command(peer, "promote", "orders", {}, local, lambda d, t: None)

    lock = hold_site_lock(dsn)  # a node runs
    try:
        with pytest.raises(StateError, match="refused by the site's database"):
            asyncio.run(refused())
    finally:
        lock.close()


def test_no_role_but_the_nodes_can_keep_the_node_from_starting(dsn: str, site_a: LocalSite) -> None:
    """The peer's role (README grants) cannot take the site lock, and
    whatever it holds meanwhile — the advisory lock earlier releases used, a
    failed locking read left in an open transaction — the node starts."""
    peer = psycopg.connect(_peer_dsn(site_a))
    try:
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"):
            peer.execute(f"LOCK TABLE {SITE_LOCK} IN EXCLUSIVE MODE NOWAIT")
        peer.rollback()
        peer.execute("SELECT pg_advisory_lock(%s)", (0x76706E7265706C,))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            peer.execute("SELECT * FROM site_lock FOR UPDATE")
        assert peer.info.transaction_status == psycopg.pq.TransactionStatus.INERROR

        async def starts() -> bool:
            server = RequestServer(dsn, {})
            await asyncio.wait_for(server.start(wait_log_seconds=0.1), 10)
            try:
                return not await asyncio.to_thread(lock_free, dsn)
            finally:
                await server.close()

        assert asyncio.run(starts())
        assert lock_free(dsn)
    finally:
        peer.close()


def test_the_peers_role_acts_itself_only_when_no_node_runs(dsn: str, site_a: LocalSite) -> None:
    """A role that may not hold the lock still learns whether a node runs
    (a switchover's first step says so when it does not)."""
    ran: list[str] = []

    async def local(progress: Progress) -> dict[str, Any]:
        ran.append("local")
        raise StateError("the active site's node is not running")

    with pytest.raises(StateError, match="not running"):
        asyncio.run(
            run_command(
                _peer_dsn(site_a), "switchover-prepare", "orders", {}, local, lambda d, t: None
            )  # fmt: skip
        )
    assert ran == ["local"]


def test_a_schema_without_the_site_lock_is_named(site_a: LocalSite) -> None:
    dsn = site_a.pg.dsn()
    migrate(dsn, "0013")
    with pytest.raises(StateError, match="run `vpnrepl init`"):
        asyncio.run(RequestServer(dsn, {}).start())
    migrate(dsn)


def test_the_cli_acting_alone_waits_out_a_lease_and_fences_its_holder(dsn: str) -> None:
    """No node holds the site lock, but a node's lease still runs (a leader
    cut off from its database, perhaps alive): the CLI waits until the
    lease ran out, takes it (the term rises, so that leader's ledger commits
    are refused from then on), and lets it go when done."""
    with psycopg.connect(dsn, autocommit=True) as db:
        assert take_lease(SITE, "a1.cafe-0", 1.5).run(db) == 1
    seen: list[tuple[str, int, float] | None] = []

    async def local(progress: Progress) -> dict[str, Any]:
        with psycopg.connect(dsn, autocommit=True) as db:
            seen.append(lease_of(SITE).run(db))
            assert not holds_term(SITE, "a1.cafe-0", 1).run(db)
        return {"done": True}

    t0 = time.monotonic()
    assert asyncio.run(run_command(dsn, "promote", "orders", {}, local, lambda d, t: None)) == {
        "done": True
    }
    assert time.monotonic() - t0 >= 1.0  # it waited the lease out
    assert seen[0] is not None and seen[0][0].startswith("cli.") and seen[0][1] == 2
    with psycopg.connect(dsn, autocommit=True) as db:
        after = lease_of(SITE).run(db)
    assert after is not None and after[2] <= 0  # released: a node may take it at once


def test_the_cli_hands_a_command_to_a_node_that_renews_its_lease(dsn: str) -> None:
    """A node that took the lease and waits for the lock the CLI holds is
    alive: the CLI sees the renewal, lets the lock go, and the node runs the
    command."""

    async def scenario() -> dict[str, Any]:
        async def local(progress: Progress) -> dict[str, Any]:
            raise AssertionError("a node is alive: the CLI must not act alone")

        async def promote(vpn: str, args: Mapping[str, Any], p: Progress) -> dict[str, Any]:
            return {"by": "node"}

        async def node() -> RequestServer:
            with psycopg.connect(dsn, autocommit=True) as db:
                assert take_lease(SITE, "a1.beef-0", 3).run(db) is not None
            server = RequestServer(dsn, {"promote": promote}, take_over_after=30)
            starting = asyncio.create_task(server.start(wait_log_seconds=1))
            while not starting.done():  # renewing, as a node's keeper does
                await asyncio.sleep(0.3)
                with psycopg.connect(dsn, autocommit=True) as db:
                    renew_lease(SITE, "a1.beef-0", 1, 3).run(db)
            await starting
            return server

        lock = hold_site_lock(dsn)  # the CLI will find the lock free only once this goes
        starting = asyncio.create_task(node())
        await asyncio.sleep(0.5)
        lock.close()
        result = await run_command(dsn, "promote", "orders", {}, local, lambda d, t: None)
        server = await starting
        await server.close()
        return result

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == {"by": "node"}
