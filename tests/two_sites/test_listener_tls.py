"""AMQPS: clients over TLS to the listener, client certificates, the
listener over TLS to the broker, and a node serving AMQPS."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pika
import pytest
import uvloop
from pika.exceptions import AMQPConnectionError, ProbableAuthenticationError

from bridge import Consumed, IdSource, Published, Role, TlsConfig
from bridge.link import TlsServer, TlsSetupError
from plugin import ConfigError, load_config
from plugin.devtools import LocalSite, LocalSites, RabbitNode, free_port
from plugin.listener import BrokerAddress, Listener, MemorySink
from plugin.tls import broker_context, site_broker_ssl
from plugin.topology import ReplicationScope, Topology, VpnDirectory, VpnView
from tests.fix_cli import Vpnrepl
from tests.fix_listener import ListenerThread, enable_vpn
from tests.fix_node import NodeProcess
from tests.fix_tls import Pki
from tests.support.two_sites import (
    IN_SCOPE,
    SCOPE,
    VPN,
    caught_up,
    enable,
    setup_vpn,
    until,
    vpn_status,
)

PERSISTENT = pika.BasicProperties(delivery_mode=2)
REFUSED = "refused client"


def _context(pki: Pki, cert: str | None) -> ssl.SSLContext:
    """A client's context: trusts the test CA, presents ``cert`` if given."""
    ctx = ssl.create_default_context(cafile=str(pki.dir / "ca.crt"))
    if cert is not None:
        ctx.load_cert_chain(pki.dir / f"{cert}.crt", pki.dir / f"{cert}.key")
    return ctx


def _tls_client(port: int, pki: Pki, cert: str | None, vhost: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            "127.0.0.1",
            port,
            vhost,
            pika.PlainCredentials("guest", "guest"),
            ssl_options=pika.SSLOptions(_context(pki, cert)),
            connection_attempts=1,
            socket_timeout=10,
            stack_timeout=20,
        )
    )


def _refusals(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if REFUSED in r.getMessage()]


def _wait(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)
    return found


def _publish_and_take(conn: pika.BlockingConnection, published: int, taken: int) -> None:
    """Publish with confirms to ``events`` (order.created: orders.q1, orders.q2,
    audit), then take ``taken`` messages from orders.q1 with acks."""
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(published):
        ch.basic_publish("events", "order.created", f"m{i}".encode(), PERSISTENT)
    for _ in range(taken):
        method, _, _ = ch.basic_get("orders.q1")
        assert method is not None
        ch.basic_ack(method.delivery_tag)
    conn.close()


def _stop(lt: ListenerThread) -> None:
    lt.stop()
    assert lt.errors == [], lt.errors


@pytest.fixture
def tls_listener(site_a: LocalSite, pki: Pki) -> Iterator[ListenerThread]:
    """Site A's listener, also on AMQPS with site a's certificate; no client
    certificates asked for."""
    lt = ListenerThread(site_a.rabbit.amqp_port, client_tls=pki.tls("a", ca=None))
    try:
        yield lt
    finally:
        _stop(lt)


@pytest.fixture
def mtls_listener(site_a: LocalSite, pki: Pki) -> Iterator[ListenerThread]:
    """Site A's listener on AMQPS requiring a client certificate signed by ``ca``."""
    lt = ListenerThread(site_a.rabbit.amqp_port, client_tls=pki.tls("a", ca="ca"))
    try:
        yield lt
    finally:
        _stop(lt)


def test_tls_client_publishes_and_consumes_through_the_listener(
    site_a: LocalSite, tls_listener: ListenerThread, pki: Pki
) -> None:
    setup_vpn(site_a)
    enable_vpn(tls_listener, site_a, VPN, queues=(SCOPE,))
    conn = _tls_client(tls_listener.tls_port, pki, None, VPN)
    assert conn.is_open
    _publish_and_take(conn, 20, 5)

    events = list(tls_listener.sink.events)
    published = [e for e in events if isinstance(e, Published)]
    assert len(published) == 20  # one per persistent publish
    assert {q for e in published for q in e.queues} == set(IN_SCOPE)
    assert len([e for e in events if isinstance(e, Consumed)]) == 5
    # the plain port still serves plain clients, through the same listener
    plain = pika.BlockingConnection(pika.URLParameters(tls_listener.url(VPN)))
    assert plain.channel().queue_declare("orders.q1", passive=True).method.message_count == 15
    plain.close()


def test_plain_client_on_the_tls_port_is_refused_and_logged(
    site_a: LocalSite, tls_listener: ListenerThread, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.create_connection(("127.0.0.1", tls_listener.tls_port)) as sock:
        port = sock.getsockname()[1]
        sock.sendall(b"AMQP\x00\x00\x09\x01")
        sock.settimeout(10)
        while sock.recv(4096):  # at most a TLS alert, then the close
            pass
    [record] = _wait(lambda: _refusals(caplog), "the refusal to be logged")
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert f"{REFUSED} 127.0.0.1:{port}" in record.getMessage()
    assert "not TLS" in record.getMessage()
    assert tls_listener.listener.stats.connections_total == 0


def test_client_certificates_are_required_when_ca_is_set(
    site_a: LocalSite,
    mtls_listener: ListenerThread,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
) -> None:
    setup_vpn(site_a)
    enable_vpn(mtls_listener, site_a, VPN, queues=(SCOPE,))
    conn = _tls_client(mtls_listener.tls_port, pki, "client", VPN)
    _publish_and_take(conn, 3, 0)
    assert len([e for e in mtls_listener.sink.events if isinstance(e, Published)]) == 3
    assert _refusals(caplog) == []

    with pytest.raises(AMQPConnectionError):
        _tls_client(mtls_listener.tls_port, pki, None, VPN)
    [no_cert] = _wait(lambda: _refusals(caplog), "the first refusal to be logged")
    assert "did not return a certificate" in no_cert.getMessage()

    with pytest.raises(AMQPConnectionError):
        _tls_client(mtls_listener.tls_port, pki, "rogue", VPN)
    _, rogue = _wait(lambda: _refusals(caplog)[1:] and _refusals(caplog), "the second refusal")
    assert "certificate verify failed" in rogue.getMessage()
    assert f"not signed by {pki.dir / 'ca.crt'}" in rogue.getMessage()

    for record in (no_cert, rogue):
        assert record.levelno == logging.WARNING and record.exc_info is None
        assert f"{REFUSED} 127.0.0.1:" in record.getMessage()
    # refused clients never reached the relay, nor the broker
    assert mtls_listener.listener.stats.connections_total == 1
    assert len([e for e in mtls_listener.sink.events if isinstance(e, Published)]) == 3


def test_listener_close_releases_tls_connections_in_every_state(
    site_a: LocalSite, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """Closing drops a handshake in progress and an established TLS client
    that never answers, and releases both sockets before it returns (the
    loop is closed right after: an unreleased one is a ResourceWarning,
    an error here)."""
    lt = ListenerThread(site_a.rabbit.amqp_port, client_tls=pki.tls("a", ca=None))
    try:
        idle = _context(pki, None).wrap_socket(
            socket.create_connection(("127.0.0.1", lt.tls_port)), server_hostname="127.0.0.1"
        )
        _wait(lambda: lt.listener.stats.connections_open == 1, "the TLS client to be served")
        silent = socket.create_connection(("127.0.0.1", lt.tls_port))  # sends no ClientHello
        tls_server = lt.listener._tls_server
        assert tls_server is not None
        _wait(lambda: lt.call(lambda: len(tls_server._tasks)) == 1, "the handshake to start")
    finally:
        _stop(lt)
    for sock in (idle, silent):
        with sock:
            sock.settimeout(10)
            while sock.recv(4096):  # the listener's goodbye, if any, then the close
                pass
    assert _refusals(caplog) == []  # stopping is not refusing


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


def _handshake_refused(port: int, ctx: ssl.SSLContext | None) -> None:
    """Connect (over TLS with ``ctx``, else plain TCP), send an AMQP protocol
    header and expect the server to end the connection without an answer."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock = raw if ctx is None else ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    with sock, pytest.raises((ssl.SSLError, ConnectionError)):  # noqa: PT012 - either step
        sock.sendall(b"AMQP\x00\x00\x09\x01")
        while sock.recv(64):  # at most a TLS alert, then the close
            pass
        raise ConnectionResetError("closed")


async def _logged(caplog: pytest.LogCaptureFixture, refusals: int) -> None:
    while len(_refusals(caplog)) < refusals:  # noqa: ASYNC110 - a log has no event
        await asyncio.sleep(0.01)


def _ping_over_tls(pki: Pki, port: int) -> None:
    """A client with a certificate of the CA gets its ping echoed."""
    tls = _context(pki, "client").wrap_socket(
        socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname="127.0.0.1"
    )
    with tls:
        tls.sendall(b"ping")
        assert tls.recv(4) == b"ping"


@pytest.mark.parametrize(
    "new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_tls_server_serves_and_refuses_alike_on_either_loop(
    new_loop: Callable[[], asyncio.AbstractEventLoop], pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """The node runs on uvloop, or on asyncio's loop when the bridge uses
    TLS: both must serve, refuse with one warning and close cleanly."""
    loop = new_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, ctx: errors.append(ctx))

    async def scenario() -> None:
        server = TlsServer("test server", pki.tls("a", ca="ca"), _Echo)
        await server.start("127.0.0.1", 0)

        def clients() -> None:
            _ping_over_tls(pki, server.port)
            _handshake_refused(server.port, _context(pki, None))
            _handshake_refused(server.port, _context(pki, "rogue"))
            _handshake_refused(server.port, None)

        await asyncio.to_thread(clients)
        # the refusals are logged a loop turn after the client sees the close
        await asyncio.wait_for(_logged(caplog, 3), 10)
        server.close()
        await server.wait_closed()

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
    messages = [r.getMessage() for r in _refusals(caplog)]
    for reason in ("did not return a certificate", "certificate verify failed", "not TLS"):
        assert sum(reason in m for m in messages) == 1, messages
    assert errors == []


@pytest.mark.parametrize(
    "new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_a_server_moving_to_tls_serves_plain_and_tls_clients_on_one_port(
    new_loop: Callable[[], asyncio.AbstractEventLoop], pki: Pki
) -> None:
    """``plaintext_too`` (the bridge while a pair moves to TLS): the first
    octet, peeked before a transport reads, picks TLS or plain TCP, on
    either loop, whichever way round the client writes first; configured
    TLS-only afterwards, a plain client is refused."""
    loop = new_loop()

    async def scenario() -> None:
        server = TlsServer("test server", pki.tls("a", ca="ca"), _Echo, plaintext_too=True)
        await server.start("127.0.0.1", 0)

        def clients(plain_ok: bool) -> None:
            for _ in range(5):
                _ping_over_tls(pki, server.port)
                with socket.create_connection(("127.0.0.1", server.port), timeout=10) as plain:
                    plain.sendall(b"\xbdAMQP")
                    got = plain.recv(5)
                    assert got == (b"\xbdAMQP" if plain_ok else b""), got

        await asyncio.to_thread(clients, True)
        server.configure(pki.tls("a", ca="ca"), plaintext_too=False)
        await asyncio.to_thread(clients, False)
        server.close()
        await server.wait_closed()

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()


def test_connections_in_their_handshake_are_capped(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """A stranger that opens connections and says nothing holds at most
    ``max_pending`` of them (each until the handshake deadline)."""

    async def scenario() -> None:
        server = TlsServer("test server", pki.tls("a", ca="ca"), _Echo, max_pending=2)
        await server.start("127.0.0.1", 0)

        def clients() -> None:
            silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
            with socket.create_connection(("127.0.0.1", server.port), timeout=3) as over:
                assert over.recv(1) == b""  # closed at once, not at the deadline
            for sock in silent:
                sock.close()

        await asyncio.to_thread(clients)
        server.close()
        await server.wait_closed()

    asyncio.run(scenario())
    assert any("2 connections are in their handshake already" in r.message for r in caplog.records)


def test_unusable_tls_files_are_named(pki: Pki, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(TlsSetupError, match=f"TLS certificate {garbage}"):
        TlsServer("test server", TlsConfig(garbage, pki.dir / "a.key", None), _Echo)
    listener = Listener(BrokerAddress("127.0.0.1", 1), VpnDirectory(), IdSource(7), MemorySink())
    bad_ca = TlsConfig(pki.dir / "a.crt", pki.dir / "a.key", garbage)
    with pytest.raises(TlsSetupError, match=f"TLS CA {garbage}"):
        asyncio.run(listener.start_tls("127.0.0.1", 0, bad_ca))

    # broker.ca is read when the node starts: an unusable one is a config error
    config = tmp_path / "site.toml"
    config.write_text(
        '[site]\nname = "a"\n[broker]\namqp_url = "amqps://mq.example/"\n'
        'management_url = "https://mq.example/"\nca = "garbage.pem"\n'
        '[listen]\namqp = "127.0.0.1:5673"\nbridge = "127.0.0.1:5680"\n'
        '[store]\ndsn = "postgresql://db.example/vpnrepl"\n'
        "[insecure]\nplaintext_bridge = true\n"
    )
    with pytest.raises(ConfigError) as info:
        site_broker_ssl(load_config(str(config)))
    assert info.value.key == "broker.ca"
    assert "not a usable CA file" in info.value.problem


# ---------------------------------------------------------------- upstream over TLS


@pytest.fixture(scope="module")
def tls_broker(sites: LocalSites, pki: Pki) -> Iterator[RabbitNode]:
    """A third RabbitMQ node, also accepting AMQPS with site a's certificate
    (signed by the test CA, for 127.0.0.1 and localhost). It lives in the
    harness's directory, so an orphan is swept like the sites' nodes."""
    node = RabbitNode(f"vpnrepl-amqps-{os.getpid()}", sites.base / "amqps" / "rabbit", pki.tls("a"))
    node.start()
    try:
        yield node
    finally:
        node.kill()


def _orders_on(node: RabbitNode) -> VpnView:
    """The ``orders`` topology of two_sites on ``node``, as a VPN view."""
    node.add_vhost(VPN)
    conn = pika.BlockingConnection(pika.URLParameters(node.amqp_url(VPN)))
    ch = conn.channel()
    ch.exchange_declare("events", "topic", durable=True)
    for q, key in (("orders.q1", "order.*"), ("orders.q2", "order.#"), ("audit", "#")):
        ch.queue_declare(q, durable=True)
        ch.queue_purge(q)
        ch.queue_bind(q, "events", key)
    conn.close()
    definitions = node.api("GET", f"definitions/{quote(VPN, safe='')}")
    return VpnView(
        VPN,
        Role.ACTIVE,
        ReplicationScope((SCOPE,), ()),
        Topology.from_definitions(VPN, definitions),
    )


def test_listener_relays_to_an_amqps_broker_verified_against_broker_ca(
    tls_broker: RabbitNode, pki: Pki
) -> None:
    assert tls_broker.amqps_port is not None
    view = _orders_on(tls_broker)
    lt = ListenerThread(
        0,
        client_tls=pki.tls("b", ca=None),
        broker=BrokerAddress("127.0.0.1", tls_broker.amqps_port, tls=True),
        broker_ssl=broker_context(pki.dir / "ca.crt"),
    )
    try:
        lt.call(lambda: lt.directory.put(view))
        _publish_and_take(_tls_client(lt.tls_port, pki, None, VPN), 10, 4)
        published = [e for e in lt.sink.events if isinstance(e, Published)]
        assert len(published) == 10
        assert len([e for e in lt.sink.events if isinstance(e, Consumed)]) == 4
    finally:
        _stop(lt)


def test_stopping_right_after_a_client_left_waits_for_its_tls_upstream(
    tls_broker: RabbitNode, pki: Pki
) -> None:
    """The upstream's TLS close (close_notify both ways) ends some loop turns
    after the client's own close: the listener's close() must wait for it,
    or the loop is closed with a live transport (uvloop: EBUSY, or a hang).
    A race, so run it a few times."""
    assert tls_broker.amqps_port is not None
    broker = BrokerAddress("127.0.0.1", tls_broker.amqps_port, tls=True)
    for _ in range(10):
        lt = ListenerThread(0, broker=broker, broker_ssl=broker_context(pki.dir / "ca.crt"))
        try:
            pika.BlockingConnection(pika.URLParameters(lt.url())).close()
        finally:
            _stop(lt)


def test_broker_certificate_not_trusted_refuses_clients_with_the_reason(
    tls_broker: RabbitNode,
) -> None:
    assert tls_broker.amqps_port is not None
    # the system's trusted CAs (the default) do not include the test CA
    lt = ListenerThread(0, broker=BrokerAddress("127.0.0.1", tls_broker.amqps_port, tls=True))
    try:
        with pytest.raises(ProbableAuthenticationError, match="certificate verify failed"):
            pika.BlockingConnection(pika.URLParameters(lt.url("/", socket_timeout="10")))
    finally:
        _stop(lt)


# ---------------------------------------------------------------- the node


def _with_amqps(config: str, port: int, pki: Pki) -> str:
    """``config`` with ``listen.amqps`` on ``port`` and client certificates
    signed by the test CA required."""
    listen = config.replace("[store]", f'amqps = "127.0.0.1:{port}"\n\n[store]', 1)
    client_tls = (
        f'\n[client_tls]\ncert = "{pki.dir / "a.crt"}"\nkey = "{pki.dir / "a.key"}"\n'
        f'ca = "{pki.dir / "ca.crt"}"\n'
    )
    return listen + client_tls


def test_node_serves_amqps_clients_and_their_publishes_are_replicated(
    site_a: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
    pki: Pki,
) -> None:
    setup_vpn(site_a)
    enable(vpnrepl_a)
    port = free_port()
    vpnrepl_a.config.write_text(_with_amqps(vpnrepl_a.config.read_text(), port, pki))
    node_a.start()
    node_b.start()
    assert f"AMQPS on 127.0.0.1:{port} (client certificates required)" in node_a.log_text()

    _publish_and_take(_tls_client(port, pki, "client", VPN), 100, 30)
    caught_up(node_a, node_b)
    a, b = vpn_status(node_a), vpn_status(node_b)
    assert a["ledger_index"] == b["applied_index"] == 130  # 100 published, 30 consumed
    assert b["queues"] == {"orders.q1": 70, "orders.q2": 100}
    until(lambda: vpn_status(node_a)["queues"] == b["queues"], "A's own counts")

    with pytest.raises(AMQPConnectionError):
        _tls_client(port, pki, "rogue", VPN)
    until(lambda: REFUSED in node_a.log_text(), "the node to log the refusal", 30)
    assert "certificate verify failed" in node_a.log_text()
    assert node_a.stop() == 0


def test_node_reaches_an_amqps_broker_with_broker_ca(
    tls_broker: RabbitNode,
    site_a: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    pki: Pki,
) -> None:
    """Everything the node says over AMQP to its broker goes over TLS,
    verified against ``broker.ca``: the listener's upstreams, and the
    commit-marker queue the coordinator declares at a VPN's first local
    transaction (a transaction is refused when it cannot)."""
    _orders_on(tls_broker)
    text = vpnrepl_a.config.read_text()
    text = text.replace(site_a.rabbit.amqp_url(), tls_broker.amqps_url())
    text = text.replace(site_a.rabbit.management_url, tls_broker.management_url)
    text = text.replace("[listen]", f'ca = "{pki.dir / "ca.crt"}"\n\n[listen]', 1)
    port = free_port()
    vpnrepl_a.config.write_text(_with_amqps(text, port, pki))
    enable(vpnrepl_a)
    node_a.start()

    conn = _tls_client(port, pki, "client", VPN)
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(10):
        ch.basic_publish("events", "order.created", f"m{i}".encode(), PERSISTENT)
    txn = conn.channel()
    txn.tx_select()
    for i in range(5):
        txn.basic_publish("events", "order.created", f"t{i}".encode(), PERSISTENT)
    txn.tx_commit()  # after the coordinator declared the marker queue over TLS
    conn.close()
    until(lambda: vpn_status(node_a)["ledger_index"] == 15, "the ledger to hold the publishes")
    expected = {"orders.q1": 15, "orders.q2": 15}
    until(lambda: vpn_status(node_a)["queues"] == expected, "the active's queue counts")
    assert node_a.stop() == 0
