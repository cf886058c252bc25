"""The admin endpoint (plugin/admin/_endpoint.py, aiohttp) on loopback, with
the node's status and metrics stubbed: its resources, its errors, who may
reach it and what an action starts."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from plugin.admin import AdminCredentials, AdminServer, LagHistory
from tests.support.two_sites import admin_call


def _doc(lag: int, applied: int) -> dict[str, Any]:
    return {
        "site": "a",
        "vpns": [
            {
                "name": "orders",
                "lag_events": lag,
                "lag_seconds": lag / 100,
                "applied_index": applied,
            }
        ],
    }


def _get(
    port: int, path: str, method: str = "GET", host: str | None = None
) -> tuple[int, str, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    if host is not None:
        req.add_header("Host", host)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:  # noqa: S310 - loopback
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


@pytest.mark.parametrize("broken", [False, True])
def test_every_resource_answers_and_errors_say_what_there_is(broken: bool) -> None:
    history = LagHistory()
    history.add(_doc(3, 40), at=1.0)

    async def status() -> dict[str, Any]:
        if broken:
            raise OSError("cannot connect to postgresql://vpnrepl:***@db/vpnrepl")
        return _doc(3, 40)

    async def metrics() -> bytes:
        return b"vpnrepl_store_up 1.0\n"

    async def run() -> list[tuple[int, str, str]]:
        server = AdminServer(status, metrics, lambda vpn: vpn == "orders", history)
        await server.start("127.0.0.1", 0)
        try:
            paths = [
                ("/", "GET"),
                ("/health", "GET"),
                ("/status", "GET"),
                ("/status/history", "GET"),
                ("/metrics", "GET"),
                ("/vpns/orders/active", "GET"),
                ("/vpns/a%2Fb/active", "GET"),
                ("/nope", "GET"),
                ("/status", "POST"),
            ]
            return [
                await asyncio.to_thread(_get, server.port, path, method) for path, method in paths
            ]
        finally:
            await server.close()

    page, health, doc, hist, metrics_, active, other, missing, post = asyncio.run(run())
    assert page[0] == 200 and page[1].startswith("text/html") and "vpn-replication" in page[2]
    assert health == (200, "text/plain; charset=utf-8", "ok\n")
    if broken:
        assert doc[0] == 503 and "status unavailable: see the node's log" in doc[2]
        assert "postgresql" not in doc[2]  # no detail for whoever reaches the port
    else:
        assert doc[0] == 200 and json.loads(doc[2]) == _doc(3, 40)
    assert json.loads(hist[2])["vpns"]["orders"] == [[1.0, 3, 0.03, 40]]
    assert metrics_[0] == 200 and metrics_[1].startswith("text/plain; version=0.0.4")
    assert active[:1] == (200,) and "orders: active here" in active[2]
    assert other[0] == 503 and "a/b: not active here" in other[2]
    assert missing[0] == 404 and "/status/history" in missing[2]
    assert post[0] == 405 and "POST is not served here" in post[2]


def test_without_credentials_only_requests_addressed_to_loopback_are_served() -> None:
    """A web page that rebinds its own name to 127.0.0.1 (DNS rebinding)
    reaches a credential-less loopback endpoint as its own origin: its
    requests carry its name as ``Host``, and get 421 (the load balancers'
    paths stay open)."""

    async def status() -> dict[str, Any]:
        return _doc(0, 1)

    async def metrics() -> bytes:
        return b""

    started: list[str] = []

    async def start(command: str, vpn: str, args: Any) -> int:
        started.append(command)
        return 1

    async def run() -> list[int]:
        server = AdminServer(status, metrics, lambda vpn: True, LagHistory(), start_request=start)
        await server.start("127.0.0.1", 0)
        try:
            asked = [
                ("/status", "GET", "evil.example:8080"),
                ("/vpns/orders/promote", "POST", "evil.example"),
                ("/health", "GET", "evil.example"),
                ("/status", "GET", "localhost:8080"),
                ("/status", "GET", "127.0.0.2"),
                ("/status", "GET", "[::1]:9000"),
            ]
            return [
                (await asyncio.to_thread(_get, server.port, path, method, host))[0]
                for path, method, host in asked
            ]
        finally:
            await server.close()

    assert asyncio.run(run()) == [421, 421, 200, 200, 200, 200]
    assert started == []


def test_a_taken_port_is_a_clear_error() -> None:
    async def run() -> str:
        async def status() -> dict[str, Any]:
            return {}

        async def metrics() -> bytes:
            return b""

        first = AdminServer(status, metrics, lambda _: False, LagHistory())
        await first.start("127.0.0.1", 0)
        second = AdminServer(status, metrics, lambda _: False, LagHistory())
        try:
            await second.start("127.0.0.1", first.port)
        except OSError as e:
            return str(e)
        finally:
            await first.close()
        return "started twice"

    assert "cannot listen for admin HTTP on 127.0.0.1:" in asyncio.run(run())


def test_with_credentials_only_the_load_balancers_paths_are_open_and_actions_start_requests() -> (
    None
):
    started: list[tuple[str, str, dict[str, Any]]] = []

    async def start(command: str, vpn: str, args: Any) -> int:
        started.append((command, vpn, dict(args)))
        return 41 + len(started)

    async def read(request: int) -> dict[str, Any] | None:
        return {"id": request, "state": "done"} if request == 42 else None

    async def status() -> dict[str, Any]:
        return _doc(0, 1)

    async def metrics() -> bytes:
        return b""

    creds = AdminCredentials("ops", "s3cret-pw", "t" * 24)
    basic = "Basic " + base64.b64encode(b"ops:s3cret-pw").decode()
    wrong = "Basic " + base64.b64encode(b"ops:guess").decode()
    bearer = "Bearer " + "t" * 24

    async def run() -> dict[str, tuple[int, str]]:
        server = AdminServer(
            status, metrics, lambda vpn: vpn == "orders", LagHistory(), creds, start, read
        )
        await server.start("127.0.0.1", 0)
        port = server.port
        calls = {
            "health": ("/health", "GET", None, None),
            "active": ("/vpns/orders/active", "GET", None, None),
            "status anonymous": ("/status", "GET", None, None),
            "status wrong": ("/status", "GET", wrong, None),
            "status basic": ("/status", "GET", basic, None),
            "metrics bearer": ("/metrics", "GET", bearer, None),
            "promote anonymous": ("/vpns/orders/promote", "POST", None, None),
            "promote": ("/vpns/orders/promote", "POST", basic, b'{"force": true}'),
            "demote": ("/vpns/orders/demote", "POST", bearer, None),
            "switchover anonymous": ("/vpns/orders/switchover", "POST", None, b"{}"),
            "switchover": ("/vpns/orders/switchover", "POST", basic, b"{}"),
            "form": ("/vpns/orders/demote", "POST", bearer, b"a=1", "text/plain"),
            "bad body": ("/vpns/orders/promote", "POST", basic, b'{"now": 1}'),
            "request": ("/requests/42", "GET", basic, None),
            "no request": ("/requests/7", "GET", basic, None),
        }
        try:
            return {
                name: await asyncio.to_thread(admin_call, port, *call)
                for name, call in calls.items()
            }
        finally:
            await server.close()

    got = asyncio.run(run())
    assert got["health"][0] == 200 and got["active"][0] == 200
    assert got["status anonymous"][0] == got["status wrong"][0] == 401
    assert got["status basic"][0] == 200 and got["metrics bearer"][0] == 200
    assert got["promote anonymous"][0] == got["switchover anonymous"][0] == 401
    assert got["promote"] == (202, '{"request": 42, "href": "/requests/42"}')
    assert got["demote"][0] == 202 and got["bad body"][0] == 400
    assert got["form"][0] == 415  # what a web page could send from the operator's browser
    assert json.loads(got["request"][1]) == {"id": 42, "state": "done"}
    assert got["no request"][0] == 404
    assert started == [
        ("promote", "orders", {"via": "http", "user": "ops", "force": True}),
        ("demote", "orders", {"via": "http", "user": "token", "export": True}),
        ("switchover", "orders", {"via": "http", "user": "ops"}),
    ]
