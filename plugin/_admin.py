"""The admin HTTP endpoint on ``listen.admin`` (aiohttp).

* ``/``: the status page (``_static/status.html``), which polls the two
  JSON resources below and draws the lag of the last minutes;
* ``/health``: ``ok`` while the node runs;
* ``/status``: the ``status --json`` document, with broker depths;
* ``/status/history``: per VPN, the lag samples of the last minutes;
* ``/metrics``: Prometheus exposition;
* ``/vpns/VPN/active``: 200 where the VPN is active and admits clients, 503
  elsewhere (for a load balancer's or a DNS health check).

Every resource is read-only and GET (HEAD) only. The endpoint binds to
loopback by default (``127.0.0.1:9480``): it has no authentication, and the
README says how to put it behind a proxy that adds it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web

from ._lag_history import LagHistory
from ._metrics import CONTENT_TYPE

__all__ = ["AdminServer"]

log = logging.getLogger(__name__)

_HINT = "try /, /health, /status, /status/history, /metrics or /vpns/VPN/active\n"


class AdminServer:
    """Serves the status page and its resources."""

    def __init__(
        self,
        status: Callable[[], Awaitable[dict[str, Any]]],
        metrics: Callable[[], Awaitable[bytes]],
        serves: Callable[[str], bool],
        history: LagHistory,
    ) -> None:
        """``status()``: the status document; ``metrics()``: the exposition
        body; ``serves(vpn)``: the VPN is active here and admits clients."""
        self._status = status
        self._metrics = metrics
        self._serves = serves
        self._history = history
        self._page = resources.files(__package__).joinpath("_static/status.html").read_bytes()
        app = web.Application(middlewares=[_plain_errors])
        app.router.add_get("/", self._index)
        app.router.add_get("/health", self._health)
        app.router.add_get("/status", self._status_json)
        app.router.add_get("/status/history", self._history_json)
        app.router.add_get("/metrics", self._metrics_text)
        app.router.add_get("/vpns/{vpn:.+}/active", self._active)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=1.0
        )
        self._site: web.TCPSite | None = None

    async def start(self, host: str, port: int) -> None:
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, host, port)
        try:
            await self._site.start()
        except OSError as e:
            await self._runner.cleanup()
            raise OSError(
                e.errno, f"cannot listen for admin HTTP on {host}:{port}: {e.strerror}"
            ) from e

    @property
    def port(self) -> int:
        sockets = self._runner.addresses
        assert sockets  # noqa: S101 - after start()
        return int(sockets[0][1])

    async def close(self) -> None:
        await self._runner.cleanup()

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(body=self._page, content_type="text/html", charset="utf-8")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _status_json(self, request: web.Request) -> web.Response:
        try:
            doc = await self._status()
        except Exception as e:  # the page must answer, not hang up
            # the detail (hosts, database names) is for the operator's log,
            # not for whoever can reach this port
            log.warning("status failed: %s", e)
            return web.Response(
                status=503, text="status unavailable: see the node's log (its store failed)\n"
            )
        return web.json_response(doc)

    async def _history_json(self, request: web.Request) -> web.Response:
        return web.json_response(self._history.as_json())

    async def _metrics_text(self, request: web.Request) -> web.Response:
        body = await self._metrics()
        response = web.Response(body=body)
        response.headers["Content-Type"] = CONTENT_TYPE
        return response

    async def _active(self, request: web.Request) -> web.Response:
        vpn = request.match_info["vpn"]
        if self._serves(vpn):
            return web.Response(text=f"{vpn}: active here\n")
        return web.Response(status=503, text=f"{vpn}: not active here\n")


@web.middleware
async def _plain_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A 404 names the resources there are; a 405 says only GET is served."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.Response(status=404, text=_HINT)
    except web.HTTPMethodNotAllowed:
        return web.Response(status=405, text="only GET is served\n", headers={"Allow": "GET, HEAD"})
