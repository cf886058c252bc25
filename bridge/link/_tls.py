"""TLS for the bridge: the two :class:`ssl.SSLContext` builders and the one
place that turns an :class:`ssl.SSLError` into words an admin can act on.

Invariant: a bridge link is never weaker than the site's ``[tls]`` says:
never below TLS 1.2, and with ``ca`` (the node requires it) mutual, each end
verifying the other against ``ca`` only and without host names, the site a
certificate names being checked above TLS (:mod:`bridge.wire._identity`);
why: docs/behaviour.md, "TLS and the named-site rule". Without ``ca`` (a
component test) the active asks for no client certificate and the standby
verifies the active against the system's CAs, host name included. The
AMQPS listener builds its context with :func:`make_server_context` from
``[client_tls]``: the same floor, a client certificate required and
verified against ``ca`` only when ``ca`` is set.
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path

from bridge._errors import BridgeError
from bridge._settings import TlsConfig

__all__ = ["TlsSetupError", "describe_tls_error", "make_client_context", "make_server_context"]


class TlsSetupError(BridgeError):
    """The TLS certificate, key or CA file cannot be used; names the file."""


def _file_error(what: str, path: Path, e: BaseException, hint: str = "") -> TlsSetupError:
    if isinstance(e, FileNotFoundError):
        reason = "file not found"
    elif isinstance(e, ssl.SSLError):
        reason = describe_tls_error(e)
    elif isinstance(e, OSError):
        reason = e.strerror or type(e).__name__
    else:
        reason = str(e) or type(e).__name__
    return TlsSetupError(f"TLS {what} {path}: {reason}{hint}")


def _context(*, server: bool, tls: TlsConfig) -> ssl.SSLContext:
    """Our certificate and key loaded, the pinned CA if any; OpenSSL's
    default ciphers; no trust store unless a caller loads one."""
    side = ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT
    ctx = ssl.SSLContext(side)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION
    for path in (tls.cert, tls.key):
        if not Path(path).is_file():
            what = "certificate" if path == tls.cert else "key"
            raise _file_error(what, Path(path), FileNotFoundError(path))
    try:
        ctx.load_cert_chain(tls.cert, tls.key)
    except (ssl.SSLError, OSError, ValueError) as e:
        # OpenSSL does not say which of the two is bad: try the certificate
        # alone to tell them apart.
        probe = ssl.SSLContext(side)
        try:
            probe.load_verify_locations(cafile=tls.cert)
        except (ssl.SSLError, OSError, ValueError) as cert_error:
            raise _file_error("certificate", Path(tls.cert), cert_error) from e
        hint = f" (not a PEM private key, or not the key of {tls.cert})"
        raise _file_error("key", Path(tls.key), e, hint) from e
    if tls.ca is not None:
        try:
            ctx.load_verify_locations(cafile=tls.ca)
        except (ssl.SSLError, OSError, ValueError) as e:
            raise _file_error("CA", Path(tls.ca), e) from e
    return ctx


def make_server_context(tls: TlsConfig) -> ssl.SSLContext:
    """The active's context: mutual TLS (client certificate required and
    verified against ``tls.ca``) when a CA is configured, else server-only."""
    ctx = _context(server=True, tls=tls)
    ctx.verify_mode = ssl.CERT_REQUIRED if tls.ca is not None else ssl.CERT_NONE
    return ctx


def make_client_context(tls: TlsConfig) -> ssl.SSLContext:
    """The standby's context: presents its certificate, verifies the active
    against ``tls.ca`` (no hostname check, see the module docstring) or, with
    no CA configured, against the system trust store with hostname checking."""
    ctx = _context(server=False, tls=tls)
    ctx.verify_mode = ssl.CERT_REQUIRED
    if tls.ca is not None:
        ctx.check_hostname = False
    else:
        ctx.check_hostname = True
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    return ctx


def describe_tls_error(e: ssl.SSLError) -> str:
    """One line saying why a handshake or TLS file failed, from OpenSSL's words."""
    if isinstance(e, ssl.SSLCertVerificationError):
        detail = e.verify_message or e.reason or "certificate verify failed"
        return f"certificate verify failed: {detail}"
    reason = getattr(e, "reason", None)
    if reason:
        text = str(reason).lower().replace("_", " ")
        if "alert" in text:
            return f"the peer refused the handshake ({text})"
        return text
    text = str(e.args[1] if len(e.args) > 1 else e)
    text = re.sub(r"^\[\w+\]\s*|\s*\(_ssl\.c:\d+\)$", "", text.strip())
    return text or type(e).__name__
