"""A node that does not lead its site relays its listeners to the one that does.

Every node of a site listens on its own addresses (``[nodes.NAME]``) all the
time, so a client's connection string may list them all, as it would a
RabbitMQ cluster's nodes, and a peer's ``[peers.X] bridge`` list the same.
While another node leads, this one splices each connection it accepts, byte
for byte, to the same listener of the leader: AMQP to its AMQP port, AMQPS to
its AMQPS port (the TLS session, and with it the client's certificate, runs
end to end between the client and the leader, which checks it as if the
client had connected there), the bridge to its bridge port (the peer's
mutual TLS likewise). One writer per site stays true without this node
reading a single frame.

Bounds: at most ``max_connections`` relayed at once (more are closed on
accept); each direction holds at most one read (``CHUNK``) in memory and
reads no further until the other side took it; TCP keepalive ends a
connection whose peer vanished within about a minute; a new leader cuts
every connection relayed to the one before. When the leader is unknown
or unreachable, the connection is closed at once: a client moves to the
next address it knows, and the peer's bridge retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable

from bridge import HostPort
from plugin.config import NodeConfig

__all__ = ["Relay"]

log = logging.getLogger("vpnrepl.node")

#: the most one direction of a relayed connection reads at a time
CHUNK = 256 * 1024
#: how long a relay waits for the leader to accept a connection
CONNECT_SECONDS = 5.0

#: which of a node's listeners: (the node, this node's listen address) -> the leader's
Listen = Callable[[NodeConfig], HostPort | None]


class Relay:
    """This node's listeners, spliced to the leader's while it does not lead."""

    def __init__(self, me: NodeConfig) -> None:
        self.me = me
        self._leader: NodeConfig | None = None
        self._servers: list[asyncio.Server] = []
        self._pipes: set[asyncio.Task[None]] = set()
        self._closed = False
        #: connections relayed since start (status, tests)
        self.relayed = 0

    @property
    def leader(self) -> NodeConfig | None:
        """The node that leads the site now (None: unknown, or no node)."""
        return self._leader

    @leader.setter
    def leader(self, leader: NodeConfig | None) -> None:
        """A new leader: connections relayed to the one before are cut (it
        died or lost its lease; its clients connect again and land here)."""
        if leader != self._leader:
            for task in list(self._pipes):
                task.cancel()
        self._leader = leader

    async def start(self) -> None:
        """Listen on this node's AMQP, AMQPS and bridge addresses."""
        listens: list[tuple[HostPort | None, Listen]] = [
            (self.me.amqp, lambda n: n.reach(n.amqp)),
            (self.me.amqps, lambda n: n.reach(n.amqps) if n.amqps is not None else None),
            (self.me.bridge, lambda n: n.reach(n.bridge)),
        ]
        try:
            for listen, target in listens:
                if listen is None:
                    continue
                server = await asyncio.start_server(
                    self._accepter(target), listen.host, listen.port, reuse_address=True
                )
                self._servers.append(server)
        except OSError as e:
            await self.close()
            raise OSError(e.errno, f"cannot listen on {listen}: {e.strerror}") from e

    def _accepter(
        self, target: Listen
    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], None]:
        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            leader = self._leader
            to = target(leader) if leader is not None and leader.name != self.me.name else None
            if self._closed or to is None or len(self._pipes) >= self.me.max_connections:
                writer.close()
                return
            _keepalive(writer)
            task = asyncio.create_task(self._pipe(reader, writer, to), name="relay")
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

        return accepted

    async def _pipe(
        self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, to: HostPort
    ) -> None:
        leader_w: asyncio.StreamWriter | None = None
        try:
            try:
                async with asyncio.timeout(CONNECT_SECONDS):
                    leader_r, leader_w = await asyncio.open_connection(to.host, to.port)
            except (OSError, TimeoutError) as e:
                log.info("relay to the leader at %s failed: %s", to, e)
                return
            _keepalive(leader_w)
            self.relayed += 1
            async with asyncio.TaskGroup() as both:
                both.create_task(_copy(client_r, leader_w))
                both.create_task(_copy(leader_r, client_w))
        except* (OSError, asyncio.IncompleteReadError):
            pass  # one side went away: both are closed below
        finally:  # cancelled too (a new leader, a stop): nothing stays open
            client_w.close()
            if leader_w is not None:
                leader_w.close()

    async def close(self) -> None:
        """Stop listening and cut every relayed connection (the leader is
        changing: this node leads next, or is stopping)."""
        self._closed = True  # an accept already queued is closed at once
        for server in self._servers:
            server.close()
        for task in list(self._pipes):
            task.cancel()
        for task in list(self._pipes):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for server in self._servers:
            await server.wait_closed()
        self._servers = []


def _keepalive(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive: a peer that vanished (a host gone, a process paused)
    ends its relayed connection within about a minute, not hours."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


async def _copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """``src`` to ``dst`` until ``src`` ends; then half-close ``dst``."""
    while data := await src.read(CHUNK):
        dst.write(data)
        await dst.drain()
    if dst.can_write_eof():
        dst.write_eof()
