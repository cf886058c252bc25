"""One client connection through the listener, without I/O.

The session (bytes in, actions out), its lifecycle table, channels, held
confirms, the publish paths, topology requests seen on the wire. The AMQP
codec under it is :mod:`bridge.amqp`.
"""

from __future__ import annotations

from ._actions import Output, XaCall
from ._channel import Channel
from ._confirms import HeldConfirms
from ._lifecycle import (
    BROKER_DONE,
    BROKER_READS,
    CLIENT_DONE,
    CLIENT_READS,
    CLOSING,
    LIFECYCLE_TRANSITIONS,
    UPSTREAM_ON_FAULT,
    WE_CLOSED,
    BrokerReads,
    ClientReads,
    Lifecycle,
    LifecycleError,
    Trigger,
    Upstream,
    advance,
)
from ._refusal import BrokerUnavailable, TooManyConnections
from ._session import Session
from ._topology_changes import (
    NAMES_A_QUEUE,
    REFUSABLE,
    BindExchange,
    BindQueue,
    DeclareExchange,
    DeclareQueue,
    DeleteExchange,
    DeleteQueue,
    PurgeQueue,
    UnbindExchange,
    UnbindQueue,
    change_of,
)

__all__ = [
    "BROKER_DONE",
    "BROKER_READS",
    "BindExchange",
    "BindQueue",
    "BrokerReads",
    "BrokerUnavailable",
    "CLIENT_DONE",
    "CLIENT_READS",
    "CLOSING",
    "Channel",
    "ClientReads",
    "HeldConfirms",
    "DeclareExchange",
    "DeclareQueue",
    "DeleteExchange",
    "DeleteQueue",
    "Lifecycle",
    "LifecycleError",
    "NAMES_A_QUEUE",
    "Output",
    "PurgeQueue",
    "REFUSABLE",
    "Session",
    "LIFECYCLE_TRANSITIONS",
    "TooManyConnections",
    "Trigger",
    "UPSTREAM_ON_FAULT",
    "UnbindExchange",
    "UnbindQueue",
    "Upstream",
    "WE_CLOSED",
    "XaCall",
    "advance",
    "change_of",
]
