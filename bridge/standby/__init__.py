"""The standby site's end of the bridge.

What keeps a link to the active up (:class:`StandbyBridge`), a session
over it and each VPN's apply worker, what it does with each VPN the active
lists, each VPN's stream state (sans-IO), the applier that turns the
stream into exactly-once state (:class:`StandbyApplier`) with the
transactions committed early and the prepared rows it settles, and the
transaction link's standby end.
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
