"""The site's TLS client context for its own broker (``amqps://`` in
``broker.amqp_url``), which the listener, the node and the operator
commands all connect with."""

from __future__ import annotations

import ssl
from pathlib import Path
from urllib.parse import urlsplit

from bridge.link import describe_tls_error
from plugin._errors import ConfigError
from plugin.config import SiteConfig

__all__ = ["broker_context", "site_broker_ssl"]


def broker_context(ca: Path | None = None) -> ssl.SSLContext:
    """The client context for an ``amqps://`` broker: TLS 1.2 or later; the
    broker's certificate verified against ``ca`` alone when given, else
    against the system's trusted CAs; and always matched against the URL's
    host (an IP address must be among the certificate's IP addresses).

    Why hostname checking stays on with a private ``ca``: unlike the bridge's
    pinned peer CA, a broker's CA is typically an organisation's CA signing
    many servers, and only the name tells the site's broker from the others.
    """
    ctx = ssl.create_default_context(cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def site_broker_ssl(cfg: SiteConfig) -> ssl.SSLContext | None:
    """The context verifying an ``amqps://`` broker (``broker.ca``, else the
    system's trusted CAs); None for a plain ``amqp://`` one."""
    if urlsplit(cfg.amqp_url).scheme != "amqps":
        return None
    try:
        return broker_context(cfg.broker_ca)
    except (ssl.SSLError, OSError) as e:
        reason = describe_tls_error(e) if isinstance(e, ssl.SSLError) else e.strerror
        raise ConfigError(cfg.path, "broker.ca", f"not a usable CA file: {reason}") from e
