"""Replication between sites: ledger, bridge protocol, standby apply, sync,
fencing, promotion and full-sync reconciliation.

The public API is listed in ``__all__`` as each capability lands.
"""

# Bridge wire protocol: sans-IO codec, connection state machine, error taxonomy.
from ._errors import (
    ERROR_CODES,
    BadChecksum,
    BadFrame,
    BridgeError,
    Fenced,
    Gap,
    LocalProtocolError,
    PeerFailure,
    RemoteProtocolError,
    RoleConflict,
    StaleEpoch,
    Unauthorised,
    UnexpectedFrame,
    UnknownVpn,
    VersionMismatch,
)
from ._protocol import (
    CLOSED,
    DEFAULT_MAX_FRAME_SIZE,
    NEED_DATA,
    PROTOCOL_VERSION,
    TRANSITIONS,
    Ack,
    BridgeConnection,
    Checkpoint,
    CheckpointRow,
    Error,
    Events,
    Frame,
    FrameReader,
    GetAllResources,
    Heartbeat,
    Hello,
    Phase,
    ResourceList,
    Sentinel,
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
    VpnState,
    decode_frame,
)

# isort: split
# Ledger (active side), the shared apply step, standby apply.
from ._apply import ApplyResult, apply_entries, apply_entries_async
from ._ledger import (
    LedgerClosed,
    LedgerConflict,
    LedgerError,
    LedgerPruned,
    LedgerUnavailable,
    LedgerWriter,
    UnstorableEvent,
    VpnNotOpen,
    WriterStats,
)
from ._standby import LiveRow, NotStandby, StandbyApplier, StandbyError, StandbyUnavailable

# isort: split
# Bridge transport: TLS contexts, config-sync, the active's server, the standby's client.
from ._configsync import (
    ConfigSyncAPI,
    ConfigSyncError,
    import_vpn_definitions,
    reimport,
    vpn_definitions,
)
from ._tls import TlsSetupError, describe_tls_error, make_client_context, make_server_context
from ._transport import (
    CONNECTED,
    DISCONNECTED,
    SYNCING,
    BridgeClient,
    BridgeServer,
    LinkClosed,
    LinkError,
    PeerSilent,
    PeerUnreachable,
    TlsRefused,
)

# isort: split
# Promotion: materialisation, and the AMQP client it publishes with.
from ._amqp_client import BrokerPublisher
from ._amqp_wire import (
    REPLY_CODES,
    AccessRefused,
    AmqpEndpoint,
    BrokerError,
    BrokerProtocolError,
    BrokerRefused,
    BrokerUnreachable,
    ConnectionForced,
    NotAllowed,
    NotFound,
    PreconditionFailed,
    PublishRejected,
)
from ._materialise import MaterialiseError, MaterialiseResult, materialise

__all__: list[str] = []

# Bridge wire protocol.
__all__ += [
    "ERROR_CODES",
    "BadChecksum",
    "BadFrame",
    "BridgeError",
    "Fenced",
    "Gap",
    "LocalProtocolError",
    "PeerFailure",
    "RemoteProtocolError",
    "RoleConflict",
    "StaleEpoch",
    "Unauthorised",
    "UnexpectedFrame",
    "UnknownVpn",
    "VersionMismatch",
    "CLOSED",
    "DEFAULT_MAX_FRAME_SIZE",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "TRANSITIONS",
    "Ack",
    "BridgeConnection",
    "Checkpoint",
    "CheckpointRow",
    "Error",
    "Events",
    "Frame",
    "FrameReader",
    "GetAllResources",
    "Heartbeat",
    "Hello",
    "Phase",
    "ResourceList",
    "Sentinel",
    "SyncAccepted",
    "SyncFinished",
    "SyncRequest",
    "TxnApplied",
    "TxnCommit",
    "TxnOutcome",
    "TxnPrepare",
    "TxnQuery",
    "TxnVote",
    "VpnResource",
    "VpnState",
    "decode_frame",
]

# Ledger, apply, standby apply.
__all__ += [
    "ApplyResult",
    "apply_entries",
    "apply_entries_async",
    "LedgerClosed",
    "LedgerConflict",
    "LedgerError",
    "LedgerPruned",
    "LedgerUnavailable",
    "LedgerWriter",
    "UnstorableEvent",
    "VpnNotOpen",
    "WriterStats",
    "LiveRow",
    "NotStandby",
    "StandbyApplier",
    "StandbyError",
    "StandbyUnavailable",
]

# Bridge transport.
__all__ += [
    "TlsSetupError",
    "describe_tls_error",
    "make_client_context",
    "make_server_context",
    "CONNECTED",
    "DISCONNECTED",
    "SYNCING",
    "BridgeClient",
    "BridgeServer",
    "ConfigSyncAPI",
    "ConfigSyncError",
    "import_vpn_definitions",
    "reimport",
    "vpn_definitions",
    "LinkClosed",
    "LinkError",
    "PeerSilent",
    "PeerUnreachable",
    "TlsRefused",
]

# Promotion.
__all__ += [
    "BrokerPublisher",
    "REPLY_CODES",
    "AccessRefused",
    "AmqpEndpoint",
    "BrokerError",
    "BrokerProtocolError",
    "BrokerRefused",
    "BrokerUnreachable",
    "ConnectionForced",
    "NotAllowed",
    "NotFound",
    "PreconditionFailed",
    "PublishRejected",
    "MaterialiseError",
    "MaterialiseResult",
    "materialise",
]
