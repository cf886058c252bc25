"""AMQP 0-9-1 for the node's own broker connections.

The sans-IO codec (errors and reply codes, frame splitting, confirms, the
stored message's frames) without I/O (the node's asyncio client of it is
:class:`bridge.broker.BrokerPublisher`).
"""

from __future__ import annotations

from ._codec import (
    FRAME_METHOD,
    HEARTBEAT_FRAME,
    PROTOCOL_HEADER,
    AccessRefused,
    AmqpEndpoint,
    BrokerError,
    BrokerProtocolError,
    BrokerRefused,
    BrokerUnreachable,
    ConfirmTracker,
    FrameSplitter,
    NotAllowed,
    NotFound,
    PublishRejected,
    RawFrame,
    encode_message,
    persistent_properties,
    refusal,
)

__all__ = [
    "AccessRefused",
    "AmqpEndpoint",
    "BrokerError",
    "BrokerProtocolError",
    "BrokerRefused",
    "BrokerUnreachable",
    "ConfirmTracker",
    "FRAME_METHOD",
    "FrameSplitter",
    "HEARTBEAT_FRAME",
    "NotAllowed",
    "NotFound",
    "PROTOCOL_HEADER",
    "PublishRejected",
    "RawFrame",
    "encode_message",
    "persistent_properties",
    "refusal",
]
