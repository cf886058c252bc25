"""Replication between sites, and the vocabulary every layer shares.

The bottom layer (``plugin`` → ``txn`` → ``bridge``): it imports nothing of
ours. This package's own names are the vocabulary, without I/O: VPN
settings, roles and modes; replication ids and events; the ledger entry
and its encoding; a VPN's definitions items; what reconcile compares; the bridge's
errors; the crash
failpoints. Importing it loads neither asyncio, sockets nor psycopg.

The replication itself is in subpackages, each with its names in its own
``__init__``: ``wire`` (the bridge protocol, sans-IO), ``link`` (its
transport), ``amqp`` (AMQP 0-9-1 without I/O, for the listener and the
node's broker client), ``store`` (the site
database's per-VPN rows), ``ledger`` (the active's ledger and the apply
step), ``broker`` (the management API and config-sync), ``roles``
(promotion, fencing, demotion), ``active`` and ``standby`` (the bridge's
two ends).
"""

from __future__ import annotations

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
from ._ids import (
    COUNTER_LIMIT,
    INCARNATION_LIMIT,
    RENEW_MARGIN,
    REPLICATION_HEADER,
    IdsExhausted,
    IdSource,
    ReplicationId,
    id_in_header,
)
from ._reconcile import (
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

__all__ = [
    "BadChecksum",
    "BadFrame",
    "BridgeError",
    "COUNTER_LIMIT",
    "ConfirmKey",
    "Consumed",
    "DEFAULT_SYNC_TIMEOUT_MS",
    "DIFFERS",
    "DeadLettered",
    "DefinitionsError",
    "Difference",
    "ERROR_CODES",
    "EVENT_KINDS",
    "EXTRA_ON_STANDBY",
    "Event",
    "EventDecodeError",
    "FAILPOINTS",
    "Fenced",
    "Gap",
    "HostPort",
    "INCARNATION_LIMIT",
    "IdSource",
    "IdsExhausted",
    "InvalidSettings",
    "KINDS",
    "LedgerEntry",
    "LiveKey",
    "LocalProtocolError",
    "LocalTransaction",
    "MARKER_QUEUE",
    "MAX_SEGMENTS",
    "MISSING_ON_STANDBY",
    "Mode",
    "PeerFailure",
    "Published",
    "Purged",
    "REFLECTED_INDEX",
    "RENEW_MARGIN",
    "REPLICATION_HEADER",
    "RESERVED_PREFIX",
    "ROWS_OF_KEYS",
    "RemoteProtocolError",
    "ReplicationId",
    "Role",
    "RoleConflict",
    "StaleEpoch",
    "SyncTimeoutPolicy",
    "TOPOLOGY_OPS",
    "TlsConfig",
    "TopicFilter",
    "TopologyChanged",
    "TransactionRefused",
    "Unauthorised",
    "UnexpectedFrame",
    "UnknownFailpoint",
    "UnknownVpn",
    "VersionMismatch",
    "Voted",
    "VpnSettings",
    "armed",
    "binding_item",
    "compare_rows",
    "decode_event",
    "encode_event",
    "exchange_item",
    "failpoint",
    "future_callback",
    "id_in_header",
    "live_rows_query",
    "merge_definitions",
    "name_item",
    "queue_item",
    "quote_literal",
    "redact_url",
    "row_digest_sql",
    "segment_hashes_query",
    "segment_rows_query",
    "segment_sql",
    "split_events",
    "streamed_deletions",
    "touched",
    "xid_of_txid",
]
