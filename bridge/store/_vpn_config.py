"""``vpn_config``: a VPN's replication settings, its role and its epoch.

``sql/versions/0001_initial.py`` says what each column means. Each
function here returns the one statement on the row (see
:mod:`bridge.store._statement`: run blocking or on asyncio, in the caller's
transaction). The role changes that write this row with ``vpn_state`` are
in :mod:`bridge.store._vpn_role`, the reads that join the two in
:mod:`bridge.store._vpn_views`, a standby's stored definitions (the
``definitions`` columns) in :mod:`bridge.store._topology`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from bridge._settings import Role, VpnSettings
from bridge.wire import VpnResource

from ._statement import Row, Statement, fetch_one, write

__all__ = [
    "ConfigLock",
    "FollowedSettings",
    "add_standby_vpn",
    "disable_replication",
    "known_epochs",
    "lock_vpn_config",
    "raise_epoch",
    "read_followed_settings",
    "read_vpn_settings",
    "save_followed_settings",
    "save_vpn_settings",
    "settings_of",
]

_LOCK_CONFIG = "SELECT role, enabled, epoch FROM vpn_config WHERE name = %s FOR UPDATE"
_SAVE_SETTINGS = """
INSERT INTO vpn_config AS c (name, enabled, role, mode, sync_timeout_ms,
                             on_sync_timeout, queue_patterns, topic_filters,
                             expose_id)
VALUES (%(name)s, true, %(role)s, %(mode)s, %(timeout)s, %(policy)s,
        %(queues)s, %(topics)s, %(expose_id)s)
ON CONFLICT (name) DO UPDATE SET
    enabled = true, role = EXCLUDED.role, mode = EXCLUDED.mode,
    sync_timeout_ms = EXCLUDED.sync_timeout_ms,
    on_sync_timeout = EXCLUDED.on_sync_timeout,
    queue_patterns = EXCLUDED.queue_patterns,
    topic_filters = EXCLUDED.topic_filters,
    expose_id = EXCLUDED.expose_id,
    updated_at = now()
"""
_ADD_STANDBY = """
INSERT INTO vpn_config (name, enabled, role, epoch, mode, sync_timeout_ms, on_sync_timeout,
                        queue_patterns, topic_filters, expose_id)
VALUES (%s, true, 'standby', %s, %s, %s, %s, %s, %s, %s)
"""
_DISABLE = "UPDATE vpn_config SET enabled = false, updated_at = now() WHERE name = %s AND enabled"
_READ_SETTINGS = """
SELECT name, role, mode, sync_timeout_ms, on_sync_timeout, queue_patterns, topic_filters,
       expose_id
FROM vpn_config WHERE name = %s
"""
_READ_FOLLOWED = """
SELECT mode, sync_timeout_ms, on_sync_timeout, queue_patterns, topic_filters, expose_id
FROM vpn_config WHERE name = %s
"""
_SAVE_FOLLOWED = """
UPDATE vpn_config SET mode = %s, sync_timeout_ms = %s, on_sync_timeout = %s, queue_patterns = %s,
                      topic_filters = %s, expose_id = %s, updated_at = now()
WHERE name = %s
"""
_KNOWN_EPOCHS = "SELECT name, epoch FROM vpn_config"
_RAISE_EPOCH = "UPDATE vpn_config SET epoch = %s, updated_at = now() WHERE name = %s AND epoch < %s"


@dataclass(frozen=True, slots=True)
class ConfigLock:
    """A VPN's ``vpn_config`` row, locked for the caller's transaction."""

    role: Role
    enabled: bool
    epoch: int

    @classmethod
    def from_row(cls, row: Row) -> ConfigLock:
        """The columns of :data:`_LOCK_CONFIG`, in order."""
        role, enabled, epoch = row
        return cls(Role(role), bool(enabled), int(epoch))


@dataclass(frozen=True, slots=True)
class FollowedSettings:
    """The settings of a standby VPN that follow the active's at every
    listing, in ``vpn_config``'s column order."""

    mode: str
    sync_timeout_ms: int
    on_sync_timeout: str
    queue_patterns: tuple[str, ...]
    topic_filters: tuple[str, ...]
    expose_id: bool

    @classmethod
    def of(cls, resource: VpnResource) -> FollowedSettings:
        """The settings the active listed."""
        return cls(
            resource.mode.value,
            resource.sync_timeout_ms,
            resource.on_sync_timeout.value,
            tuple(resource.queue_patterns),
            tuple(str(t) for t in resource.topic_filters),
            resource.expose_id,
        )

    @classmethod
    def from_row(cls, row: Row) -> FollowedSettings:
        """The columns of :data:`_READ_FOLLOWED`, in order."""
        mode, timeout, policy, queues, topics, expose_id = row
        return cls(
            str(mode), int(timeout), str(policy), tuple(queues), tuple(topics), bool(expose_id)
        )

    def changes(self, listed: FollowedSettings) -> list[str]:
        """``name old -> new`` for each setting ``listed`` changes."""
        names = [f.name for f in fields(self)]
        pairs = zip(names, self._params(), listed._params(), strict=True)
        return [f"{name} {old!r} -> {new!r}" for name, old, new in pairs if old != new]

    def _params(self) -> tuple[Any, ...]:
        """The values as statement parameters (arrays as lists), in column order."""
        return (
            self.mode,
            self.sync_timeout_ms,
            self.on_sync_timeout,
            list(self.queue_patterns),
            list(self.topic_filters),
            self.expose_id,
        )


def settings_of(row: Sequence[Any]) -> VpnSettings:
    """A ``VpnSettings`` from the columns of :data:`_READ_SETTINGS`, in order
    (the joined reads select them first too)."""
    name, role, mode, timeout, policy, queues, topics, expose_id = row
    return VpnSettings.from_args(
        name, role, mode, timeout, policy, tuple(queues), tuple(topics), expose_id
    )


def lock_vpn_config(vpn: str) -> Statement[ConfigLock | None]:
    """Lock ``vpn``'s ``vpn_config`` row; None when there is none."""
    return fetch_one(_LOCK_CONFIG, (vpn,), ConfigLock.from_row)


def save_vpn_settings(s: VpnSettings) -> Statement[None]:
    """Insert or update ``s`` as ``vpn_config`` row, enabled (the epoch of
    an existing row is kept; a new row starts at epoch 1)."""
    return write(
        _SAVE_SETTINGS,
        {
            "name": s.name,
            "role": s.role.value,
            "mode": s.mode.value,
            "timeout": s.sync_timeout_ms,
            "policy": s.on_sync_timeout.value,
            "queues": list(s.queue_patterns),
            "topics": [str(t) for t in s.topic_filters],
            "expose_id": s.expose_id,
        },
    )


def add_standby_vpn(vpn: str, epoch: int, settings: FollowedSettings) -> Statement[None]:
    """Insert ``vpn`` as an enabled standby at ``epoch`` (a VPN the active
    listed that this site did not know)."""
    return write(_ADD_STANDBY, (vpn, epoch, *settings._params()))


def disable_replication(vpn: str) -> Statement[bool]:
    """Stop replicating ``vpn``; False when it was not enabled."""
    return Statement(_DISABLE, (vpn,), lambda result: result.rowcount > 0)


def read_vpn_settings(vpn: str) -> Statement[VpnSettings | None]:
    """``vpn``'s stored settings (enabled or not); None when unknown."""
    return fetch_one(_READ_SETTINGS, (vpn,), settings_of)


def read_followed_settings(vpn: str) -> Statement[FollowedSettings | None]:
    """The stored settings of ``vpn`` that follow the active's; None when unknown."""
    return fetch_one(_READ_FOLLOWED, (vpn,), FollowedSettings.from_row)


def save_followed_settings(vpn: str, settings: FollowedSettings) -> Statement[None]:
    """Store ``settings`` as ``vpn``'s (the active's, listed)."""
    return write(_SAVE_FOLLOWED, (*settings._params(), vpn))


def known_epochs() -> Statement[dict[str, int]]:
    """Every VPN's epoch on this site, enabled or not."""
    return Statement(_KNOWN_EPOCHS, None, lambda result: {str(n): int(e) for n, e in result.rows})


def raise_epoch(vpn: str, epoch: int) -> Statement[None]:
    """Raise ``vpn``'s epoch to ``epoch``; a higher one stays."""
    return write(_RAISE_EPOCH, (epoch, vpn, epoch))
