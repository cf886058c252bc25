"""The AMQP endpoint a client-compatibility test talks to.

A scenario in ``tests/interop/test_clients.py`` takes the ``amqp_endpoint`` fixture and
never asks what is behind it, so the same scenario runs against every kind of
endpoint listed in ``ENDPOINT_KINDS``:

``direct``
    Site A's RabbitMQ itself. It defines the behaviour clients rely on; every
    other kind must be indistinguishable from it.

Every kind hands the test a fresh vhost ``orders`` (site A's broker is reset
before each test by ``site_a``), reached as guest/guest.

Adding the listener later takes a few lines:

1. write ``_listener(request, site)`` that starts (or fetches, e.g. with
   ``request.getfixturevalue("vpnrepl_node_a")``) site A's ``vpnrepl node``
   with ``orders`` enabled and returns
   ``Endpoint("127.0.0.1", site.amqp_port, VHOST, "listener")``;
2. add ``"listener": _listener`` to ``_MAKERS``;
3. append ``"listener"`` to ``ENDPOINT_KINDS``.

Each scenario is then collected twice, as ``test_x[direct]`` and
``test_x[listener]``, and a failure in only the second is a listener bug.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote

import pytest

from plugin.devtools import LocalSite

VHOST = "orders"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where an AMQP 0-9-1 client connects: host, port and vhost (as guest/guest)."""

    host: str
    port: int
    vhost: str
    kind: str

    def url(self) -> str:
        """``amqp://guest:guest@host:port/vhost`` with the vhost URL-quoted."""
        return f"amqp://guest:guest@{self.host}:{self.port}/{quote(self.vhost, safe='')}"


def _direct(request: pytest.FixtureRequest, site: LocalSite) -> Endpoint:
    return Endpoint("127.0.0.1", site.rabbit.amqp_port, VHOST, "direct")


def _listener(request: pytest.FixtureRequest, site: LocalSite) -> Endpoint:
    from tests.fix_listener import enable_vpn

    lt = request.getfixturevalue("listener_a")
    # every scenario's queue is named clients.<test>.<random>: all in scope
    enable_vpn(lt, site, VHOST, queues=(r"clients\..*",))
    return Endpoint("127.0.0.1", lt.port, VHOST, "listener")


_MAKERS: dict[str, Callable[[pytest.FixtureRequest, LocalSite], Endpoint]] = {
    "direct": _direct,
    "listener": _listener,
}
ENDPOINT_KINDS = ["direct", "listener"]


@pytest.fixture(params=ENDPOINT_KINDS, ids=ENDPOINT_KINDS)
def amqp_endpoint(request: pytest.FixtureRequest, site_a: LocalSite) -> Endpoint:
    """An endpoint of kind ``request.param`` serving a fresh, empty vhost ``orders``."""
    site_a.rabbit.add_vhost(VHOST)
    return _MAKERS[request.param](request, site_a)
