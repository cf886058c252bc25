"""The admin HTTP endpoint on ``listen.admin`` (aiohttp).

Read-only resources — ``/`` (the status page, ``status.html`` beside this
module, drawing the lag of the last minutes), ``/health``, ``/status``,
``/status/history``, ``/metrics``, ``/vpns/VPN/active`` — and the operator's
requests: ``POST /vpns/VPN/promote|demote|switchover`` (JSON only) start the
request the CLI would, ``/requests/ID`` follows it. ``/health`` and
``/vpns/VPN/active`` are open; with ``[admin]`` credentials every other path
needs basic auth or a bearer token, and without them only requests addressed
to a loopback name are answered (421: DNS rebinding). Each rule and why:
README, "The admin endpoint".
"""

from __future__ import annotations

import base64
import hmac
import ipaddress
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from ._lag_history import LagHistory
from ._metrics import CONTENT_TYPE

__all__ = ["AdminCredentials", "AdminServer"]

log = logging.getLogger(__name__)

_HINT = (
    "try /, /health, /status, /status/history, /metrics, /vpns/VPN/active, "
    "POST /vpns/VPN/promote, /demote or /switchover, /requests/ID\n"
)
#: who an authenticated request came from (the user, or "token")
_WHO: web.RequestKey[str] = web.RequestKey("vpnrepl_who", str)
#: paths a load balancer asks, open whatever the credentials
_OPEN = re.compile(r"^/(health|vpns/.+/active)$")


def _loopback_host(host: str) -> bool:
    """Whether an HTTP ``Host`` names this machine's loopback."""
    name = urlsplit("//" + host).hostname or ""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class AdminCredentials:
    """``[admin]``: a user and password (HTTP basic), a bearer token, or
    both; either is accepted."""

    user: str | None = None
    password: str | None = None
    token: str | None = None

    def admits(self, authorization: str) -> str | None:
        """Who the ``Authorization`` header proves to be (None: nobody)."""
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and self.token is not None:
            if hmac.compare_digest(value.strip().encode(), self.token.encode()):
                return "token"
        if scheme.lower() == "basic" and self.user is not None and self.password is not None:
            try:
                user, _, password = base64.b64decode(value.strip()).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                return None
            expected = f"{self.user}:{self.password}".encode()
            if hmac.compare_digest(f"{user}:{password}".encode(), expected):
                return user
        return None


#: ``(command, vpn, args) -> request id``: an operator request started
Starter = Callable[[str, str, Mapping[str, Any]], Awaitable[int]]
#: ``(id) -> the request's row`` (None: no such request)
Reader = Callable[[int], Awaitable[dict[str, Any] | None]]


class AdminServer:
    """Serves the status page and its resources."""

    def __init__(
        self,
        status: Callable[[], Awaitable[dict[str, Any]]],
        metrics: Callable[[], Awaitable[bytes]],
        serves: Callable[[str], bool],
        history: LagHistory,
        credentials: AdminCredentials | None = None,
        start_request: Starter | None = None,
        read_request: Reader | None = None,
        healthy: Callable[[], bool] | None = None,
    ) -> None:
        """``status()``: the status document; ``metrics()``: the exposition
        body; ``serves(vpn)``: the VPN is active here and admits clients;
        ``start_request`` / ``read_request``: operator requests (none: the
        POST paths answer 503); ``healthy()``: whether ``/health`` says ok
        (none: always, once the endpoint answers)."""
        self._status = status
        self._metrics = metrics
        self._serves = serves
        self._history = history
        self._credentials = credentials
        self._start_request = start_request
        self._read_request = read_request
        self._healthy = healthy
        self._page = resources.files(__package__).joinpath("status.html").read_bytes()
        app = web.Application(middlewares=[_plain_errors, self._authenticated])
        app.router.add_get("/", self._index)
        app.router.add_get("/health", self._health)
        app.router.add_get("/status", self._status_json)
        app.router.add_get("/status/history", self._history_json)
        app.router.add_get("/metrics", self._metrics_text)
        app.router.add_get("/vpns/{vpn:.+}/active", self._active)
        app.router.add_post("/vpns/{vpn:.+}/{command:promote|demote|switchover}", self._act)
        app.router.add_get("/requests/{id:[0-9]+}", self._request)
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
        if self._healthy is not None and not self._healthy():
            return web.Response(status=503, text="no leader known to relay to\n")
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

    @web.middleware
    async def _authenticated(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """With credentials, every path but the load balancers' needs them;
        without (a loopback endpoint), a request must be addressed to a
        loopback name: a web page that rebound its own name to 127.0.0.1
        (DNS rebinding) would otherwise reach the endpoint from an
        operator's browser as its own origin, and could promote."""
        if _OPEN.match(request.path):
            return await handler(request)
        if self._credentials is None:
            if not _loopback_host(request.host):
                return web.Response(
                    status=421,
                    text="an admin endpoint without credentials answers only requests "
                    "addressed to localhost or a loopback address\n",
                )
            return await handler(request)
        who = self._credentials.admits(request.headers.get("Authorization", ""))
        if who is None:
            return web.Response(
                status=401,
                text="authentication required (HTTP basic, or a bearer token)\n",
                headers={"WWW-Authenticate": 'Basic realm="vpnrepl"'},
            )
        request[_WHO] = who
        return await handler(request)

    async def _act(self, request: web.Request) -> web.Response:
        """POST promote, demote or switchover: the operator request, started."""
        if self._start_request is None:
            return web.Response(status=503, text="this node takes no requests yet\n")
        vpn, command = request.match_info["vpn"], request.match_info["command"]
        if request.content_type != "application/json":
            # a page in an operator's browser can send a form or text/plain
            # across origins without asking; application/json it cannot
            return web.Response(status=415, text="send the request as application/json\n")
        body: Any = {}
        if request.can_read_body:
            try:
                body = json.loads(await request.read() or b"{}")
            except ValueError:
                return web.Response(status=400, text="the body is not JSON\n")
        if not isinstance(body, dict) or set(body) - {"force"}:
            return web.Response(status=400, text='the body is {} or {"force": true}\n')
        args: dict[str, Any] = {"via": "http", "user": request.get(_WHO, "")}
        if command == "promote" and body.get("force") is True:
            args["force"] = True
        if command == "demote":
            args["export"] = True  # the node writes the tail before anything is purged
        log.info("admin HTTP: %s %s requested by %r", command, vpn, args["user"] or "anyone")
        request_id = await self._start_request(command, vpn, args)
        return web.json_response(
            {"request": request_id, "href": f"/requests/{request_id}"}, status=202
        )

    async def _request(self, request: web.Request) -> web.Response:
        if self._read_request is None:
            return web.Response(status=503, text="this node takes no requests yet\n")
        found = await self._read_request(int(request.match_info["id"]))
        if found is None:
            return web.Response(status=404, text="no such request\n")
        return web.json_response(found)

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
    except web.HTTPMethodNotAllowed as e:
        allowed = ", ".join(sorted(e.allowed_methods))
        return web.Response(
            status=405, text=f"{request.method} is not served here\n", headers={"Allow": allowed}
        )
