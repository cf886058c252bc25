"""The site's broker nodes: clients spread over them, a node that refused
one tried last for a while (no servers: the listener runs against a
stand-in broker that takes the connection and records what it got)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from bridge import IdSource
from plugin.listener import BrokerAddress, BrokerNodes, Listener, MemorySink
from plugin.listener._brokers import RETRY_AFTER
from plugin.topology import VpnDirectory

A, B, C = (BrokerAddress("10.0.0.1", 5672), BrokerAddress("10.0.0.2", 5672),
           BrokerAddress("10.0.0.3", 5672))  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_clients_go_round_robin_over_the_nodes() -> None:
    nodes = BrokerNodes([A, B, C])
    assert [nodes.order()[0] for _ in range(4)] == [A, B, C, A]
    assert BrokerNodes(A).order() == [A]


def test_a_node_that_refused_is_tried_last_until_it_rested() -> None:
    clock = Clock()
    nodes = BrokerNodes([A, B, C], clock)
    nodes.failed(A)
    assert nodes.order() == [B, C, A]
    assert nodes.order() == [B, C, A]  # B's turn, A still resting
    clock.now += RETRY_AFTER
    assert nodes.order() == [C, A, B]
    nodes.failed(B)
    nodes.connected(B)  # a later client got through: no longer last
    assert nodes.order() == [A, B, C]


def test_mixed_or_no_nodes_are_refused() -> None:
    with pytest.raises(ValueError, match="all amqp:// or all amqps://"):
        BrokerNodes([A, BrokerAddress("10.0.0.2", 5671, tls=True)])
    with pytest.raises(ValueError, match="at least one"):
        BrokerNodes([])
    assert str(BrokerAddress.from_url("amqps://u:p@h")) == "h:5671"


def _dead_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_client_whose_first_node_is_down_is_relayed_to_the_next() -> None:
    async def scenario() -> None:
        got: list[bytes] = []

        async def stand_in(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got.append(await reader.readexactly(8))
            writer.close()

        live = await asyncio.start_server(stand_in, "127.0.0.1", 0)
        live_node = BrokerAddress("127.0.0.1", live.sockets[0].getsockname()[1])
        dead_node = BrokerAddress("127.0.0.1", _dead_port())
        listener = Listener([dead_node, live_node], VpnDirectory(), IdSource(7), MemorySink())
        await listener.start("127.0.0.1", 0)
        try:
            for clients in (1, 2):
                _, writer = await asyncio.open_connection("127.0.0.1", listener.port)
                writer.write(b"AMQP\x00\x00\x09\x01")
                await writer.drain()
                for _ in range(500):
                    if len(got) == clients:
                        break
                    await asyncio.sleep(0.01)
                writer.close()
            assert got == [b"AMQP\x00\x00\x09\x01"] * 2
            # the first client tried the dead node first; the second, whose
            # turn it was too, went to the live one first
            assert listener.stats.broker_connect_failures == {str(dead_node): 1}
        finally:
            await listener.close()
            live.close()
            await live.wait_closed()

    asyncio.run(scenario())
