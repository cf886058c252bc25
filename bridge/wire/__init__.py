"""The bridge's wire protocol, without I/O.

The frames, each declared once with its fields' wire types (from which
their encoding, decoding and checks are compiled), the connection's state
machine (:class:`BridgeConnection`) with its transition table and the
checks of a VPN's stream, and the named-site rule (who may use the bridge).
"""

from __future__ import annotations

from ._frames import (
    CAP_TOPOLOGY,
    CAP_XA_OWNER,
    CAPABILITIES,
    FRAME_TYPES,
    MAGIC,
    OUR_CAPABILITIES,
    PREVIOUS_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Ack,
    Checkpoint,
    CheckpointRow,
    Error,
    Events,
    Frame,
    FrameReader,
    GetAllResources,
    Heartbeat,
    Hello,
    Repair,
    ResourceList,
    SyncAccepted,
    SyncFinished,
    SyncRequest,
    TxnApplied,
    TxnCommit,
    TxnOutcome,
    TxnPrepare,
    TxnQuery,
    TxnVote,
    VpnResource,
    decode_frame,
)
from ._identity import PeerCheck, certificate_names
from ._protocol import CLOSED, NEED_DATA, BridgeConnection, Sentinel
from ._transitions import CONNECTION_TRANSITIONS, ConnectionPhase, VpnState

__all__ = [
    "Ack",
    "BridgeConnection",
    "CAPABILITIES",
    "CAP_TOPOLOGY",
    "CAP_XA_OWNER",
    "CLOSED",
    "Checkpoint",
    "CheckpointRow",
    "Error",
    "Events",
    "FRAME_TYPES",
    "Frame",
    "FrameReader",
    "GetAllResources",
    "Heartbeat",
    "Hello",
    "MAGIC",
    "NEED_DATA",
    "OUR_CAPABILITIES",
    "PREVIOUS_PROTOCOL_VERSION",
    "PROTOCOL_VERSION",
    "PeerCheck",
    "ConnectionPhase",
    "Repair",
    "ResourceList",
    "Sentinel",
    "SyncAccepted",
    "SyncFinished",
    "SyncRequest",
    "CONNECTION_TRANSITIONS",
    "TxnApplied",
    "TxnCommit",
    "TxnOutcome",
    "TxnPrepare",
    "TxnQuery",
    "TxnVote",
    "VpnResource",
    "VpnState",
    "certificate_names",
    "decode_frame",
]
