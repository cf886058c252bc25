"""The per-VPN rows of the site database: ``vpn_config`` and ``vpn_state``.

``vpn_config`` holds a VPN's replication settings, role and fencing epoch;
``vpn_state`` its replication progress (``sql/versions/0001_initial.py``
says what each column means on the active and on a standby). Every
statement on them is a named, parameterised constant here, and each has a
small typed function, blocking (psycopg's synchronous API: the CLI, the role
changes, the standby applier) or ``..._async`` (the node and the bridge on
the event loop).

Invariant: a function here never opens a connection or a transaction of
its own, never commits and never sets an isolation level. It runs its
statements on the caller's connection, in the caller's transaction, in the
order its docstring gives, so the caller alone decides what commits
together and in which order rows are locked. The locking reads keep the
order every caller relies on: a VPN's ``vpn_config`` row before its
``vpn_state`` row (one statement, ``FOR UPDATE OF c, s``), and several
VPNs' ``vpn_state`` rows in name order. Reads use cursors of their own with
tuple rows, whatever row factory the caller's connection has.

A few statements that touch these tables stay with the statement they are
part of, because one statement (one snapshot, one round trip) is their
point: the ledger writer's batch (``bridge/ledger/_writer.py``: the rows and
``ledger_index`` in one statement), the standby's guarded statements
(``bridge/standby/_applier.py``, ``bridge/ledger/_apply.py``: gate, row move and apply in
one), the ledger's oldest retained index (``bridge/ledger/_reader.py``) and
the ending of acknowledged transactions (``txn/local/_log.py``).

The vpn_epoch history (which site took which epoch, where) is written here
too: it is always written with the epoch it records.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from bridge._settings import Role, VpnSettings
from bridge.wire import VpnResource

__all__ = [
    "COUNT_UNKNOWN_ACKS",
    "EPOCH_SQL",
    "FENCE_SQL",
    "SPLIT_BRAIN_SQL",
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
    "epoch_taken_async",
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
]

_Conn = psycopg.Connection[Any]
_AsyncConn = psycopg.AsyncConnection[Any]


# ---------------------------------------------------------------- settings

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
_FOLLOWED = """
SELECT mode, sync_timeout_ms, on_sync_timeout, queue_patterns, topic_filters, expose_id
FROM vpn_config WHERE name = %s
"""
_FOLLOW = """
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


def _maybe_int(value: Any) -> int | None:
    """An integer column of an outer join (None where it found no row)."""
    return None if value is None else int(value)


def _settings(row: Sequence[Any]) -> VpnSettings:
    """A ``VpnSettings`` from the columns of :data:`_READ_SETTINGS`, in order."""
    name, role, mode, timeout, policy, queues, topics, expose_id = row
    return VpnSettings.from_args(
        name, role, mode, timeout, policy, tuple(queues), tuple(topics), expose_id
    )


def lock_vpn_config(conn: _Conn, vpn: str) -> ConfigLock | None:
    """Lock ``vpn``'s ``vpn_config`` row; None when there is none."""
    with conn.cursor(row_factory=tuple_row) as cur:
        row = cur.execute(_LOCK_CONFIG, (vpn,)).fetchone()
    return None if row is None else ConfigLock(Role(row[0]), bool(row[1]), int(row[2]))


async def lock_vpn_config_async(conn: _AsyncConn, vpn: str) -> ConfigLock | None:
    """:func:`lock_vpn_config` on an asyncio connection."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(_LOCK_CONFIG, (vpn,))
        row = await cur.fetchone()
    return None if row is None else ConfigLock(Role(row[0]), bool(row[1]), int(row[2]))


def save_vpn_settings(conn: _Conn, s: VpnSettings) -> None:
    """Insert or update ``s`` as ``vpn_config`` row, enabled (the epoch of
    an existing row is kept; a new row starts at epoch 1)."""
    conn.execute(
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


async def add_standby_vpn_async(
    conn: _AsyncConn, vpn: str, epoch: int, settings: FollowedSettings
) -> None:
    """Insert ``vpn`` as an enabled standby at ``epoch`` (a VPN the active
    listed that this site did not know)."""
    await conn.execute(_ADD_STANDBY, (vpn, epoch, *settings._params()))


def disable_replication(conn: _Conn, vpn: str) -> bool:
    """Stop replicating ``vpn``; False when it was not enabled."""
    return conn.execute(_DISABLE, (vpn,)).rowcount > 0


def read_vpn_settings(conn: _Conn, vpn: str) -> VpnSettings | None:
    """``vpn``'s stored settings (enabled or not); None when unknown."""
    with conn.cursor(row_factory=tuple_row) as cur:
        row = cur.execute(_READ_SETTINGS, (vpn,)).fetchone()
    return None if row is None else _settings(row)


async def followed_settings_async(conn: _AsyncConn, vpn: str) -> FollowedSettings | None:
    """The stored settings of ``vpn`` that follow the active's."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(_FOLLOWED, (vpn,))
        row = await cur.fetchone()
    if row is None:
        return None
    mode, timeout, policy, queues, topics, expose_id = row
    return FollowedSettings(
        str(mode), int(timeout), str(policy), tuple(queues), tuple(topics), bool(expose_id)
    )


async def follow_settings_async(conn: _AsyncConn, vpn: str, settings: FollowedSettings) -> None:
    """Store ``settings`` as ``vpn``'s (the active's, listed)."""
    await conn.execute(_FOLLOW, (*settings._params(), vpn))


async def known_epochs_async(conn: _AsyncConn) -> dict[str, int]:
    """Every VPN's epoch on this site, enabled or not."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(_KNOWN_EPOCHS)
        return {str(name): int(epoch) for name, epoch in await cur.fetchall()}


async def raise_epoch_async(conn: _AsyncConn, vpn: str, epoch: int) -> None:
    """Raise ``vpn``'s epoch to ``epoch``; a higher one stays."""
    await conn.execute(_RAISE_EPOCH, (epoch, vpn, epoch))


# ---------------------------------------------------------------- roles and epochs

_LOCK_FOR_PROMOTION = """
SELECT c.role, c.enabled, c.epoch, s.fenced, s.applied_index, p.state, p.epoch
FROM vpn_config c JOIN vpn_state s ON s.vpn = c.name
LEFT JOIN promotion p ON p.vpn = c.name
WHERE c.name = %s
FOR UPDATE OF c, s
"""
_LEDGER_INDEX = "SELECT ledger_index FROM vpn_state WHERE vpn = %s"
_BECOME_ACTIVE = """
UPDATE vpn_config SET role = 'active', epoch = %s, updated_at = now() WHERE name = %s
"""
# On the active, applied_index is what its standby acknowledged: nothing yet.
_ACTIVE_STATE = """
UPDATE vpn_state SET ledger_index = %s, applied_index = 0, applied_epoch = 0, applied_at = NULL,
    fenced = false, split_brain = false, sync_eligible = true, bridge_state = 'disconnected',
    updated_at = now()
WHERE vpn = %s
"""
# (the definitions it held as a standby before are forgotten: the new
# active's first listing replaces them, whatever its ledger index)
_BECOME_STANDBY = """
UPDATE vpn_config SET role = 'standby', epoch = GREATEST(epoch, %s), definitions_index = NULL,
    updated_at = now()
WHERE name = %s
"""
_FORGET_TOPOLOGY = "DELETE FROM topology_change WHERE vpn = %s"
# A standby has applied nothing of the epoch it follows (a checkpoint comes).
_STANDBY_STATE = """
UPDATE vpn_state SET ledger_index = 0, applied_index = 0, applied_epoch = 0, applied_at = NULL,
    fenced = false, split_brain = false, sync_eligible = true, bridge_state = 'disconnected',
    updated_at = now()
WHERE vpn = %s
"""
#: fence this site's active VPN for a higher epoch (a row changed: newly fenced)
# a split brain when this site confirmed past the index the other took over
# at (0: not known, nothing claimed)
FENCE_SQL = """
UPDATE vpn_state s SET fenced = true, updated_at = now(),
    split_brain = s.split_brain OR (%(taken)s > 0 AND s.ledger_index > %(taken)s)
FROM vpn_config c
WHERE s.vpn = c.name AND c.name = %(vpn)s AND c.role = 'active' AND c.epoch < %(epoch)s
  AND NOT s.fenced
"""
#: a fence learnt first without the take-over index (a standby's report of
#: a newer epoch), then with it (the peer's listing): the split brain the
#: index shows is recorded all the same
FENCED_SPLIT_SQL = """
UPDATE vpn_state SET split_brain = true, updated_at = now()
WHERE vpn = %(vpn)s AND fenced AND NOT split_brain AND %(taken)s > 0
  AND ledger_index > %(taken)s
"""
#: both sites hold the VPN active at the same epoch
SPLIT_BRAIN_SQL = "UPDATE vpn_state SET split_brain = true WHERE vpn = %s AND NOT split_brain"
#: record an epoch, the site holding it, and where it took over
EPOCH_SQL = """
INSERT INTO vpn_epoch (vpn, epoch, site, taken_over_at) VALUES (%s, %s, %s, %s)
ON CONFLICT (vpn, epoch) DO UPDATE SET site = EXCLUDED.site, taken_over_at = EXCLUDED.taken_over_at
"""
_EPOCH_TAKEN = "SELECT site, taken_over_at FROM vpn_epoch WHERE vpn = %s AND epoch = %s"
_FIRST_EPOCH = """
INSERT INTO vpn_epoch (vpn, epoch, site) SELECT name, epoch, %s FROM vpn_config
WHERE name = %s AND role = 'active' ON CONFLICT DO NOTHING
"""
_LOCK_FENCED = """
SELECT c.role, c.enabled, s.fenced, s.ledger_index, l.live_index, e.epoch, e.taken_over_at,
       c.epoch
FROM vpn_config c JOIN vpn_state s ON s.vpn = c.name
LEFT JOIN vpn_live_state l ON l.vpn = c.name
LEFT JOIN LATERAL (SELECT epoch, taken_over_at FROM vpn_epoch WHERE vpn = c.name
                   ORDER BY epoch DESC LIMIT 1) e ON true
WHERE c.name = %s
FOR UPDATE OF c, s
"""


@dataclass(frozen=True, slots=True)
class PromotionLock:
    """A VPN's rows as a promotion finds them, locked (config, then state)."""

    role: Role
    enabled: bool
    epoch: int
    fenced: bool
    applied_index: int
    #: the state and epoch of its last promotion (None: never promoted)
    promotion: str | None
    promotion_epoch: int | None


@dataclass(frozen=True, slots=True)
class DemotionLock:
    """A VPN's rows as a demotion finds them, locked (config, then state),
    with its live index and its newest epoch."""

    role: Role
    enabled: bool
    fenced: bool
    ledger_index: int
    live_index: int
    #: the newest epoch recorded, and where it took over (None: no history)
    epoch: int | None
    taken_over_at: int | None
    #: the epoch this site holds the VPN at (a fence records the newer one
    #: once it knows where it took over)
    own_epoch: int = 0


def lock_for_promotion(conn: _Conn, vpn: str) -> PromotionLock | None:
    """Lock ``vpn``'s ``vpn_config`` and ``vpn_state`` rows; None when unknown."""
    with conn.cursor(row_factory=tuple_row) as cur:
        row = cur.execute(_LOCK_FOR_PROMOTION, (vpn,)).fetchone()
    if row is None:
        return None
    role, enabled, epoch, fenced, applied, promotion, promotion_epoch = row
    return PromotionLock(
        Role(role),
        bool(enabled),
        int(epoch),
        bool(fenced),
        int(applied),
        promotion,
        _maybe_int(promotion_epoch),
    )


def stored_ledger_index(conn: _Conn, vpn: str) -> int:
    """``vpn``'s stored ledger index (0 when it has no ``vpn_state`` row)."""
    with conn.cursor(row_factory=tuple_row) as cur:
        row = cur.execute(_LEDGER_INDEX, (vpn,)).fetchone()
    return 0 if row is None else int(row[0])


def become_active(conn: _Conn, vpn: str, epoch: int, ledger_index: int) -> None:
    """Make ``vpn`` active at ``epoch``, its ledger continuing after
    ``ledger_index`` and nothing acknowledged by a standby yet: the config
    row, then the state row."""
    conn.execute(_BECOME_ACTIVE, (epoch, vpn))
    conn.execute(_ACTIVE_STATE, (ledger_index, vpn))


def become_standby(conn: _Conn, vpn: str, epoch: int) -> None:
    """Make ``vpn`` a standby of ``epoch`` (or its higher own) with nothing
    applied: the config row, then the state row."""
    conn.execute(_BECOME_STANDBY, (epoch, vpn))
    conn.execute(_FORGET_TOPOLOGY, (vpn,))
    conn.execute(_STANDBY_STATE, (vpn,))


def record_epoch(conn: _Conn, vpn: str, epoch: int, site: str, taken_over_at: int) -> None:
    """Record that ``site`` holds ``vpn`` at ``epoch``, taken over at
    ``taken_over_at`` of the previous epoch's ledger."""
    conn.execute(EPOCH_SQL, (vpn, epoch, site, taken_over_at))


async def epoch_taken_async(conn: _AsyncConn, vpn: str, epoch: int) -> tuple[str, int] | None:
    """The site that took ``vpn`` at ``epoch`` and the index it took it
    over at, from the epoch history; None when the history lacks it."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(_EPOCH_TAKEN, (vpn, epoch))
        row = await cur.fetchone()
    return None if row is None else (str(row[0]), int(row[1]))


def record_first_epoch(conn: _Conn, vpn: str, site: str) -> None:
    """Start ``vpn``'s epoch history with ``site`` holding it, if it is
    active and has none."""
    conn.execute(_FIRST_EPOCH, (site, vpn))


def fence_vpn(conn: _Conn, vpn: str, epoch: int, site: str, taken_over_at: int = 0) -> bool:
    """``site`` holds ``vpn`` active at the higher ``epoch``: this site's
    active VPN is fenced (``vpn_state``), then the epoch recorded. True
    when it was not fenced before."""
    params = {"vpn": vpn, "epoch": epoch, "taken": taken_over_at}
    newly = conn.execute(FENCE_SQL, params).rowcount == 1
    if not newly and taken_over_at:
        conn.execute(FENCED_SPLIT_SQL, params)
    record_epoch(conn, vpn, epoch, site, taken_over_at)
    return newly


async def fence_vpn_async(
    conn: _AsyncConn, vpn: str, epoch: int, site: str, taken_over_at: int = 0
) -> bool:
    """:func:`fence_vpn` on an asyncio connection."""
    params = {"vpn": vpn, "epoch": epoch, "taken": taken_over_at}
    cur = await conn.execute(FENCE_SQL, params)
    newly = cur.rowcount == 1
    if not newly and taken_over_at:
        await conn.execute(FENCED_SPLIT_SQL, params)
    await conn.execute(EPOCH_SQL, (vpn, epoch, site, taken_over_at))
    return newly


def lock_for_demotion(conn: _Conn, vpn: str) -> DemotionLock | None:
    """Lock ``vpn``'s ``vpn_config`` and ``vpn_state`` rows; None when unknown."""
    with conn.cursor(row_factory=tuple_row) as cur:
        row = cur.execute(_LOCK_FENCED, (vpn,)).fetchone()
    if row is None:
        return None
    role, enabled, fenced, ledger, live, epoch, taken_over_at, own_epoch = row
    return DemotionLock(
        Role(role),
        bool(enabled),
        bool(fenced),
        int(ledger),
        int(live or 0),
        _maybe_int(epoch),
        _maybe_int(taken_over_at),
        int(own_epoch),
    )


# ---------------------------------------------------------------- progress

_ADD_STATE = "INSERT INTO vpn_state (vpn) VALUES (%s) ON CONFLICT DO NOTHING"
_LEDGER_STARTS = """
SELECT c.name, c.epoch, s.ledger_index, COALESCE(l.live_index, 0)
FROM vpn_config c JOIN vpn_state s ON s.vpn = c.name
LEFT JOIN vpn_live_state l ON l.vpn = c.name
"""
_ACTIVE_LEDGERS = _LEDGER_STARTS + "WHERE c.enabled AND c.role = 'active'"
_LEDGER_START = _LEDGER_STARTS + "WHERE c.name = %s"
_LOCK_LEDGER_INDEXES = """
SELECT vpn, ledger_index FROM vpn_state WHERE vpn = ANY(%s) ORDER BY vpn FOR UPDATE
"""
_ADVANCE_LEDGER_INDEXES = """
UPDATE vpn_state s SET ledger_index = v.idx, updated_at = now()
FROM unnest(%s::text[], %s::int8[]) AS v(vpn, idx)
WHERE s.vpn = v.vpn
"""
_SHARE_CONFIG = "SELECT 1 FROM vpn_config WHERE name = %s FOR SHARE"
_LOCK_APPLIED = """
SELECT s.applied_index, s.applied_epoch, c.role
FROM vpn_state s JOIN vpn_config c ON c.name = s.vpn
WHERE s.vpn = %s
FOR UPDATE OF s
"""
_SET_APPLIED = """
UPDATE vpn_state
SET applied_index = %s, applied_epoch = %s, applied_at = now(), updated_at = now()
WHERE vpn = %s
"""
_APPLIED_POSITION = "SELECT applied_index, applied_epoch FROM vpn_state WHERE vpn = %s"
_PROGRESS = "SELECT ledger_index, applied_index FROM vpn_state WHERE vpn = %s"
_SET_BRIDGE_STATE = "UPDATE vpn_state SET bridge_state = %s, updated_at = now() WHERE vpn = %s"
_RESET_BRIDGE_STATES = """
UPDATE vpn_state s SET bridge_state = 'disconnected', updated_at = now()
FROM vpn_config c
WHERE c.name = s.vpn AND c.role = %s AND s.bridge_state <> 'disconnected'
"""
_MARK_FENCED = "UPDATE vpn_state SET fenced = true, updated_at = now() WHERE vpn = %s"
_SYNC_ELIGIBLE = "UPDATE vpn_state SET sync_eligible = %s, updated_at = now() WHERE vpn = %s"
#: count ``n`` ACKs of messages the live state never held: ``(n, vpn)``
COUNT_UNKNOWN_ACKS = (
    "UPDATE vpn_state SET unknown_acks = unknown_acks + %s, updated_at = now() WHERE vpn = %s"
)


@dataclass(frozen=True, slots=True)
class LedgerStart:
    """Where an active VPN's ledger and live state stand in the database."""

    vpn: str
    epoch: int
    #: the last durable ledger entry
    ledger_index: int
    #: the last entry ``live_message`` reflects (0 without a vpn_live_state row)
    live_index: int


@dataclass(frozen=True, slots=True)
class AppliedLock:
    """A VPN's ``vpn_state`` row, locked for a standby apply."""

    applied_index: int
    applied_epoch: int
    role: Role


def add_vpn_state(conn: _Conn, vpn: str) -> None:
    """Give ``vpn`` its ``vpn_state`` row (nothing applied), if it has none."""
    conn.execute(_ADD_STATE, (vpn,))


async def add_vpn_state_async(conn: _AsyncConn, vpn: str) -> None:
    """:func:`add_vpn_state` on an asyncio connection."""
    await conn.execute(_ADD_STATE, (vpn,))


def _ledger_start(row: Sequence[Any]) -> LedgerStart:
    name, epoch, ledger, live = row
    return LedgerStart(str(name), int(epoch), int(ledger), int(live))


async def active_ledgers_async(conn: _AsyncConn) -> list[LedgerStart]:
    """Every enabled active VPN's ledger and live index."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(_ACTIVE_LEDGERS)
        return [_ledger_start(row) for row in await cur.fetchall()]


async def ledger_start_async(conn: _AsyncConn, vpn: str) -> LedgerStart | None:
    """``vpn``'s ledger and live index, whatever its role; None when unknown."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(_LEDGER_START, (vpn,))
        row = await cur.fetchone()
    return None if row is None else _ledger_start(row)


async def lock_ledger_indexes_async(conn: _AsyncConn, vpns: Iterable[str]) -> dict[str, int]:
    """Lock the ``vpn_state`` rows of ``vpns`` in name order; their ledger
    indexes (a VPN without a row is missing)."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(_LOCK_LEDGER_INDEXES, (sorted(vpns),))
        return {str(vpn): int(idx) for vpn, idx in await cur.fetchall()}


async def advance_ledger_indexes_async(conn: _AsyncConn, indexes: Mapping[str, int]) -> None:
    """Set the ledger index of each VPN in ``indexes``."""
    await conn.execute(_ADVANCE_LEDGER_INDEXES, (list(indexes), list(indexes.values())))


def lock_applied(conn: _Conn, vpn: str) -> AppliedLock | None:
    """Lock ``vpn``'s ``vpn_state`` row; its applied index and epoch and
    the VPN's role. None when it has none.

    The ``vpn_config`` row is share-locked first, by a statement of its
    own, in the order a promotion locks the two (:data:`_LOCK_FOR_PROMOTION`):
    an apply that waited for a promotion then reads the role it left. With
    the state row alone locked, PostgreSQL re-read that row after the wait
    but took the role from the statement's first snapshot: ``standby``,
    and the stream was applied into a VPN already active."""
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(_SHARE_CONFIG, (vpn,))
        row = cur.execute(_LOCK_APPLIED, (vpn,)).fetchone()
    return None if row is None else AppliedLock(int(row[0]), int(row[1]), Role(row[2]))


def set_applied(conn: _Conn, vpn: str, index: int, epoch: int) -> None:
    """Record ``index`` of ``epoch`` as applied (a standby) or acknowledged
    by the standby (the active)."""
    conn.execute(_SET_APPLIED, (index, epoch, vpn))


async def set_applied_async(conn: _AsyncConn, vpn: str, index: int, epoch: int) -> None:
    """:func:`set_applied` on an asyncio connection."""
    await conn.execute(_SET_APPLIED, (index, epoch, vpn))


def applied_position(conn: _Conn, vpn: str) -> tuple[int, int] | None:
    """``vpn``'s applied index and epoch; None when it has no ``vpn_state`` row."""
    with conn.cursor(row_factory=tuple_row) as cur:
        row = cur.execute(_APPLIED_POSITION, (vpn,)).fetchone()
    return None if row is None else (int(row[0]), int(row[1]))


async def applied_position_async(conn: _AsyncConn, vpn: str) -> tuple[int, int] | None:
    """:func:`applied_position` on an asyncio connection."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(_APPLIED_POSITION, (vpn,))
        row = await cur.fetchone()
    return None if row is None else (int(row[0]), int(row[1]))


async def ledger_progress_async(conn: _AsyncConn, vpn: str) -> tuple[int, int] | None:
    """``vpn``'s ledger index and applied index; None when it has no
    ``vpn_state`` row."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(_PROGRESS, (vpn,))
        row = await cur.fetchone()
    return None if row is None else (int(row[0]), int(row[1]))


async def set_bridge_state_async(conn: _AsyncConn, vpn: str, state: str) -> None:
    """Record the state of ``vpn``'s bridge link (``connected``, ...)."""
    await conn.execute(_SET_BRIDGE_STATE, (state, vpn))


async def reset_bridge_states_async(conn: _AsyncConn, role: Role) -> None:
    """Record every VPN of ``role`` as ``disconnected`` (a process starting
    over: no link is up yet)."""
    await conn.execute(_RESET_BRIDGE_STATES, (role.value,))


async def mark_fenced_async(conn: _AsyncConn, vpn: str) -> None:
    """Record ``vpn`` as fenced (a standby knows a newer epoch)."""
    await conn.execute(_MARK_FENCED, (vpn,))


async def record_sync_eligible_async(conn: _AsyncConn, vpn: str, eligible: bool) -> None:
    """Record whether ``vpn``'s sync-mode confirms wait for the standby."""
    await conn.execute(_SYNC_ELIGIBLE, (eligible, vpn))


# ---------------------------------------------------------------- listings

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


@dataclass(frozen=True, slots=True)
class ActiveVpn:
    """An enabled, unfenced active VPN whose promotion (if any) is done:
    what the bridge lists to standbys."""

    settings: VpnSettings
    epoch: int
    #: the index of the previous epoch's ledger it was taken over at (0: never)
    taken_over_at: int


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


def role_state(conn: _Conn, vpn: str) -> RoleState | None:
    """``vpn``'s role and bridge state; None when it is not enabled here."""
    with conn.cursor(row_factory=tuple_row) as cur:
        row = cur.execute(_ROLE_STATE, (vpn,)).fetchone()
    if row is None:
        return None
    return RoleState(Role(row[0]), bool(row[1]), str(row[2]), int(row[3]))


async def enabled_vpns_async(conn: _AsyncConn) -> list[EnabledVpn]:
    """Every enabled VPN, by name."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(_ENABLED_VPNS)
        rows = await cur.fetchall()
    return [
        EnabledVpn(_settings(r[:8]), int(r[8]), bool(r[9]), r[10], _maybe_int(r[11]), r[12])
        for r in rows
    ]


async def active_vpns_async(conn: _AsyncConn) -> list[ActiveVpn]:
    """The VPNs the bridge lists to standbys (see :class:`ActiveVpn`), by name."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(_ACTIVE_VPNS)
        rows = await cur.fetchall()
    return [ActiveVpn(_settings(row[:8]), int(row[8]), int(row[9])) for row in rows]


def vpn_status_rows(conn: _Conn) -> list[VpnStatus]:
    """Every enabled VPN's status, by name."""
    with conn.cursor(row_factory=tuple_row) as cur:
        rows = cur.execute(_STATUS).fetchall()
    return [VpnStatus(row[0], Role(row[1]), *row[2:]) for row in rows]
