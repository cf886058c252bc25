"""Who is at the other end of a bridge link: the named-site rule, without I/O.

A bridge certificate names its site (CN or a DNS subjectAltName equal to
the site name; ``vpnrepl tls init`` makes such certificates). A link is
accepted only when the peer is a *configured* peer site, its certificate
(verified against the private CA by the TLS layer) names that site, and
its ``Hello`` carries the same name. Each check runs before this end sends
one byte of replication data: the active checks the certificate right
after the TLS handshake and the ``Hello`` before answering it; the standby
checks the active's certificate before sending its ``Hello`` and the
active's ``Hello`` before asking for anything.

On a link without certificates (``[insecure] plaintext_bridge``) only the
``Hello`` can be checked: any process that can reach the port can claim a
configured name. The README says so, and ``status`` shows it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["PeerCheck", "certificate_names"]


def certificate_names(peercert: Mapping[str, Any] | None) -> frozenset[str] | None:
    """The names a verified peer certificate carries (its subject's CN and
    its DNS subjectAltNames), from :meth:`ssl.SSLSocket.getpeercert`'s dict;
    None when the peer presented no certificate."""
    if not peercert:
        return None
    names = set()
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                names.add(str(value))
    for kind, value in peercert.get("subjectAltName", ()):
        if kind == "DNS":
            names.add(str(value))
    return frozenset(names)


def _listed(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in sorted(names)) or "none"


@dataclass(frozen=True, slots=True)
class PeerCheck:
    """The named-site rule for one end; every method returns why a peer is
    refused, or None when it passes."""

    #: the configured peer sites this end replicates with
    configured: frozenset[str]

    @classmethod
    def of(cls, sites: Iterable[str]) -> PeerCheck:
        return cls(frozenset(sites))

    def certificate(self, names: frozenset[str] | None) -> str | None:
        """Right after the TLS handshake: a certificate naming no configured
        peer site is refused (None: no certificate, plaintext)."""
        if names is None or names & self.configured:
            return None
        return (
            f"its certificate names {_listed(names)}, no configured peer site "
            f"({_listed(self.configured)})"
        )

    def hello(self, site: str, names: frozenset[str] | None) -> str | None:
        """The peer's ``Hello``: its site must be a configured peer, and the
        one its certificate names."""
        if site not in self.configured:
            return (
                f"its Hello names site {site!r}, not a configured peer site "
                f"({_listed(self.configured)})"
            )
        if names is not None and site not in names:
            return f"its Hello names site {site!r} but its certificate names {_listed(names)}"
        return None
