"""The site's RabbitMQ nodes as the listener sees them: each client's
upstream goes to the next node in turn, and a node that just refused a
connection is tried last until it has been left alone for
:data:`RETRY_AFTER` seconds, so a dead cluster member costs new clients
no connect timeout while the others are up."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["RETRY_AFTER", "BrokerAddress", "BrokerNodes"]

#: seconds a node that refused a connection is tried after the others
RETRY_AFTER = 5.0


@dataclass(frozen=True, slots=True)
class BrokerAddress:
    """Where one of the site's RabbitMQ nodes accepts AMQP (an item of
    ``broker.amqp_url``)."""

    host: str
    port: int
    tls: bool = False

    @classmethod
    def from_url(cls, url: str) -> BrokerAddress:
        parts = urlsplit(url)
        tls = parts.scheme == "amqps"
        return cls(parts.hostname or "127.0.0.1", parts.port or (5671 if tls else 5672), tls)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class BrokerNodes:
    """The order to try the site's broker nodes in, for one new client:
    round robin over them, the ones that failed lately last."""

    def __init__(
        self,
        nodes: BrokerAddress | Sequence[BrokerAddress],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nodes = (nodes,) if isinstance(nodes, BrokerAddress) else tuple(nodes)
        if not self.nodes:
            raise ValueError("a site has at least one broker node")
        if len({n.tls for n in self.nodes}) > 1:
            raise ValueError("the broker nodes are all amqp:// or all amqps://")
        self._clock = clock
        self._next = 0
        self._failed_at: dict[BrokerAddress, float] = {}

    @property
    def tls(self) -> bool:
        return self.nodes[0].tls

    def order(self) -> list[BrokerAddress]:
        """The nodes to try, in order, for the next client connection."""
        n = len(self.nodes)
        turn = [self.nodes[(self._next + i) % n] for i in range(n)]
        self._next = (self._next + 1) % n
        now = self._clock()
        fresh = [a for a in turn if now - self._failed_at.get(a, -RETRY_AFTER) >= RETRY_AFTER]
        return fresh + [a for a in turn if a not in fresh]

    def failed(self, node: BrokerAddress) -> None:
        self._failed_at[node] = self._clock()

    def connected(self, node: BrokerAddress) -> None:
        self._failed_at.pop(node, None)
