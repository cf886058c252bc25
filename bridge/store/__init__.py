"""The site database's per-VPN rows, as statements.

One module per stored entity: ``vpn_config`` (settings, role, epoch),
``vpn_state`` (progress), ``vpn_epoch`` (the epoch history), the role
changes that write them together, the reads that join them, the
sync-ineligible windows, a standby's stored definitions, and the bridge's
stream states (:class:`BridgeStateWriter`). Each function returns a
:class:`Statement` (or a :class:`Script`), its SQL written once and run on
the caller's connection and transaction, blocking or on asyncio.
"""

from __future__ import annotations

from ._bridgestate import (
    CONNECTED,
    DISCONNECTED,
    SYNCING,
    BridgeStateWriter,
    Pool,
    open_pool,
    reset_states,
)
from ._lease import (
    FENCE,
    SITE,
    Fence,
    HeldLease,
    beat,
    end_sessions,
    heartbeats,
    holds_term,
    lease_of,
    release_lease,
    renew_lease,
    session_name,
    take_lease,
)
from ._statement import Script, Statement
from ._sync_window import (
    SyncWindow,
    add_window,
    close_left_open,
    close_window,
    open_window,
    windows_by_vpn,
)
from ._topology import keep_definitions, stored_topology
from ._vpn_config import (
    ConfigLock,
    FollowedSettings,
    add_standby_vpn,
    disable_replication,
    known_epochs,
    lock_vpn_config,
    raise_epoch,
    read_followed_settings,
    read_vpn_settings,
    save_followed_settings,
    save_vpn_settings,
)
from ._vpn_epoch import epoch_taken, record_epoch, record_first_epoch
from ._vpn_role import (
    become_active,
    become_standby,
    fence_vpn,
    lock_for_demotion,
    lock_for_promotion,
)
from ._vpn_state import (
    COUNT_UNKNOWN_ACKS,
    SPLIT_BRAIN_SQL,
    active_ledgers,
    add_vpn_state,
    advance_ledger_indexes,
    applied_position,
    ledger_progress,
    ledger_start,
    lock_applied,
    lock_ledger_indexes,
    mark_fenced,
    record_sync_eligible,
    reset_bridge_states,
    set_applied,
    set_bridge_state,
    stored_ledger_index,
)
from ._vpn_views import active_vpns, enabled_vpns, role_state, vpn_status_rows

__all__ = [
    "BridgeStateWriter",
    "FENCE",
    "SITE",
    "Fence",
    "HeldLease",
    "beat",
    "end_sessions",
    "heartbeats",
    "holds_term",
    "session_name",
    "lease_of",
    "release_lease",
    "renew_lease",
    "take_lease",
    "CONNECTED",
    "COUNT_UNKNOWN_ACKS",
    "ConfigLock",
    "DISCONNECTED",
    "FollowedSettings",
    "Pool",
    "SPLIT_BRAIN_SQL",
    "SYNCING",
    "Script",
    "Statement",
    "SyncWindow",
    "active_ledgers",
    "active_vpns",
    "add_standby_vpn",
    "add_vpn_state",
    "add_window",
    "advance_ledger_indexes",
    "applied_position",
    "become_active",
    "become_standby",
    "close_left_open",
    "close_window",
    "disable_replication",
    "enabled_vpns",
    "epoch_taken",
    "fence_vpn",
    "keep_definitions",
    "known_epochs",
    "ledger_progress",
    "ledger_start",
    "lock_applied",
    "lock_for_demotion",
    "lock_for_promotion",
    "lock_ledger_indexes",
    "lock_vpn_config",
    "mark_fenced",
    "open_pool",
    "open_window",
    "raise_epoch",
    "read_followed_settings",
    "read_vpn_settings",
    "record_epoch",
    "record_first_epoch",
    "record_sync_eligible",
    "reset_bridge_states",
    "reset_states",
    "role_state",
    "save_followed_settings",
    "save_vpn_settings",
    "set_applied",
    "set_bridge_state",
    "stored_ledger_index",
    "stored_topology",
    "vpn_status_rows",
    "windows_by_vpn",
]
