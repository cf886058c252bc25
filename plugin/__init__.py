"""What the broker admin and clients touch: the ``vpnrepl`` command line, the
site configuration, the AMQP listener and the node that wires a site.

The top layer (``plugin`` → ``txn`` → ``bridge``). Its public API: the site
configuration (:func:`load_config`), the admin CLI (:func:`main`), and the
error taxonomy rooted at :class:`PluginError`. The listener's sans-IO
session and the topology are private modules; importing this package loads
none of the node's I/O (the CLI is imported when :func:`main` runs).
"""

from __future__ import annotations

from collections.abc import Sequence

from ._config import DEFAULT_JDBC_JAR, PeerConfig, ReconcileConfig, SiteConfig, load_config
from ._errors import ConfigError, PluginError, StateError, StoreUnavailable, UsageError

__all__ = [
    "DEFAULT_JDBC_JAR",
    "PeerConfig",
    "ReconcileConfig",
    "ConfigError",
    "PluginError",
    "SiteConfig",
    "StateError",
    "StoreUnavailable",
    "UsageError",
    "load_config",
    "main",
]


def main(argv: Sequence[str] | None = None) -> int:
    """``vpnrepl``: run the admin's command line (see ``plugin.cli._cli``)."""
    from .cli import main as run

    return run(argv)
