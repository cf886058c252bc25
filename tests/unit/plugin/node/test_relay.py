"""A relaying node's splice (plugin/node/_relay.py), against in-process
TCP servers: bytes both ways untouched, no leader known means the
connection is closed at once, at most max_connections relayed, and a new
leader cuts what was relayed to the one before."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from bridge import HostPort
from plugin.config import NodeConfig
from plugin.devtools import free_port
from plugin.node._relay import Relay


def node(name: str, amqp: int, max_connections: int = 10) -> NodeConfig:
    return NodeConfig(
        name,
        HostPort("127.0.0.1", amqp),
        HostPort("127.0.0.1", free_port()),
        HostPort("127.0.0.1", free_port()),
        max_connections=max_connections,
    )


async def echo_server() -> tuple[asyncio.Server, int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


async def closed_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    closed = await asyncio.wait_for(reader.read(1), 5) == b""
    writer.close()
    await writer.wait_closed()
    return closed


def test_bytes_go_to_the_leader_and_back_untouched() -> None:
    async def scenario() -> None:
        server, port = await echo_server()
        relay = Relay(node("a2", free_port()))
        relay.leader = node("a1", port)
        await relay.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.me.amqp.port)
        payload = bytes(range(256)) * 4096  # 1 MiB: several reads each way
        writer.write(payload)
        got = await asyncio.wait_for(reader.readexactly(len(payload)), 10)
        assert got == payload and relay.relayed == 1
        writer.close()
        await writer.wait_closed()
        await relay.close()
        server.close()
        await server.wait_closed()

    run(scenario)


def test_no_leader_known_closes_the_connection_at_once() -> None:
    async def scenario() -> None:
        relay = Relay(node("a2", free_port()))
        await relay.start()
        assert await closed_at_once(*await asyncio.open_connection("127.0.0.1", relay.me.amqp.port))
        relay.leader = relay.me  # itself: never relayed to
        assert await closed_at_once(*await asyncio.open_connection("127.0.0.1", relay.me.amqp.port))
        await relay.close()

    run(scenario)


def test_at_most_max_connections_are_relayed_and_a_new_leader_cuts_them() -> None:
    async def scenario() -> None:
        server, port = await echo_server()
        relay = Relay(node("a2", free_port(), max_connections=1))
        relay.leader = node("a1", port)
        await relay.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.me.amqp.port)
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
        second = await asyncio.open_connection("127.0.0.1", relay.me.amqp.port)
        assert await closed_at_once(*second)  # past max_connections
        relay.leader = node("a3", port)  # the leader changed: the old pipe goes
        assert await closed_at_once(reader, writer)
        await relay.close()
        server.close()
        await server.wait_closed()

    run(scenario)
