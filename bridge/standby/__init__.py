"""The standby site's end of the bridge.

The client that keeps a link to the active up (:class:`StandbyBridge`),
what it does with each VPN the active lists, each VPN's stream state
(sans-IO), the applier that turns the stream into exactly-once state
(:class:`StandbyApplier`) and the transaction link's standby end.
"""

from __future__ import annotations

from ._applier import NotStandby, StandbyApplier, StandbyUnavailable
from ._bridge import StandbyBridge
from ._stream import (
    STREAM_TRANSITIONS,
    StandbyStream,
    StreamInput,
    StreamPhase,
)

__all__ = [
    "StandbyBridge",
    "STREAM_TRANSITIONS",
    "StreamInput",
    "StreamPhase",
    "StandbyStream",
    "NotStandby",
    "StandbyApplier",
    "StandbyUnavailable",
]
