"""A throwaway PKI for TLS tests: a CA signing sites a, b and c (c: a site
no test configures as a peer) and an AMQP client, and a rogue CA signing a
certificate named "rogue" (made with the `openssl` command line tool, so
these tests do not rely on `vpnrepl tls init`'s own output)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from bridge import TlsConfig


@dataclass(frozen=True)
class Pki:
    dir: Path

    def tls(self, name: str, ca: str | None = "ca") -> TlsConfig:
        ca_file = self.dir / f"{ca}.crt" if ca else None
        return TlsConfig(self.dir / f"{name}.crt", self.dir / f"{name}.key", ca_file)

    def section(self, name: str, ca: str | None) -> str:
        """The ``[tls]`` section of a site config using ``name``'s certificate."""
        text = f'\n[tls]\ncert = "{self.dir / name}.crt"\nkey = "{self.dir / name}.key"\n'
        return text + (f'ca = "{self.dir / ca}.crt"\n' if ca else "")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A throwaway CA signing two site certificates and a client's, and a
    rogue CA signing one."""
    d = tmp_path_factory.mktemp("pki")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for ca in ("ca", "rogue-ca"):
        _openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.crt",
                 "-days", "2", "-subj", f"/CN={ca}", cwd=d)  # fmt: skip
    for name, ca in (
        ("a", "ca"), ("b", "ca"), ("c", "ca"), ("client", "ca"), ("rogue", "rogue-ca")
    ):  # fmt: skip
        # a site certificate names its site (CN and subjectAltName), and
        # 127.0.0.1 / localhost for server-only TLS with hostname checking
        (d / f"{name}.ext").write_text(
            f"subjectAltName=DNS:{name},IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
            "extendedKeyUsage=serverAuth,clientAuth\n"
        )
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
                 "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return Pki(d)
