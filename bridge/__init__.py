"""Replication between sites, and the vocabulary every layer shares.

The bottom layer (``plugin`` → ``txn`` → ``bridge``): it imports nothing of
ours. Its public API is listed here once, in two parts:

* the **vocabulary and the sans-IO cores**, imported with the package: VPN
  settings, roles and modes; replication ids and events; the ledger entry
  encoding; the bridge wire protocol and its errors; the small AMQP codec;
  the crash failpoints. Importing them loads neither asyncio, sockets nor
  psycopg, so the listener's sans-IO session can use them.
* the **I/O-bound parts**, imported on first use of a name
  (:data:`_IO_BOUND`): the ledger writer and its live-state applier, the
  standby applier, the bridge's links (active and standby sides), config-sync
  and the management API client, role changes, materialisation, and the
  replication sink the listener's events go to (:class:`Replicator`).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

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
from ._entry import EventDecodeError, LedgerEntry, decode_event, encode_event, split_events
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
from ._events import (
    EVENT_KINDS,
    MARKER_QUEUE,
    ConfirmKey,
    Consumed,
    DeadLettered,
    Event,
    LocalTransaction,
    Published,
    Purged,
    TransactionRefused,
    Voted,
    future_callback,
)
from ._failpoints import FAILPOINTS, UnknownFailpoint, armed, failpoint
from ._frames import (
    DEFAULT_MAX_FRAME_SIZE,
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
from ._ids import (
    INCARNATION_LIMIT,
    REPLICATION_HEADER,
    IdsExhausted,
    IdSource,
    ReplicationId,
    id_in_header,
)
from ._protocol import CLOSED, NEED_DATA, TRANSITIONS, BridgeConnection, Phase, Sentinel, VpnState
from ._settings import (
    DEFAULT_SYNC_TIMEOUT_MS,
    HostPort,
    InvalidSettings,
    Mode,
    Role,
    SyncTimeoutPolicy,
    TlsConfig,
    TopicFilter,
    VpnSettings,
    redact_url,
)

if TYPE_CHECKING:
    from ._active import BridgeServer as BridgeServer
    from ._amqp_client import BrokerPublisher as BrokerPublisher
    from ._apply import (
        ApplyResult as ApplyResult,
    )
    from ._apply import (
        apply_entries as apply_entries,
    )
    from ._apply import (
        apply_entries_async as apply_entries_async,
    )
    from ._bridgestate import (
        CONNECTED as CONNECTED,
    )
    from ._bridgestate import (
        DISCONNECTED as DISCONNECTED,
    )
    from ._bridgestate import (
        SYNCING as SYNCING,
    )
    from ._configsync import (
        ConfigSyncError as ConfigSyncError,
    )
    from ._configsync import (
        import_vpn_definitions as import_vpn_definitions,
    )
    from ._configsync import (
        reimport as reimport,
    )
    from ._configsync import (
        vpn_definitions as vpn_definitions,
    )
    from ._ledger import (
        LedgerClosed as LedgerClosed,
    )
    from ._ledger import (
        LedgerConflict as LedgerConflict,
    )
    from ._ledger import (
        LedgerError as LedgerError,
    )
    from ._ledger import (
        LedgerPruned as LedgerPruned,
    )
    from ._ledger import (
        LedgerUnavailable as LedgerUnavailable,
    )
    from ._ledger import (
        LedgerWriter as LedgerWriter,
    )
    from ._ledger import (
        UnstorableEvent as UnstorableEvent,
    )
    from ._ledger import (
        VpnNotOpen as VpnNotOpen,
    )
    from ._ledger import (
        WriterStats as WriterStats,
    )
    from ._link import (
        LinkClosed as LinkClosed,
    )
    from ._link import (
        LinkError as LinkError,
    )
    from ._link import (
        PeerSilent as PeerSilent,
    )
    from ._link import (
        PeerUnreachable as PeerUnreachable,
    )
    from ._link import (
        TlsRefused as TlsRefused,
    )
    from ._management import (
        ManagementAPI as ManagementAPI,
    )
    from ._management import (
        ManagementUnavailable as ManagementUnavailable,
    )
    from ._materialise import (
        MaterialiseError as MaterialiseError,
    )
    from ._materialise import (
        MaterialiseResult as MaterialiseResult,
    )
    from ._materialise import (
        materialise as materialise,
    )
    from ._receiver import BridgeClient as BridgeClient
    from ._replicator import (
        Replicator as Replicator,
    )
    from ._replicator import (
        Transactions as Transactions,
    )
    from ._replicator import (
        commit_in_task as commit_in_task,
    )
    from ._roles import (
        PromotionStart as PromotionStart,
    )
    from ._roles import (
        RoleError as RoleError,
    )
    from ._roles import (
        Tail as Tail,
    )
    from ._roles import (
        TailMessage as TailMessage,
    )
    from ._roles import (
        begin_promotion as begin_promotion,
    )
    from ._roles import (
        demote_to_standby as demote_to_standby,
    )
    from ._roles import (
        ensure_fenced as ensure_fenced,
    )
    from ._roles import (
        fail_promotion as fail_promotion,
    )
    from ._roles import (
        finish_promotion as finish_promotion,
    )
    from ._roles import (
        read_tail as read_tail,
    )
    from ._standby import (
        LiveRow as LiveRow,
    )
    from ._standby import (
        NotStandby as NotStandby,
    )
    from ._standby import (
        StandbyApplier as StandbyApplier,
    )
    from ._standby import (
        StandbyError as StandbyError,
    )
    from ._standby import (
        StandbyUnavailable as StandbyUnavailable,
    )
    from ._tls import (
        TlsSetupError as TlsSetupError,
    )
    from ._tls import (
        describe_tls_error as describe_tls_error,
    )
    from ._tls import (
        make_client_context as make_client_context,
    )
    from ._tls import (
        make_server_context as make_server_context,
    )

#: module -> the names it exports through this package, imported on first use
_IO_BOUND: dict[str, tuple[str, ...]] = {
    "._active": ("BridgeServer",),
    "._amqp_client": ("BrokerPublisher",),
    "._apply": ("ApplyResult", "apply_entries", "apply_entries_async"),
    "._bridgestate": ("CONNECTED", "DISCONNECTED", "SYNCING"),
    "._configsync": ("ConfigSyncError", "import_vpn_definitions", "reimport", "vpn_definitions"),
    "._ledger": (
        "LedgerClosed",
        "LedgerConflict",
        "LedgerError",
        "LedgerPruned",
        "LedgerUnavailable",
        "LedgerWriter",
        "UnstorableEvent",
        "VpnNotOpen",
        "WriterStats",
    ),
    "._link": ("LinkClosed", "LinkError", "PeerSilent", "PeerUnreachable", "TlsRefused"),
    "._management": ("ManagementAPI", "ManagementUnavailable"),
    "._materialise": ("MaterialiseError", "MaterialiseResult", "materialise"),
    "._receiver": ("BridgeClient",),
    "._replicator": ("Replicator", "Transactions", "commit_in_task"),
    "._roles": (
        "PromotionStart",
        "RoleError",
        "Tail",
        "TailMessage",
        "begin_promotion",
        "demote_to_standby",
        "ensure_fenced",
        "fail_promotion",
        "finish_promotion",
        "read_tail",
    ),
    "._standby": ("LiveRow", "NotStandby", "StandbyApplier", "StandbyError", "StandbyUnavailable"),
    "._tls": ("TlsSetupError", "describe_tls_error", "make_client_context", "make_server_context"),
}
_LAZY = {name: module for module, names in _IO_BOUND.items() for name in names}


def __getattr__(name: str) -> Any:
    """An I/O-bound name, imported on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_LAZY[name], __name__), name)


__all__ = [
    # settings and the shared vocabulary
    "DEFAULT_SYNC_TIMEOUT_MS",
    "HostPort",
    "InvalidSettings",
    "Mode",
    "Role",
    "SyncTimeoutPolicy",
    "TlsConfig",
    "TopicFilter",
    "VpnSettings",
    "redact_url",
    "INCARNATION_LIMIT",
    "REPLICATION_HEADER",
    "IdSource",
    "IdsExhausted",
    "ReplicationId",
    "id_in_header",
    "EVENT_KINDS",
    "MARKER_QUEUE",
    "ConfirmKey",
    "Consumed",
    "DeadLettered",
    "Event",
    "LocalTransaction",
    "Published",
    "Purged",
    "TransactionRefused",
    "Voted",
    "future_callback",
    "FAILPOINTS",
    "UnknownFailpoint",
    "armed",
    "failpoint",
    # the ledger entry encoding
    "EventDecodeError",
    "LedgerEntry",
    "decode_event",
    "encode_event",
    "split_events",
    # the bridge wire protocol and its errors
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
    # the AMQP codec of the broker publisher
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
    # the I/O-bound parts are added below
]
__all__ += _LAZY
