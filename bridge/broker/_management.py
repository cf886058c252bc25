"""The RabbitMQ management HTTP API: the one client for every read and write.

The node reads definitions and queue depths through it (the listener's
topology refresher, ``status``); config-sync reads a VPN's definitions and
users on the active and writes them on the standby; promotion re-imports
them. All calls are blocking (urllib, no extra dependency for a handful of
calls a minute): the asyncio callers run them in a thread.

No credential is logged or put in an error: messages show the URL redacted
and name paths, never bodies.
"""

from __future__ import annotations

import base64
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from urllib.parse import quote, unquote, urlsplit

from bridge._errors import BridgeError
from bridge._settings import redact_url

__all__ = ["ManagementAPI", "ManagementUnavailable"]


class ManagementUnavailable(BridgeError):
    """The broker's management API could not be reached, or refused a call;
    ``status`` is the HTTP status when the broker answered one."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def not_found(self) -> bool:
        return self.status == 404


class _Unreachable(Exception):
    """One node gave no HTTP answer (the call may go to the next)."""


def _node(url: str) -> tuple[str, str]:
    """A node's API base URL (no credentials) and its URL for messages."""
    parts = urlsplit(url)
    base = f"{parts.scheme}://{parts.hostname}:{parts.port or 15672}{parts.path.rstrip('/')}"
    return base, redact_url(url)


class ManagementAPI:
    """The management API calls the node and config-sync need (blocking; run
    in a thread). ``keep_users`` are users config-sync must leave alone, as
    it does the user of ``url`` itself (the node's own login).

    ``url`` may be a list: a cluster's nodes, whose API is one (definitions
    and users are cluster-wide). Calls go to the node that answered last; a
    node that cannot be reached (no HTTP answer) passes the call to the next,
    each node tried once per call. Every call here is safe to repeat (reads,
    PUT, DELETE, a definitions import), which is what a call whose answer
    was lost on the way may be. An HTTP answer is the cluster's and final.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        timeout: float = 10.0,
        keep_users: Iterable[str] = (),
        copy_tags: Iterable[str] = (),
    ) -> None:
        urls = (url,) if isinstance(url, str) else tuple(url)
        if not urls:
            raise ValueError("a management API needs at least one URL")
        self._nodes = [_node(u) for u in urls]
        self._current = 0
        parts = urlsplit(urls[0])
        user, password = parts.username or "guest", parts.password or "guest"
        self._auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self._timeout = timeout
        self.user = unquote(user)
        self.keep_users = frozenset({self.user, *keep_users})
        #: VPNs for which config-sync logged "users left alone" (once per VPN)
        self.kept_noted: set[str] = set()
        #: the user tags config-sync copies (``[configsync] copy_tags``):
        #: every other tag, ``administrator`` first, stays on the active
        self.copy_tags = frozenset(copy_tags)
        #: users config-sync left alone because this site made them itself
        #: (logged once each; their count is a metric)
        self.not_ours: set[str] = set()

    @property
    def _display(self) -> str:
        """The node calls go to now, its URL without the password."""
        return self._nodes[self._current][1]

    def _call(self, method: str, path: str, body: bytes | None = None) -> bytes:
        unreachable: list[str] = []
        for _ in self._nodes:
            try:
                return self._call_node(method, path, body)
            except _Unreachable as e:
                unreachable.append(str(e))
                self._current = (self._current + 1) % len(self._nodes)
        raise ManagementUnavailable("; ".join(unreachable))

    def _call_node(self, method: str, path: str, body: bytes | None) -> bytes:
        base, display = self._nodes[self._current]
        req = urllib.request.Request(  # noqa: S310 - admin-configured URL
            f"{base}/api/{path}", data=body, method=method
        )
        req.add_header("Authorization", self._auth)
        if body is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self._timeout) as resp:  # noqa: S310
                return bytes(resp.read())
        except urllib.error.HTTPError as e:
            reason = ""
            with contextlib.suppress(Exception):
                reason = str(json.loads(e.read()).get("reason", ""))
            detail = f": {reason}" if reason else ""
            raise ManagementUnavailable(
                f"{display}: {method} /api/{path}: HTTP {e.code}{detail}", e.code
            ) from e
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise _Unreachable(f"{display}: {method} /api/{path}: {e}") from e

    # -- reads ----------------------------------------------------------------

    def get(self, path: str) -> object:
        raw = self._call("GET", path)
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ManagementUnavailable(f"{self._display}: GET /api/{path}: {e}") from e

    def definitions(self, vhost: str) -> object:
        return self.get(f"definitions/{quote(vhost, safe='')}")

    def queue_exists(self, vhost: str, queue: str) -> bool:
        """Whether the broker has ``queue`` (exclusive ones included)."""
        return self._exists(f"queues/{quote(vhost, safe='')}/{quote(queue, safe='')}")

    def vhost_exists(self, vhost: str) -> bool:
        return self._exists(f"vhosts/{quote(vhost, safe='')}")

    def _exists(self, path: str) -> bool:
        try:
            self._call("GET", path)
        except ManagementUnavailable as e:
            if e.not_found:
                return False
            raise
        return True

    # -- writes ---------------------------------------------------------------

    def post(self, path: str, body: bytes) -> None:
        self._call("POST", path, body)

    def put(self, path: str, body: bytes) -> None:
        self._call("PUT", path, body)

    def delete(self, path: str) -> None:
        self._call("DELETE", path)

    def import_definitions(self, vhost: str, definitions_json: bytes) -> bool:
        """Create ``vhost`` if needed (granting the API user access to it, as
        ``rabbitmqctl add_vhost`` plus ``set_permissions`` would), then import
        the definitions; returns True when the vhost was created."""
        name = quote(vhost, safe="")
        created = not self.vhost_exists(vhost)
        if created:
            self.put(f"vhosts/{name}", b"{}")
            everything = {"configure": ".*", "write": ".*", "read": ".*"}
            self.put(
                f"permissions/{name}/{quote(self.user, safe='')}", json.dumps(everything).encode()
            )
        self.post(f"definitions/{name}", definitions_json)
        return created
