"""Only the named peer site reaches the bridge (``bridge/wire/_identity.py``):
rogue peers against a real active (its ledger on PostgreSQL) and a real
standby. Each rogue is refused before one byte of replication data leaves,
both ends say why in one line, and a crafted frame from a peer that fails
the rule fences nothing, releases nothing and moves no index.

The active is site a and serves its configured peer b; ``c`` holds a
certificate of the right CA naming an unconfigured site."""

from __future__ import annotations

import asyncio
import logging
import ssl
import struct
import time
from pathlib import Path

import pytest

from bridge import Role, Unauthorised
from bridge.wire import (
    MAGIC,
    PROTOCOL_VERSION,
    Ack,
    Error,
    FrameReader,
    Hello,
    PeerCheck,
    SyncRequest,
    certificate_names,
)
from plugin.devtools import LocalSite
from plugin.tls import init_certificates
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.fix_tls import Pki
from tests.support.two_sites import enable, publish_one, setup_vpn
from tests.two_sites.test_bridge_transport import (
    VPN,
    active,
    applied,
    events,
    feed,
    prepare,
    run,
    scalar,
    standby,
    until,
)

# -- the rule, without I/O ---------------------------------------------------


def test_a_certificate_is_named_by_its_common_name_and_dns_alt_names() -> None:
    cert = {
        "subject": ((("countryName", "EU"),), (("commonName", "b"),)),
        "subjectAltName": (("DNS", "b.example"), ("IP Address", "10.0.0.1")),
    }
    assert certificate_names(cert) == {"b", "b.example"}
    assert certificate_names({}) is None and certificate_names(None) is None


def test_the_named_site_rule() -> None:
    check = PeerCheck.of(["b"])
    assert check.certificate(frozenset({"b"})) is None
    assert check.certificate(None) is None  # plaintext: only the Hello can be checked
    assert "names 'c', no configured peer site ('b')" in str(check.certificate(frozenset({"c"})))
    assert check.hello("b", frozenset({"b"})) is None and check.hello("b", None) is None
    assert "not a configured peer site" in str(check.hello("c", None))
    assert "names site 'b' but its certificate names 'c'" in str(
        PeerCheck.of(["b", "c"]).hello("b", frozenset({"c"}))
    )


# -- real ends ---------------------------------------------------------------


def refusals(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.message for r in caplog.records if text in r.message]


@pytest.mark.parametrize(
    ("standby_site", "cert", "active_says"),
    [
        ("c", "c", "refused standby at 127.0.0.1:"),
        ("c", "b", "its Hello names site 'c', not a configured peer site ('b')"),
    ],
    ids=["a certificate naming an unconfigured site", "a Hello naming another site"],
)
def test_a_rogue_standby_gets_nothing(
    site_a: LocalSite,
    site_b: LocalSite,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    standby_site: str,
    cert: str,
    active_says: str,
) -> None:
    prepare(site_a, orders="active")
    rogue_dsn = prepare(site_b)
    caplog.set_level(logging.INFO, logger="bridge")

    async def scenario() -> None:
        async with active(site_a, tls=pki.tls("a")) as a:
            await feed(a.writer, events(1, 20))
            async with standby(
                site_b, site_a.bridge_port, cls=_client_as(standby_site), tls=pki.tls(cert)
            ) as b:
                await until(
                    lambda: len(refusals(caplog, "bridge to 127.0.0.1:")) >= 2, "two refusals"
                )
                assert b.sessions == 0

    run(scenario)
    assert applied(rogue_dsn) == -1  # no VPN listed, nothing applied
    assert scalar(rogue_dsn, "SELECT count(*) FROM live_message") == 0
    assert scalar(rogue_dsn, "SELECT count(*) FROM vpn_config") == 0
    assert [line for line in refusals(caplog, "refused standby") if active_says in line]
    for line in refusals(caplog, "bridge to 127.0.0.1:")[:2]:
        assert "\n" not in line and "; retrying in" in line


def _client_as(site: str) -> type:
    """A StandbyBridge that calls itself ``site`` (the rogue's own name)."""
    from bridge.standby import StandbyBridge

    class Rogue(StandbyBridge):
        def __init__(self, _site: str, *args: object, **kwargs: object) -> None:
            super().__init__(site, *args, **kwargs)  # type: ignore[arg-type]

    return Rogue


def test_a_standby_refuses_an_impostor_active(
    site_a: LocalSite, site_b: LocalSite, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """An "active" with a certificate of the right CA naming site c: the
    standby says nothing, not even its Hello, and takes nothing."""
    prepare(site_a, orders="active")
    b_dsn = prepare(site_b)
    caplog.set_level(logging.INFO, logger="bridge")

    async def scenario() -> None:
        async with active(site_a, tls=pki.tls("c"), peers=("b",)) as a:
            await feed(a.writer, events(1, 20))
            async with standby(site_b, site_a.bridge_port, tls=pki.tls("b")) as b:
                await until(lambda: len(refusals(caplog, "refused the active at")) >= 2, "refusals")
                assert b.sessions == 0

    run(scenario)
    assert applied(b_dsn) == -1
    line = refusals(caplog, "refused the active at")[0]
    assert "its certificate names 'c'" in line and "no configured peer site ('a')" in line
    # the active never saw a Hello: the standby closed right after the handshake
    assert not [r.message for r in caplog.records if "standby site" in r.message]


async def _raw_rogue(port: int, pki: Pki, cert: str, frames: bytes) -> bytes:
    """A TLS client with ``cert`` that writes ``frames`` and returns every
    byte the active sent until it closed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(pki.dir / "ca.crt")
    ctx.load_cert_chain(pki.dir / f"{cert}.crt", pki.dir / f"{cert}.key")
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    received = b""
    try:
        writer.write(frames)
        await writer.drain()  # raises if the active hung up already
        async with asyncio.timeout(10):
            while chunk := await reader.read(65536):
                received += chunk
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()
    return received


def test_crafted_frames_from_a_peer_that_fails_the_rule_change_nothing(
    site_a: LocalSite, site_b: LocalSite, pki: Pki
) -> None:
    """b's own certificate, but a Hello naming c, followed at once by a sync
    request claiming a higher epoch (which would fence the active) and an
    acknowledgement of everything (which would release sync confirms and
    move the applied index): the active answers with one Error and closes."""
    a_dsn = prepare(site_a, orders="active")
    crafted = b"".join(
        f.encode()
        for f in (
            Hello("c", 6, Role.STANDBY, 1),
            SyncRequest(VPN, 99, 0, 0),
            Ack(VPN, 99, 20),
        )
    )
    received: bytes = b""

    async def scenario() -> None:
        nonlocal received
        async with active(site_a, tls=pki.tls("a")) as a:
            await feed(a.writer, events(1, 20))
            received = await _raw_rogue(site_a.bridge_port, pki, "b", crafted)
            await asyncio.sleep(0.5)  # anything the frames would have done, done

    run(scenario)
    reader = FrameReader()
    reader.feed(received)
    got = []
    while (frame := reader.next_frame()) is not None:
        got.append(frame)
    assert len(got) == 1 and isinstance(got[0], Error), got
    assert isinstance(got[0].exception(), Unauthorised)
    assert "orders" not in got[0].text  # no VPN, no definitions
    assert scalar(a_dsn, "SELECT fenced FROM vpn_state WHERE vpn = %s", VPN) is False
    assert scalar(a_dsn, "SELECT applied_index FROM vpn_state WHERE vpn = %s", VPN) == 0
    assert scalar(a_dsn, "SELECT epoch FROM vpn_config WHERE name = %s", VPN) == 1


def test_a_tls_client_without_a_certificate_gets_no_handshake(
    site_a: LocalSite, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    prepare(site_a, orders="active")
    caplog.set_level(logging.INFO, logger="bridge")

    async def scenario() -> None:
        async with active(site_a, tls=pki.tls("a")):
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.load_verify_locations(pki.dir / "ca.crt")
            reader, writer = await asyncio.open_connection("127.0.0.1", site_a.bridge_port, ssl=ctx)
            writer.write(Hello("b", 6, Role.STANDBY, 1).encode())
            with pytest.raises((ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)):
                async with asyncio.timeout(10):
                    data = await reader.read(65536)
                    if not data:
                        raise ConnectionResetError("closed")
            writer.close()
            await until(lambda: refusals(caplog, "TLS handshake failed"), "the refusal line")

    run(scenario)


# -- real nodes ----------------------------------------------------------------


def test_a_rogue_node_with_a_certificate_of_the_right_ca_gets_nothing(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    tmp_path: Path,
) -> None:
    """A third vpnrepl node, site "c", with a certificate the sites' own CA
    signed, dials the active: refused at the handshake, it adopts no VPN,
    holds no message and no definitions; the active's log names it."""
    assert site_a.pki is not None
    init_certificates(site_a.pki, ["c"])  # the same CA as the sites'
    setup_vpn(site_a)
    enable(vpnrepl_a)
    node_a.start()
    publish_one(site_a, 1)
    text = site_b.config_text(site_a).replace('name = "b"', 'name = "c"', 1)
    text = text.replace(f"{site_a.pki / 'b'}.", f"{site_a.pki / 'c'}.")
    config = tmp_path / "c.toml"
    config.write_text(text)
    assert Vpnrepl(config)("init").returncode == 0
    rogue = NodeProcess(site_b, config, tmp_path / "node-c.log", "c")
    try:
        rogue.start()
        deadline = time.monotonic() + 30
        while rogue.log_text().count("retrying in") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        rogue.kill()
    refusal = "its certificate names 'c', no configured peer site ('b')"
    assert refusal in node_a.log_text(), node_a.log_text()
    assert rogue.log_text().count("retrying in") >= 2, rogue.log_text()
    dsn = site_b.pg.dsn()
    assert scalar(dsn, "SELECT count(*) FROM vpn_config") == 0  # no VPN list
    assert scalar(dsn, "SELECT count(*) FROM live_message") == 0
    assert "orders" not in {v["name"] for v in site_b.rabbit.api("GET", "vhosts")}


# -- bounded before trusted ------------------------------------------------------


def _header(length: int) -> bytes:
    return struct.pack(">BBBBI", MAGIC, PROTOCOL_VERSION, Hello.TYPE, 0, length)


def test_a_stranger_is_bounded_before_its_hello(
    site_a: LocalSite, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """A frame over 64 KiB before the Hello closes the link from its header;
    a connection that says nothing is closed at the handshake deadline; past
    the connection cap a new connection is closed at once."""
    prepare(site_a, orders="active")
    caplog.set_level(logging.INFO, logger="bridge")

    async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
        try:
            async with asyncio.timeout(seconds):
                while await reader.read(65536):
                    pass
        except (ConnectionError, ssl.SSLError):
            pass
        except TimeoutError:
            return False
        return True

    async def scenario() -> None:
        async with active(site_a, handshake_timeout=1.0, max_connections=2):
            port = site_a.bridge_port
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_header(120 * 2**20) + b"x" * 65536)
            assert await closed_within(reader, 5.0)
            silent = await asyncio.open_connection("127.0.0.1", port)
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            over = await asyncio.open_connection("127.0.0.1", port)
            assert await closed_within(over[0], 2.0)  # the cap: closed at once
            assert await closed_within(silent[0], 5.0)  # no Hello within 1 s
            for _, w in (silent, *held, over):
                w.close()
            writer.close()

    run(scenario)
    lines = [r.message for r in caplog.records]
    assert any("exceeds the 65536-byte limit" in m for m in lines), lines
    assert any("no Hello within 1 s" in m for m in lines), lines
    assert any("2 bridge connections are open already" in m for m in lines), lines


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_a_120_mib_pre_hello_frame_costs_the_node_no_memory(
    site_a: LocalSite, vpnrepl_a: Vpnrepl, node_a: NodeProcess
) -> None:
    """With a certificate of a configured peer, a 120 MiB frame before the
    Hello: the node closes the link from the header, and its peak RSS grows
    by less than 10 MiB."""
    assert site_a.pki is not None
    node_a.start()
    assert node_a.pid is not None
    before = _peak_rss_kib(node_a.pid)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(site_a.pki / "ca.crt")
    ctx.load_cert_chain(site_a.pki / "b.crt", site_a.pki / "b.key")

    async def flood() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", site_a.bridge_port, ssl=ctx)
        sent = 0
        chunk = b"\0" * (1 << 20)
        try:
            writer.write(_header(120 * 2**20))
            while sent < 120 * 2**20:
                writer.write(chunk)
                async with asyncio.timeout(10):
                    await writer.drain()
                sent += len(chunk)
        except (ConnectionError, ssl.SSLError, TimeoutError):
            pass
        writer.close()

    asyncio.run(flood())  # (the node discards what comes while it closes: at most 2 s)
    grown = _peak_rss_kib(node_a.pid) - before
    assert grown < 10 * 1024, f"peak RSS grew by {grown} KiB"
    assert "exceeds the 65536-byte limit" in node_a.log_text()
