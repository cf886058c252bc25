"""Operator commands reach the site's node through its database
(plugin/_requests.py), against a real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import psycopg
import pytest

from plugin._errors import PluginError, StateError
from plugin._localsites import LocalSite
from plugin._requests import SITE_LOCK, Progress, RequestServer, run_command
from sql import migrate


@pytest.fixture
def dsn(site_a: LocalSite) -> str:
    dsn = site_a.pg.dsn()
    migrate(dsn)
    return dsn


def lock_free(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (SITE_LOCK,)).fetchone()
        assert row is not None
        if row[0]:
            conn.execute("SELECT pg_advisory_unlock(%s)", (SITE_LOCK,))
        return bool(row[0])


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
