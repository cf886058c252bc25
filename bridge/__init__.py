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
  writes them through it), and the sync-ineligible windows
  (``_window_store``, written by the ``_window_recorder``).
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
    persistent_properties,
)
from ._definitions import (
    DefinitionsError,
    binding_item,
    exchange_item,
    merge_definitions,
    name_item,
    queue_item,
    streamed_deletions,
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
    RESERVED_PREFIX,
    TOPOLOGY_OPS,
    XA_TXID_PREFIX,
    ConfirmKey,
    Consumed,
    DeadLettered,
    Event,
    LocalTransaction,
    Published,
    Purged,
    TopologyChanged,
    TransactionRefused,
    Voted,
    future_callback,
    xid_of_txid,
)
from ._failpoints import FAILPOINTS, UnknownFailpoint, armed, failpoint
from ._frames import (
    CAP_PURGE_POINT,
    CAP_TAKEOVER,
    CAP_TOPOLOGY,
    CAP_XA_OWNER,
    CAPABILITIES,
    DEFAULT_MAX_FRAME_SIZE,
    OUR_CAPABILITIES,
    PREVIOUS_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
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
from ._fullsync import (
    DIFFERS,
    EXTRA_ON_STANDBY,
    KINDS,
    MAX_SEGMENTS,
    MISSING_ON_STANDBY,
    REFLECTED_INDEX,
    ROWS_OF_KEYS,
    Difference,
    LiveKey,
    compare_rows,
    live_rows_query,
    quote_literal,
    row_digest_sql,
    segment_hashes_query,
    segment_rows_query,
    segment_sql,
    touched,
)
from ._identity import PeerCheck, certificate_names
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
    from ._acceptor import (
        TLS_SHUTDOWN_TIMEOUT as TLS_SHUTDOWN_TIMEOUT,
        TlsServer as TlsServer,
    )
    from ._active import BridgeServer as BridgeServer
    from ._amqp_client import BrokerPublisher as BrokerPublisher
    from ._apply import (
        ApplyResult as ApplyResult,
        apply_entries as apply_entries,
        apply_entries_async as apply_entries_async,
    )
    from ._bridgestate import (
        CONNECTED as CONNECTED,
        DISCONNECTED as DISCONNECTED,
        SYNCING as SYNCING,
    )
    from ._configsync import (
        SYNCED_TAG as SYNCED_TAG,
        ConfigSyncError as ConfigSyncError,
        carry_out_deletions as carry_out_deletions,
        import_vpn_definitions as import_vpn_definitions,
        reimport as reimport,
        vpn_definitions as vpn_definitions,
    )
    from ._ledger import (
        LedgerWriter as LedgerWriter,
        WriterStats as WriterStats,
    )
    from ._ledger_bound import LedgerBound as LedgerBound
    from ._ledger_errors import (
        LedgerClosed as LedgerClosed,
        LedgerConflict as LedgerConflict,
        LedgerError as LedgerError,
        LedgerPruned as LedgerPruned,
        LedgerUnavailable as LedgerUnavailable,
        UnstorableEvent as UnstorableEvent,
        VpnNotOpen as VpnNotOpen,
    )
    from ._ledger_reader import (
        LedgerReader as LedgerReader,
    )
    from ._link import (
        LinkClosed as LinkClosed,
        LinkError as LinkError,
        PeerSilent as PeerSilent,
        PeerUnreachable as PeerUnreachable,
        TlsRefused as TlsRefused,
    )
    from ._management import (
        ManagementAPI as ManagementAPI,
        ManagementUnavailable as ManagementUnavailable,
    )
    from ._materialise import (
        MaterialiseError as MaterialiseError,
        MaterialiseResult as MaterialiseResult,
        materialise as materialise,
    )
    from ._outbound import RepairSent as RepairSent
    from ._receiver import BridgeClient as BridgeClient
    from ._replicator import (
        Replicator as Replicator,
        Transactions as Transactions,
        commit_in_task as commit_in_task,
    )
    from ._roles import (
        PromotionStart as PromotionStart,
        RoleError as RoleError,
        Tail as Tail,
        TailMessage as TailMessage,
        TakeoverUnknown as TakeoverUnknown,
        begin_promotion as begin_promotion,
        demote_to_standby as demote_to_standby,
        ensure_fenced as ensure_fenced,
        fail_promotion as fail_promotion,
        finish_promotion as finish_promotion,
        read_tail as read_tail,
    )
    from ._standby import (
        LiveRow as LiveRow,
        NotStandby as NotStandby,
        StandbyApplier as StandbyApplier,
        StandbyError as StandbyError,
        StandbyUnavailable as StandbyUnavailable,
    )
    from ._tls import (
        TlsSetupError as TlsSetupError,
        describe_tls_error as describe_tls_error,
        make_client_context as make_client_context,
        make_server_context as make_server_context,
    )
    from ._topology_store import (
        StoredTopology as StoredTopology,
        keep_definitions_async as keep_definitions_async,
        stored_topology as stored_topology,
    )
    from ._vpnstore import (
        ActiveVpn as ActiveVpn,
        AppliedLock as AppliedLock,
        ConfigLock as ConfigLock,
        DemotionLock as DemotionLock,
        EnabledVpn as EnabledVpn,
        FollowedSettings as FollowedSettings,
        LedgerStart as LedgerStart,
        PromotionLock as PromotionLock,
        RoleState as RoleState,
        VpnStatus as VpnStatus,
        active_ledgers_async as active_ledgers_async,
        active_vpns_async as active_vpns_async,
        add_standby_vpn_async as add_standby_vpn_async,
        add_vpn_state as add_vpn_state,
        add_vpn_state_async as add_vpn_state_async,
        advance_ledger_indexes_async as advance_ledger_indexes_async,
        applied_position as applied_position,
        applied_position_async as applied_position_async,
        become_active as become_active,
        become_standby as become_standby,
        disable_replication as disable_replication,
        enabled_vpns_async as enabled_vpns_async,
        fence_vpn as fence_vpn,
        fence_vpn_async as fence_vpn_async,
        follow_settings_async as follow_settings_async,
        followed_settings_async as followed_settings_async,
        known_epochs_async as known_epochs_async,
        ledger_progress_async as ledger_progress_async,
        ledger_start_async as ledger_start_async,
        lock_applied as lock_applied,
        lock_for_demotion as lock_for_demotion,
        lock_for_promotion as lock_for_promotion,
        lock_ledger_indexes_async as lock_ledger_indexes_async,
        lock_vpn_config as lock_vpn_config,
        lock_vpn_config_async as lock_vpn_config_async,
        mark_fenced_async as mark_fenced_async,
        raise_epoch_async as raise_epoch_async,
        read_vpn_settings as read_vpn_settings,
        record_epoch as record_epoch,
        record_first_epoch as record_first_epoch,
        record_sync_eligible_async as record_sync_eligible_async,
        reset_bridge_states_async as reset_bridge_states_async,
        role_state as role_state,
        save_vpn_settings as save_vpn_settings,
        set_applied as set_applied,
        set_applied_async as set_applied_async,
        set_bridge_state_async as set_bridge_state_async,
        stored_ledger_index as stored_ledger_index,
        vpn_status_rows as vpn_status_rows,
    )
    from ._window_recorder import WindowRecorder as WindowRecorder
    from ._window_store import (
        NEWEST_WINDOWS as NEWEST_WINDOWS,
        SyncWindow as SyncWindow,
        WindowCount as WindowCount,
        windows_by_vpn as windows_by_vpn,
    )

#: module -> the names it exports through this package, imported on first use
_IO_BOUND: dict[str, tuple[str, ...]] = {
    "._acceptor": ("TLS_SHUTDOWN_TIMEOUT", "TlsServer"),
    "._active": ("BridgeServer",),
    "._outbound": ("RepairSent",),
    "._amqp_client": ("BrokerPublisher",),
    "._apply": ("ApplyResult", "apply_entries", "apply_entries_async"),
    "._bridgestate": ("CONNECTED", "DISCONNECTED", "SYNCING"),
    "._configsync": (
        "SYNCED_TAG",
        "ConfigSyncError",
        "carry_out_deletions",
        "import_vpn_definitions",
        "reimport",
        "vpn_definitions",
    ),
    "._topology_store": ("StoredTopology", "keep_definitions_async", "stored_topology"),
    "._ledger": ("LedgerWriter", "WriterStats"),
    "._ledger_bound": ("LedgerBound",),
    "._ledger_errors": (
        "LedgerClosed",
        "LedgerConflict",
        "LedgerError",
        "LedgerPruned",
        "LedgerUnavailable",
        "UnstorableEvent",
        "VpnNotOpen",
    ),
    "._link": ("LinkClosed", "LinkError", "PeerSilent", "PeerUnreachable", "TlsRefused"),
    "._ledger_reader": ("LedgerReader",),
    "._management": ("ManagementAPI", "ManagementUnavailable"),
    "._materialise": ("MaterialiseError", "MaterialiseResult", "materialise"),
    "._receiver": ("BridgeClient",),
    "._replicator": ("Replicator", "Transactions", "commit_in_task"),
    "._roles": (
        "PromotionStart",
        "RoleError",
        "Tail",
        "TailMessage",
        "TakeoverUnknown",
        "begin_promotion",
        "demote_to_standby",
        "ensure_fenced",
        "fail_promotion",
        "finish_promotion",
        "read_tail",
    ),
    "._standby": ("LiveRow", "NotStandby", "StandbyApplier", "StandbyError", "StandbyUnavailable"),
    "._tls": ("TlsSetupError", "describe_tls_error", "make_client_context", "make_server_context"),
    "._window_recorder": ("WindowRecorder",),
    "._window_store": ("NEWEST_WINDOWS", "SyncWindow", "WindowCount", "windows_by_vpn"),
    "._vpnstore": (
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
    "RESERVED_PREFIX",
    "ConfirmKey",
    "Consumed",
    "DeadLettered",
    "Event",
    "LocalTransaction",
    "XA_TXID_PREFIX",
    "Published",
    "Purged",
    "TOPOLOGY_OPS",
    "TopologyChanged",
    "TransactionRefused",
    "Voted",
    "future_callback",
    "persistent_properties",
    "xid_of_txid",
    "FAILPOINTS",
    "UnknownFailpoint",
    "armed",
    "failpoint",
    # full-sync: what a comparison of two sites reads and decides
    "DIFFERS",
    "EXTRA_ON_STANDBY",
    "KINDS",
    "MAX_SEGMENTS",
    "MISSING_ON_STANDBY",
    "REFLECTED_INDEX",
    "ROWS_OF_KEYS",
    "Difference",
    "LiveKey",
    "compare_rows",
    "live_rows_query",
    "quote_literal",
    "row_digest_sql",
    "segment_hashes_query",
    "segment_rows_query",
    "segment_sql",
    "touched",
    # the definitions a standby holds: the listing and the streamed changes
    "DefinitionsError",
    "binding_item",
    "exchange_item",
    "merge_definitions",
    "name_item",
    "queue_item",
    "streamed_deletions",
    # the named-site rule of the bridge
    "PeerCheck",
    "certificate_names",
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
    "CAP_PURGE_POINT",
    "CAP_TAKEOVER",
    "CAP_TOPOLOGY",
    "CAP_XA_OWNER",
    "CAPABILITIES",
    "DEFAULT_MAX_FRAME_SIZE",
    "OUR_CAPABILITIES",
    "NEED_DATA",
    "PREVIOUS_PROTOCOL_VERSION",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
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
    "Repair",
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
