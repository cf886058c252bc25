"""``vpnrepl tls init DIR --sites a,b``: a private CA for the bridge and a
certificate per site that names it, with the ``cryptography`` package.

A bridge certificate must name its site (CN and a DNS subjectAltName equal
to the site name): that is how each end knows which site dialled it. The
CA signs bridge certificates and nothing else. Keys are ECDSA P-256 (small,
fast handshakes), written 0600; certificates 0644. Running it again reuses
the CA and every site certificate already in DIR (so a third site can be
added later); only ``--renew`` replaces a site's pair (a rotation: the node
reads it on SIGHUP).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from plugin._errors import UsageError

__all__ = ["CA_DAYS", "SITE_DAYS", "SiteFiles", "init_certificates", "not_after"]

#: validity of the CA and of a site certificate
CA_DAYS = 3650
SITE_DAYS = 825


@dataclass(frozen=True, slots=True)
class SiteFiles:
    """One site's files, and whether this run made them."""

    site: str
    cert: Path
    key: Path
    ca: Path
    created: bool

    def tls_lines(self) -> str:
        """The ``[tls]`` section of the site's config."""
        return f'[tls]\ncert = "{self.cert}"\nkey = "{self.key}"\nca = "{self.ca}"\n'


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = directory / "ca.crt", directory / "ca.key"
    if cert_path.exists() and key_path.exists():
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise UsageError(f"{key_path}: not the ECDSA key this command makes")
        return cert, key
    if cert_path.exists() or key_path.exists():
        raise UsageError(f"{directory}: has one of ca.crt and ca.key but not the other")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("vpnrepl bridge CA"))
        .issuer_name(_name("vpnrepl bridge CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .sign(key, hashes.SHA256())
    )
    _write(key_path, _key_pem(key), 0o600)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert, key


def _site(
    directory: Path,
    site: str,
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    days: int,
    renew: bool,
) -> SiteFiles:
    cert_path, key_path = directory / f"{site}.crt", directory / f"{site}.key"
    files = SiteFiles(site, cert_path, key_path, directory / "ca.crt", created=False)
    if cert_path.exists() and key_path.exists() and not renew:
        return files
    if (cert_path.exists() or key_path.exists()) and not renew:
        raise UsageError(f"{directory}: has one of {site}.crt and {site}.key but not the other")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(site))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(site)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    # a renewal replaces the pair whole (written aside, then renamed over),
    # so a node re-reading it on SIGHUP never sees half of it
    for path, data, mode in (
        (key_path, _key_pem(key), 0o600),
        (cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644),
    ):
        aside = path.with_name(path.name + ".new")
        aside.unlink(missing_ok=True)
        _write(aside, data, mode)
        aside.replace(path)
    return SiteFiles(site, cert_path, key_path, directory / "ca.crt", created=True)


def init_certificates(
    directory: Path, sites: list[str], *, days: int = SITE_DAYS, renew: bool = False
) -> list[SiteFiles]:
    """Make (or reuse) the CA in ``directory`` and a certificate per site,
    valid ``days``; ``renew``: issue the sites' certificates again (a new
    key each) from the CA that is there, for a rotation."""
    if days < 1:
        raise UsageError(f"--days {days}: a certificate is valid at least one day")
    if renew and not (directory / "ca.key").exists():
        raise UsageError(f"{directory}: no CA to renew certificates from (ca.crt, ca.key)")
    if not sites:
        raise UsageError("--sites names at least one site")
    for site in sites:
        if not site or not all(c.isalnum() or c in "-_." for c in site):
            raise UsageError(f"site name {site!r}: expected letters, digits, '-', '_' or '.'")
    if len(set(sites)) != len(sites):
        raise UsageError("--sites names a site twice")
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _ca(directory)
    return [_site(directory, site, ca, ca_key, days, renew) for site in sites]


def not_after(path: Path) -> float | None:
    """When the (first) certificate in the PEM file ``path`` expires, as a
    POSIX timestamp; None when the file cannot be read as one."""
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None
    return cert.not_valid_after_utc.timestamp()
