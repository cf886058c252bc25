"""The site's configuration file: its values and how it is read."""

from ._load import load_config
from ._values import DEFAULT_JDBC_JAR, NodeConfig, PeerConfig, ReconcileConfig, SiteConfig

__all__ = [
    "DEFAULT_JDBC_JAR",
    "NodeConfig",
    "PeerConfig",
    "ReconcileConfig",
    "SiteConfig",
    "load_config",
]
