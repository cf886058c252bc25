"""The admin endpoint (aiohttp): its resources, its errors, and the lag
history behind the status page's chart."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from plugin._admin import AdminServer
from plugin._lag_history import LagHistory


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


def test_the_history_keeps_the_window_and_drops_disabled_vpns() -> None:
    h = LagHistory(window=10, every=2)
    for i in range(8):
        h.add(_doc(i, 100 + i), at=1000.0 + 2 * i)
    samples = h.as_json()["vpns"]["orders"]
    assert len(samples) == 5  # 10 s of samples every 2 s
    assert samples[-1] == [1014.0, 7, 0.07, 107]
    h.add({"site": "a", "vpns": []})
    assert h.as_json()["vpns"] == {}


def _get(port: int, path: str, method: str = "GET") -> tuple[int, str, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
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
    assert post[0] == 405 and "only GET" in post[2]


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
