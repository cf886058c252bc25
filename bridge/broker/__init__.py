"""The site's RabbitMQ as the node uses it: its management API and an AMQP publisher.

The management HTTP client (:class:`ManagementAPI`), config-sync (a VPN's
definitions listed on the active, imported on the standby) and the AMQP
publisher that replays stored messages byte for byte
(:class:`BrokerPublisher`).
"""

from __future__ import annotations

from ._configsync import (
    SYNCED_TAG,
    ConfigSyncError,
    carry_out_deletions,
    import_vpn_definitions,
    reimport,
    shape_vpn_definitions,
    split_vpn_definitions,
    vpn_definitions,
)
from ._management import ManagementAPI, ManagementUnavailable
from ._publisher import BrokerPublisher

__all__ = [
    "BrokerPublisher",
    "ConfigSyncError",
    "ManagementAPI",
    "ManagementUnavailable",
    "SYNCED_TAG",
    "carry_out_deletions",
    "import_vpn_definitions",
    "reimport",
    "shape_vpn_definitions",
    "split_vpn_definitions",
    "vpn_definitions",
]
