"""What the broker admin and clients touch.

Seams: the site configuration (:func:`load_config`), per-VPN replication
settings (:class:`VpnSettings`), the admin CLI (:func:`main`), and the error
taxonomy rooted at :class:`PluginError`.
"""

from ._cli import main
from ._config import HostPort, SiteConfig, TlsConfig, load_config, redact_url
from ._errors import ConfigError, PluginError, StateError, StoreUnavailable, UsageError
from ._vpn import Mode, Role, SyncTimeoutPolicy, TopicFilter, VpnSettings

__all__ = [
    "ConfigError",
    "HostPort",
    "Mode",
    "PluginError",
    "Role",
    "SiteConfig",
    "StateError",
    "StoreUnavailable",
    "SyncTimeoutPolicy",
    "TlsConfig",
    "TopicFilter",
    "UsageError",
    "VpnSettings",
    "load_config",
    "main",
    "redact_url",
]
