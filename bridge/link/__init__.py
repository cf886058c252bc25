"""One bridge connection's transport: TCP or TLS, framing, heartbeats.

:class:`Link` carries frames; the TLS contexts and the one place that
explains a TLS failure; :class:`TlsServer`, the server socket that sees
its refused handshakes (the bridge's and the AMQPS listener's).
"""

from __future__ import annotations

from ._acceptor import TLS_SHUTDOWN_TIMEOUT, TlsServer
from ._link import (
    Link,
    LinkClosed,
    LinkError,
    PeerUnreachable,
    TlsRefused,
    describe_error,
    dial,
    peer_address,
)
from ._tls import TlsSetupError, describe_tls_error, make_client_context, make_server_context

__all__ = [
    "Link",
    "LinkClosed",
    "LinkError",
    "PeerUnreachable",
    "TLS_SHUTDOWN_TIMEOUT",
    "TlsRefused",
    "TlsServer",
    "TlsSetupError",
    "describe_error",
    "describe_tls_error",
    "dial",
    "make_client_context",
    "make_server_context",
    "peer_address",
]
