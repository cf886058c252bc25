"""The standby site's end of the bridge.

The client that keeps a link to the active up (:class:`BridgeClient`),
what it does with each VPN the active lists, each VPN's stream state
(sans-IO), the applier that turns the stream into exactly-once state
(:class:`StandbyApplier`) and the transaction link's standby end.
"""

from __future__ import annotations

from ._applier import NotStandby, StandbyApplier, StandbyUnavailable
from ._client import BridgeClient
from ._stream import INBOUND_TRANSITIONS, InboundInput, InboundPhase, InboundStream

__all__ = [
    "BridgeClient",
    "INBOUND_TRANSITIONS",
    "InboundInput",
    "InboundPhase",
    "InboundStream",
    "NotStandby",
    "StandbyApplier",
    "StandbyUnavailable",
]
