"""The bridge's certificates: ``vpnrepl tls init`` (a private CA and one
certificate per named site) and what the metrics read of a certificate."""

from __future__ import annotations

from ._certificates import init_certificates, not_after

__all__ = ["init_certificates", "not_after"]
