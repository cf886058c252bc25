"""The AMQP listener running in a background event loop, in front of site A.

Tests talk to it with blocking clients from the test thread; the listener's
loop runs in its own thread (uvloop, as in production).
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import quote

import pytest
import uvloop

from bridge import IdSource, Role, TlsConfig, TopicFilter
from plugin.devtools import LocalSite
from plugin.listener import BrokerAddress, Listener, MemorySink, ReplicationSink
from plugin.topology import ReplicationScope, Topology, VpnDirectory, VpnView

T = TypeVar("T")


class ListenerThread:
    """``client_tls``: also serve AMQPS on :attr:`tls_port`; ``broker``
    and ``broker_ssl``: an upstream other than plain AMQP on ``broker_port``."""

    def __init__(
        self,
        broker_port: int,
        sink: ReplicationSink | None = None,
        *,
        client_tls: TlsConfig | None = None,
        broker: BrokerAddress | None = None,
        broker_ssl: ssl.SSLContext | None = None,
    ) -> None:
        self.directory = VpnDirectory()
        self.sink = sink if sink is not None else MemorySink()
        self.loop = uvloop.new_event_loop()
        self.errors: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda loop, ctx: self.errors.append(ctx))
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.listener = Listener(
            broker or BrokerAddress("127.0.0.1", broker_port),
            self.directory,
            IdSource(7),
            self.sink,
            broker_ssl=broker_ssl,
        )
        self.run(self.listener.start("127.0.0.1", 0))
        self.port = self.listener.port
        if client_tls is not None:
            self.run(self.listener.start_tls("127.0.0.1", 0, client_tls))
            self.tls_port = self.listener.tls_port

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def call(self, fn: Callable[[], T]) -> T:
        async def wrapper() -> T:
            return fn()

        return self.run(wrapper())  # type: ignore[no-any-return]

    def url(self, vhost: str = "/", **params: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"amqp://guest:guest@127.0.0.1:{self.port}/{quote(vhost, safe='')}" + (
            f"?{query}" if query else ""
        )

    def stop(self) -> None:
        self.run(self.listener.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


def enable_vpn(
    lt: ListenerThread,
    site: LocalSite,
    vhost: str,
    role: Role = Role.ACTIVE,
    queues: tuple[str, ...] = (),
    topics: tuple[str, ...] = (),
    expose_id: bool = False,
) -> VpnView:
    """Put ``vhost`` into the listener's directory with its current topology."""
    definitions = site.rabbit.api("GET", f"definitions/{quote(vhost, safe='')}")
    view = VpnView(
        name=vhost,
        role=role,
        scope=ReplicationScope(queues, tuple(TopicFilter.parse(t) for t in topics)),
        topology=Topology.from_definitions(vhost, definitions),
        expose_id=expose_id,
    )
    lt.call(lambda: lt.directory.put(view))
    return view


@pytest.fixture
def listener_a(site_a: LocalSite) -> Iterator[ListenerThread]:
    lt = ListenerThread(site_a.rabbit.amqp_port)
    try:
        yield lt
    finally:
        lt.stop()
    assert lt.errors == [], lt.errors
