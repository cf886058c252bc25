"""``vpnrepl tls init DIR --sites a,b``: a private CA and a certificate per
site naming it, keys 0600, reused when run again; the bridge's own TLS
contexts accept them (a real handshake on loopback, both ways verified);
``--renew`` and SIGHUP rotate a running node's certificate."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from bridge import TlsConfig
from bridge.link import make_client_context, make_server_context
from plugin.cli import main
from plugin.devtools import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.prometheus import value
from tests.support.two_sites import VPN, setup_vpn, until, vpn_status


def names(cert: x509.Certificate) -> tuple[str, list[str]]:
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return str(cn), list(san.get_values_for_type(x509.DNSName))


def test_a_ca_and_a_certificate_naming_each_site(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tls", "init", str(tmp_path / "pki"), "--sites", "nyc,ldn"]) == 0
    out = capsys.readouterr().out
    pki = tmp_path / "pki"
    assert f'cert = "{pki / "nyc.crt"}"' in out and f'ca = "{pki / "ca.crt"}"' in out
    ca = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    for site in ("nyc", "ldn"):
        cert = x509.load_pem_x509_certificate((pki / f"{site}.crt").read_bytes())
        assert names(cert) == (site, [site])
        cert.verify_directly_issued_by(ca)
        assert stat.S_IMODE((pki / f"{site}.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((pki / "ca.key").stat().st_mode) == 0o600

    # again, with a third site: the CA and the two certificates are kept
    before = (pki / "nyc.crt").read_bytes()
    assert main(["tls", "init", str(pki), "--sites", "nyc,fra"]) == 0
    out = capsys.readouterr().out
    assert "nyc.crt and nyc.key already there, kept" in out and "fra.crt and fra.key made" in out
    assert (pki / "nyc.crt").read_bytes() == before
    fra = x509.load_pem_x509_certificate((pki / "fra.crt").read_bytes())
    fra.verify_directly_issued_by(ca)


@pytest.mark.parametrize(
    ("sites", "message"),
    [("a,a", "names a site twice"), ("a,b c", "site name 'b c'"), (",", "site name ''")],
)
def test_bad_site_names_are_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sites: str, message: str
) -> None:
    assert main(["tls", "init", str(tmp_path), "--sites", sites]) == 2
    assert message in capsys.readouterr().err


def test_a_half_present_pair_is_refused_not_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tls", "init", str(tmp_path), "--sites", "a"]) == 0
    (tmp_path / "a.crt").unlink()
    assert main(["tls", "init", str(tmp_path), "--sites", "a"]) == 2
    assert "has one of a.crt and a.key but not the other" in capsys.readouterr().err
    assert (tmp_path / "a.key").exists()


def test_the_bridge_contexts_complete_a_mutual_handshake_with_them(tmp_path: Path) -> None:
    assert main(["tls", "init", str(tmp_path), "--sites", "a,b"]) == 0

    def tls(site: str) -> TlsConfig:
        return TlsConfig(tmp_path / f"{site}.crt", tmp_path / f"{site}.key", tmp_path / "ca.crt")

    async def scenario() -> tuple[dict, dict]:  # type: ignore[type-arg]
        seen: asyncio.Future[dict] = asyncio.get_running_loop().create_future()  # type: ignore[type-arg]

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.set_result(writer.get_extra_info("peercert"))
            writer.close()

        server = await asyncio.start_server(
            accept, "127.0.0.1", 0, ssl=make_server_context(tls("a"))
        )
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=make_client_context(tls("b"))
        )
        theirs = writer.get_extra_info("peercert")
        mine = await seen
        writer.close()
        server.close()
        await server.wait_closed()
        return mine, theirs

    client_cert, server_cert = asyncio.run(scenario())
    assert ("commonName", "b") in [rdn[0] for rdn in client_cert["subject"]]
    assert ("DNS", "a") in server_cert["subjectAltName"]


def _expiry_days(node: NodeProcess, role: str) -> float:
    seconds = value(node.get("/metrics"), "vpnrepl_tls_certificate_expiry_seconds", role=role)
    assert seconds is not None, f"no expiry metric for {role}"
    return seconds / 86400


def test_sighup_rotates_the_bridge_certificate_without_a_restart(
    site_a: LocalSite, site_b: LocalSite, tmp_path: Path
) -> None:
    """A renewed certificate is read on SIGHUP: the expiry metric shows it,
    the node keeps running, and a standby that connects afresh is served
    with it."""
    assert site_a.pki is not None
    pki = tmp_path / "pki"
    shutil.copytree(site_a.pki, pki)
    a_cfg = tmp_path / "a.toml"
    a_cfg.write_text(site_a.config_text(site_b, dial=False).replace(str(site_a.pki), str(pki)))
    b_cfg = site_b.write_config(tmp_path / "b.toml", peer=site_a)
    for cfg in (a_cfg, b_cfg):
        assert Vpnrepl(cfg)("init").returncode == 0
    setup_vpn(site_a)
    assert Vpnrepl(a_cfg)("vpn", "enable", VPN, "--role", "active").returncode == 0
    node_a = NodeProcess(site_a, a_cfg, tmp_path / "a.log", "a")
    node_b = NodeProcess(site_b, b_cfg, tmp_path / "b.log", "b")
    try:
        node_a.start()
        node_b.start()
        until(lambda: vpn_status(node_a).get("bridge") == "connected", "the standby")
        assert 800 < _expiry_days(node_a, "site") < 826 and _expiry_days(node_a, "ca") > 3000
        assert main(["tls", "init", str(pki), "--sites", "a", "--renew", "--days", "10"]) == 0
        assert node_a.pid is not None
        os.kill(node_a.pid, signal.SIGHUP)
        until(lambda: _expiry_days(node_a, "site") < 10.1, "the renewed certificate")
        node_b.kill()  # a fresh handshake: the standby gets the renewed certificate
        node_b.start()
        until(lambda: vpn_status(node_a).get("bridge") == "connected", "the standby again")
        assert "SIGHUP: the bridge's TLS read again" in node_a.log_text()
        assert node_a.proc is not None and node_a.proc.poll() is None  # never restarted
    finally:
        node_a.kill()
        node_b.kill()
