"""The bridge's certificates: ``vpnrepl tls init`` (a private CA and one
certificate per named site) and what the metrics read of a certificate;
and the TLS context the site's own broker is reached with."""

from __future__ import annotations

from ._broker import broker_context, site_broker_ssl
from ._certificates import init_certificates, not_after

__all__ = ["broker_context", "init_certificates", "not_after", "site_broker_ssl"]
