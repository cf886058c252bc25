"""The admin HTTP endpoint on ``listen.admin``: health, status JSON, metrics,
and which VPNs this site serves (``/vpns/VPN/active``, for a load balancer's or
a DNS health check: 200 where the VPN is active and admits clients, 503
elsewhere).

A deliberately tiny HTTP/1.1 server (GET only, ``Connection: close``) on
asyncio streams: three read-only resources do not justify a web framework,
and the endpoint should bind to loopback (the default ``127.0.0.1:9480``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

__all__ = ["AdminServer"]

log = logging.getLogger(__name__)

_MAX_REQUEST_LINE = 8192


class AdminServer:
    """Serves ``/health``, ``/status`` and ``/metrics``."""

    def __init__(
        self,
        status: Callable[[], Awaitable[dict[str, Any]]],
        metrics: Callable[[], str],
        serves: Callable[[str], bool] | None = None,
    ) -> None:
        """``serves(vpn)``: the VPN is active here and admits clients."""
        self._status = status
        self._metrics = metrics
        self._serves = serves
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, host, port)
        except OSError as e:
            raise OSError(
                e.errno, f"cannot listen for admin HTTP on {host}:{port}: {e.strerror}"
            ) from e

    @property
    def port(self) -> int:
        assert self._server is not None  # noqa: S101 - after start()
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
            while (await asyncio.wait_for(reader.readline(), 10)) not in (b"\r\n", b"\n", b""):
                pass
            status, ctype, body = await self._respond(line[:_MAX_REQUEST_LINE])
        except (TimeoutError, ConnectionError):
            writer.close()
            return
        head = (
            f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode() + body)
        try:
            await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    async def _respond(self, line: bytes) -> tuple[str, str, bytes]:
        parts = line.decode("latin-1").split()
        if len(parts) < 2 or parts[0] != "GET":
            return "405 Method Not Allowed", "text/plain", b"only GET is served\n"
        path = parts[1].split("?", 1)[0]
        if path == "/health":
            return "200 OK", "text/plain", b"ok\n"
        if path == "/status":
            try:
                doc = await self._status()
            except Exception as e:  # the status page must say why, not hang up
                log.warning("status failed: %s", e)
                return "503 Service Unavailable", "text/plain", f"{e}\n".encode()
            return "200 OK", "application/json", json.dumps(doc).encode()
        if path == "/metrics":
            return "200 OK", "text/plain; version=0.0.4", self._metrics().encode()
        if path.startswith("/vpns/") and path.endswith("/active") and self._serves is not None:
            vpn = unquote(path[len("/vpns/") : -len("/active")])
            if vpn and self._serves(vpn):
                return "200 OK", "text/plain", f"{vpn}: active here\n".encode()
            return "503 Service Unavailable", "text/plain", f"{vpn}: not active here\n".encode()
        return (
            "404 Not Found",
            "text/plain",
            b"try /health, /status, /metrics or /vpns/VPN/active\n",
        )
