"""The reads that join a VPN's rows: ``vpn_config`` with ``vpn_state``, and
the promotion, epoch and transaction rows beside them.

What the node loads at its start, what the bridge lists to standbys, what
``vpnrepl status`` shows and the role an operator's command checks. They
lock nothing. Each function here returns its statement (see
:mod:`bridge.store._statement`).
"""

from __future__ import annotations

from dataclasses import dataclass

from bridge._settings import Role, VpnSettings

from ._statement import Row, Statement, fetch_all, fetch_one, maybe_int
from ._vpn_config import settings_of

__all__ = [
    "ActiveVpn",
    "EnabledVpn",
    "RoleState",
    "VpnStatus",
    "active_vpns",
    "enabled_vpns",
    "role_state",
    "vpn_status_rows",
]

_ROLE_STATE = """
SELECT c.role, s.fenced, s.bridge_state, s.applied_index
FROM vpn_config c JOIN vpn_state s ON s.vpn = c.name
WHERE c.name = %s AND c.enabled
"""
_ENABLED_VPNS = """
SELECT c.name, c.role, c.mode, c.sync_timeout_ms, c.on_sync_timeout,
       c.queue_patterns, c.topic_filters, c.expose_id, s.applied_index, s.fenced,
       p.state, e.epoch, e.site
FROM vpn_config c JOIN vpn_state s ON s.vpn = c.name
LEFT JOIN promotion p ON p.vpn = c.name
LEFT JOIN LATERAL (SELECT epoch, site FROM vpn_epoch WHERE vpn = c.name
                   ORDER BY epoch DESC LIMIT 1) e ON true
WHERE c.enabled ORDER BY c.name
"""
_ACTIVE_VPNS = """
SELECT c.name, c.role, c.mode, c.sync_timeout_ms, c.on_sync_timeout,
       c.queue_patterns, c.topic_filters, c.expose_id, c.epoch,
       COALESCE((SELECT taken_over_at FROM vpn_epoch e WHERE e.vpn = c.name
                 AND e.epoch = c.epoch), 0)
FROM vpn_config c JOIN vpn_state s ON s.vpn = c.name
WHERE c.enabled AND c.role = 'active' AND NOT s.fenced
  AND NOT EXISTS (SELECT 1 FROM promotion p WHERE p.vpn = c.name AND p.state <> 'done')
ORDER BY c.name
"""
_STATUS = """
SELECT c.name, c.role, c.epoch, c.mode, c.sync_timeout_ms, c.on_sync_timeout,
       c.queue_patterns, c.topic_filters, c.expose_id,
       s.sync_eligible, s.fenced, s.bridge_state, s.ledger_index, s.applied_index,
       s.unknown_acks,
       COALESCE(EXTRACT(EPOCH FROM (now() - s.applied_at)), 0)::float8,
       (SELECT count(*) FROM txn_log t
         WHERE t.vpn = c.name AND t.state = 'prepared'),
       (SELECT count(*) FROM txn_log t WHERE t.vpn = c.name AND t.degraded
         AND t.state = 'committed')
FROM vpn_config c JOIN vpn_state s ON s.vpn = c.name
WHERE c.enabled
ORDER BY c.name
"""


@dataclass(frozen=True, slots=True)
class RoleState:
    """An enabled VPN's role and where its bridge stands."""

    role: Role
    fenced: bool
    bridge_state: str
    applied_index: int

    @classmethod
    def from_row(cls, row: Row) -> RoleState:
        """The columns of :data:`_ROLE_STATE`, in order."""
        return cls(Role(row[0]), bool(row[1]), str(row[2]), int(row[3]))


@dataclass(frozen=True, slots=True)
class EnabledVpn:
    """An enabled VPN as the node loads it."""

    settings: VpnSettings
    applied_index: int
    fenced: bool
    #: the state of its last promotion (None: never promoted here)
    promotion: str | None
    #: its newest epoch and the site that took it (None: no history)
    newest_epoch: int | None
    newest_site: str | None

    @classmethod
    def from_row(cls, r: Row) -> EnabledVpn:
        """The columns of :data:`_ENABLED_VPNS`, in order."""
        return cls(settings_of(r[:8]), int(r[8]), bool(r[9]), r[10], maybe_int(r[11]), r[12])


@dataclass(frozen=True, slots=True)
class ActiveVpn:
    """An enabled, unfenced active VPN whose promotion (if any) is done:
    what the bridge lists to standbys."""

    settings: VpnSettings
    epoch: int
    #: the index of the previous epoch's ledger it was taken over at (0: never)
    taken_over_at: int

    @classmethod
    def from_row(cls, row: Row) -> ActiveVpn:
        """The columns of :data:`_ACTIVE_VPNS`, in order."""
        return cls(settings_of(row[:8]), int(row[8]), int(row[9]))


@dataclass(frozen=True, slots=True)
class VpnStatus:
    """An enabled VPN's settings, progress and transactions, for ``status``."""

    name: str
    role: Role
    epoch: int
    mode: str
    sync_timeout_ms: int
    on_sync_timeout: str
    queue_patterns: list[str]
    topic_filters: list[str]
    expose_id: bool
    sync_eligible: bool
    fenced: bool
    bridge_state: str
    ledger_index: int
    applied_index: int
    unknown_acks: int
    #: seconds since the applied index last moved (0 when it never did)
    since_applied: float
    in_doubt_txns: int
    degraded_txns: int

    @classmethod
    def from_row(cls, row: Row) -> VpnStatus:
        """The columns of :data:`_STATUS`, in order."""
        return cls(row[0], Role(row[1]), *row[2:])


def role_state(vpn: str) -> Statement[RoleState | None]:
    """``vpn``'s role and bridge state; None when it is not enabled here."""
    return fetch_one(_ROLE_STATE, (vpn,), RoleState.from_row)


def enabled_vpns() -> Statement[list[EnabledVpn]]:
    """Every enabled VPN, by name."""
    return fetch_all(_ENABLED_VPNS, None, EnabledVpn.from_row)


def active_vpns() -> Statement[list[ActiveVpn]]:
    """The VPNs the bridge lists to standbys (see :class:`ActiveVpn`), by name."""
    return fetch_all(_ACTIVE_VPNS, None, ActiveVpn.from_row)


def vpn_status_rows() -> Statement[list[VpnStatus]]:
    """Every enabled VPN's status, by name."""
    return fetch_all(_STATUS, None, VpnStatus.from_row)
