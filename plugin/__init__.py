"""What the broker admin and clients touch: the ``vpnrepl`` command line, the
site configuration, the AMQP listener and the node that wires a site.

The top layer (``plugin`` → ``txn`` → ``bridge``). This package's own names
are the site configuration (:func:`load_config`) and the error taxonomy
rooted at :class:`PluginError`; everything else is in a subpackage with its
names in its own ``__init__``: ``cli`` (``vpnrepl``), ``node`` (the site
process), ``ops`` (the operator's commands), ``listener`` and ``session``
(the AMQP listener and its sans-IO connection), ``topology`` (sans-IO),
``admin`` (endpoint and metrics), ``reconcile`` (the Spark job), ``tls``
(the bridge's certificates) and, apart from the product, ``devtools`` (the
local servers of ``vpnrepl demo`` and ``sandbox``, the tests and the
benchmarks).
"""

from __future__ import annotations

from ._errors import ConfigError, PluginError, StateError, StoreUnavailable, UsageError
from .config import DEFAULT_JDBC_JAR, PeerConfig, ReconcileConfig, SiteConfig, load_config

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
]
