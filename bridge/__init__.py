"""Replication between sites, and the vocabulary every layer shares.

The bottom layer (``plugin`` → ``txn`` → ``bridge``): it imports nothing of
ours. Its public API is listed here once, in two parts:

* the **vocabulary and the sans-IO cores**, imported with the package: VPN
  settings, roles and modes; replication ids and events; the ledger entry
  encoding; the bridge wire protocol and its errors; the small AMQP codec;
  the crash failpoints. Importing them loads neither asyncio, sockets nor
  psycopg, so the listener's sans-IO session can use them.
* the **I/O-bound parts**, imported on first use of a name
  (:data:`_IO_BOUND`): the ledger writer (with its live-state applier) and
  its reader, the standby applier, the bridge's links (active and standby
  sides), config-sync and the management API client, role changes,
  materialisation, the replication sink the listener's events go to
  (:class:`Replicator`), and the statements on the per-VPN rows
  ``vpn_config`` / ``vpn_state`` (``_vpnstore``: every layer reads and
  writes them through it).
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
from ._ids import (
    INCARNATION_LIMIT,
    REPLICATION_HEADER,
    IdsExhausted,
    IdSource,
    ReplicationId,
    id_in_header,
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
        LedgerWriter as LedgerWriter,
    )
    from ._ledger import (
        WriterStats as WriterStats,
    )
    from ._ledger_errors import (
        LedgerClosed as LedgerClosed,
    )
    from ._ledger_errors import (
        LedgerConflict as LedgerConflict,
    )
    from ._ledger_errors import (
        LedgerError as LedgerError,
    )
    from ._ledger_errors import (
        LedgerPruned as LedgerPruned,
    )
    from ._ledger_errors import (
        LedgerUnavailable as LedgerUnavailable,
    )
    from ._ledger_errors import (
        UnstorableEvent as UnstorableEvent,
    )
    from ._ledger_errors import (
        VpnNotOpen as VpnNotOpen,
    )
    from ._ledger_reader import (
        LedgerReader as LedgerReader,
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
    from ._transport import (
        CONNECTED as CONNECTED,
    )
    from ._transport import (
        DISCONNECTED as DISCONNECTED,
    )
    from ._transport import (
        SYNCING as SYNCING,
    )
    from ._transport import (
        BridgeClient as BridgeClient,
    )
    from ._transport import (
        BridgeServer as BridgeServer,
    )
    from ._transport import (
        LinkClosed as LinkClosed,
    )
    from ._transport import (
        LinkError as LinkError,
    )
    from ._transport import (
        PeerSilent as PeerSilent,
    )
    from ._transport import (
        PeerUnreachable as PeerUnreachable,
    )
    from ._transport import (
        TlsRefused as TlsRefused,
    )
    from ._vpnstore import (
        COUNT_UNKNOWN_ACKS as COUNT_UNKNOWN_ACKS,
    )
    from ._vpnstore import (
        EPOCH_SQL as EPOCH_SQL,
    )
    from ._vpnstore import (
        FENCE_SQL as FENCE_SQL,
    )
    from ._vpnstore import (
        ActiveVpn as ActiveVpn,
    )
    from ._vpnstore import (
        AppliedLock as AppliedLock,
    )
    from ._vpnstore import (
        ConfigLock as ConfigLock,
    )
    from ._vpnstore import (
        DemotionLock as DemotionLock,
    )
    from ._vpnstore import (
        EnabledVpn as EnabledVpn,
    )
    from ._vpnstore import (
        FollowedSettings as FollowedSettings,
    )
    from ._vpnstore import (
        LedgerStart as LedgerStart,
    )
    from ._vpnstore import (
        PromotionLock as PromotionLock,
    )
    from ._vpnstore import (
        RoleState as RoleState,
    )
    from ._vpnstore import (
        VpnStatus as VpnStatus,
    )
    from ._vpnstore import (
        active_ledgers_async as active_ledgers_async,
    )
    from ._vpnstore import (
        active_vpns_async as active_vpns_async,
    )
    from ._vpnstore import (
        add_standby_vpn_async as add_standby_vpn_async,
    )
    from ._vpnstore import (
        add_vpn_state as add_vpn_state,
    )
    from ._vpnstore import (
        add_vpn_state_async as add_vpn_state_async,
    )
    from ._vpnstore import (
        advance_ledger_indexes_async as advance_ledger_indexes_async,
    )
    from ._vpnstore import (
        applied_position as applied_position,
    )
    from ._vpnstore import (
        applied_position_async as applied_position_async,
    )
    from ._vpnstore import (
        become_active as become_active,
    )
    from ._vpnstore import (
        become_standby as become_standby,
    )
    from ._vpnstore import (
        disable_replication as disable_replication,
    )
    from ._vpnstore import (
        enabled_vpns_async as enabled_vpns_async,
    )
    from ._vpnstore import (
        fence_vpn as fence_vpn,
    )
    from ._vpnstore import (
        fence_vpn_async as fence_vpn_async,
    )
    from ._vpnstore import (
        follow_settings_async as follow_settings_async,
    )
    from ._vpnstore import (
        followed_settings_async as followed_settings_async,
    )
    from ._vpnstore import (
        keep_definitions_async as keep_definitions_async,
    )
    from ._vpnstore import (
        known_epochs_async as known_epochs_async,
    )
    from ._vpnstore import (
        ledger_progress_async as ledger_progress_async,
    )
    from ._vpnstore import (
        ledger_start_async as ledger_start_async,
    )
    from ._vpnstore import (
        lock_applied as lock_applied,
    )
    from ._vpnstore import (
        lock_for_demotion as lock_for_demotion,
    )
    from ._vpnstore import (
        lock_for_promotion as lock_for_promotion,
    )
    from ._vpnstore import (
        lock_ledger_indexes_async as lock_ledger_indexes_async,
    )
    from ._vpnstore import (
        lock_vpn_config as lock_vpn_config,
    )
    from ._vpnstore import (
        lock_vpn_config_async as lock_vpn_config_async,
    )
    from ._vpnstore import (
        mark_fenced_async as mark_fenced_async,
    )
    from ._vpnstore import (
        raise_epoch_async as raise_epoch_async,
    )
    from ._vpnstore import (
        read_vpn_settings as read_vpn_settings,
    )
    from ._vpnstore import (
        record_epoch as record_epoch,
    )
    from ._vpnstore import (
        record_first_epoch as record_first_epoch,
    )
    from ._vpnstore import (
        record_sync_eligible_async as record_sync_eligible_async,
    )
    from ._vpnstore import (
        reset_bridge_states_async as reset_bridge_states_async,
    )
    from ._vpnstore import (
        role_state as role_state,
    )
    from ._vpnstore import (
        save_vpn_settings as save_vpn_settings,
    )
    from ._vpnstore import (
        set_applied as set_applied,
    )
    from ._vpnstore import (
        set_applied_async as set_applied_async,
    )
    from ._vpnstore import (
        set_bridge_state_async as set_bridge_state_async,
    )
    from ._vpnstore import (
        stored_definitions as stored_definitions,
    )
    from ._vpnstore import (
        stored_ledger_index as stored_ledger_index,
    )
    from ._vpnstore import (
        vpn_status_rows as vpn_status_rows,
    )

#: module -> the names it exports through this package, imported on first use
_IO_BOUND: dict[str, tuple[str, ...]] = {
    "._amqp_client": ("BrokerPublisher",),
    "._apply": ("ApplyResult", "apply_entries", "apply_entries_async"),
    "._configsync": ("ConfigSyncError", "import_vpn_definitions", "reimport", "vpn_definitions"),
    "._ledger": ("LedgerWriter", "WriterStats"),
    "._ledger_errors": (
        "LedgerClosed",
        "LedgerConflict",
        "LedgerError",
        "LedgerPruned",
        "LedgerUnavailable",
        "UnstorableEvent",
        "VpnNotOpen",
    ),
    "._ledger_reader": ("LedgerReader",),
    "._management": ("ManagementAPI", "ManagementUnavailable"),
    "._materialise": ("MaterialiseError", "MaterialiseResult", "materialise"),
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
    "._transport": (
        "CONNECTED",
        "DISCONNECTED",
        "SYNCING",
        "BridgeClient",
        "BridgeServer",
        "LinkClosed",
        "LinkError",
        "PeerSilent",
        "PeerUnreachable",
        "TlsRefused",
    ),
    "._vpnstore": (
        "COUNT_UNKNOWN_ACKS",
        "EPOCH_SQL",
        "FENCE_SQL",
        "ActiveVpn",
        "AppliedLock",
        "ConfigLock",
        "DemotionLock",
        "EnabledVpn",
        "FollowedSettings",
        "LedgerStart",
        "PromotionLock",
        "RoleState",
        "VpnStatus",
        "active_ledgers_async",
        "active_vpns_async",
        "add_standby_vpn_async",
        "add_vpn_state",
        "add_vpn_state_async",
        "advance_ledger_indexes_async",
        "applied_position",
        "applied_position_async",
        "become_active",
        "become_standby",
        "disable_replication",
        "enabled_vpns_async",
        "fence_vpn",
        "fence_vpn_async",
        "follow_settings_async",
        "followed_settings_async",
        "keep_definitions_async",
        "known_epochs_async",
        "ledger_progress_async",
        "ledger_start_async",
        "lock_applied",
        "lock_for_demotion",
        "lock_for_promotion",
        "lock_ledger_indexes_async",
        "lock_vpn_config",
        "lock_vpn_config_async",
        "mark_fenced_async",
        "raise_epoch_async",
        "read_vpn_settings",
        "record_epoch",
        "record_first_epoch",
        "record_sync_eligible_async",
        "reset_bridge_states_async",
        "role_state",
        "save_vpn_settings",
        "set_applied",
        "set_applied_async",
        "set_bridge_state_async",
        "stored_definitions",
        "stored_ledger_index",
        "vpn_status_rows",
    ),
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
