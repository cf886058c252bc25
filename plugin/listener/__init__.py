"""The AMQP listener: the asyncio shell around the sans-IO session in
:mod:`plugin.session`, the replication sink its events go to (:class:`ReplicationSink`), the
directory refresher that keeps its view of
the site's VPNs current, and where it meets client XA.
"""

from __future__ import annotations

from ._brokers import BrokerAddress, BrokerNodes
from ._refresher import DirectoryRefresher
from ._server import CLOSE_TIMEOUT, Listener
from ._sink import MemorySink, ReplicationSink, append_events
from ._xa_gateway import XaGateway

__all__ = [
    "MemorySink",
    "ReplicationSink",
    "append_events",
    "BrokerAddress",
    "BrokerNodes",
    "CLOSE_TIMEOUT",
    "DirectoryRefresher",
    "Listener",
    "XaGateway",
]
