"""``vpn_state``: a VPN's replication progress.

Its ledger index, applied index and epoch (on the active: what the standby
acknowledged), bridge state, ``fenced``, ``split_brain``, ``sync_eligible``
and the unknown ACKs (``sql/versions/0001_initial.py`` says what each column
means on either site); each function returns its statement
(:mod:`bridge.store._statement`). Rows are locked in one order: several
VPNs' by name (:func:`lock_ledger_indexes`), a VPN's ``vpn_config`` before
its ``vpn_state`` (:func:`lock_applied`). A few statements on the table stay
inside a larger one whose point is one snapshot and one round trip: the
ledger writer's batch (``bridge.ledger._writer``), the standby's guarded
statements (``bridge.standby._applier``, ``bridge.ledger._apply``), the
ledger's oldest retained index (``bridge.ledger._reader``) and the ending of
acknowledged transactions (``txn.local._log``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from bridge._settings import Role

from ._statement import Row, Statement, Steps, fetch_all, fetch_one, script, write

__all__ = [
    "COUNT_UNKNOWN_ACKS",
    "SPLIT_BRAIN_SQL",
    "AppliedLock",
    "LedgerStart",
    "active_ledgers",
    "add_vpn_state",
    "advance_ledger_indexes",
    "applied_position",
    "ledger_progress",
    "ledger_start",
    "lock_applied",
    "lock_ledger_indexes",
    "mark_fenced",
    "record_sync_eligible",
    "reset_bridge_states",
    "set_applied",
    "set_bridge_state",
    "stored_ledger_index",
]

_ADD_STATE = "INSERT INTO vpn_state (vpn) VALUES (%s) ON CONFLICT DO NOTHING"
_LEDGER_INDEX = "SELECT ledger_index FROM vpn_state WHERE vpn = %s"
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
#: both sites hold the VPN active at the same epoch: ``(vpn,)``
SPLIT_BRAIN_SQL = "UPDATE vpn_state SET split_brain = true WHERE vpn = %s AND NOT split_brain"


@dataclass(frozen=True, slots=True)
class LedgerStart:
    """Where an active VPN's ledger and live state stand in the database."""

    vpn: str
    epoch: int
    #: the last durable ledger entry
    ledger_index: int
    #: the last entry ``live_message`` reflects (0 without a vpn_live_state row)
    live_index: int

    @classmethod
    def from_row(cls, row: Row) -> LedgerStart:
        """The columns of :data:`_LEDGER_STARTS`, in order."""
        name, epoch, ledger, live = row
        return cls(str(name), int(epoch), int(ledger), int(live))


@dataclass(frozen=True, slots=True)
class AppliedLock:
    """A VPN's ``vpn_state`` row, locked for a standby apply."""

    applied_index: int
    applied_epoch: int
    role: Role

    @classmethod
    def from_row(cls, row: Row) -> AppliedLock:
        """The columns of :data:`_LOCK_APPLIED`, in order."""
        return cls(int(row[0]), int(row[1]), Role(row[2]))


def _int_pair(row: Row) -> tuple[int, int]:
    return int(row[0]), int(row[1])


def add_vpn_state(vpn: str) -> Statement[None]:
    """Give ``vpn`` its ``vpn_state`` row (nothing applied), if it has none."""
    return write(_ADD_STATE, (vpn,))


def stored_ledger_index(vpn: str) -> Statement[int]:
    """``vpn``'s stored ledger index (0 when it has no ``vpn_state`` row)."""
    return Statement(
        _LEDGER_INDEX, (vpn,), lambda result: int(result.rows[0][0]) if result.rows else 0
    )


def active_ledgers() -> Statement[list[LedgerStart]]:
    """Every enabled active VPN's ledger and live index."""
    return fetch_all(_ACTIVE_LEDGERS, None, LedgerStart.from_row)


def ledger_start(vpn: str) -> Statement[LedgerStart | None]:
    """``vpn``'s ledger and live index, whatever its role; None when unknown."""
    return fetch_one(_LEDGER_START, (vpn,), LedgerStart.from_row)


def lock_ledger_indexes(vpns: Iterable[str]) -> Statement[dict[str, int]]:
    """Lock the ``vpn_state`` rows of ``vpns`` in name order; their ledger
    indexes (a VPN without a row is missing)."""
    return Statement(
        _LOCK_LEDGER_INDEXES,
        (sorted(vpns),),
        lambda result: {str(vpn): int(idx) for vpn, idx in result.rows},
    )


def advance_ledger_indexes(indexes: Mapping[str, int]) -> Statement[None]:
    """Set the ledger index of each VPN in ``indexes``."""
    return write(_ADVANCE_LEDGER_INDEXES, (list(indexes), list(indexes.values())))


@script
def lock_applied(vpn: str) -> Steps[AppliedLock | None]:
    """Lock ``vpn``'s ``vpn_state`` row; its applied index and epoch and
    the VPN's role. None when it has none.

    The ``vpn_config`` row is share-locked first, by a statement of its
    own, in the order a promotion locks the two
    (:func:`~bridge.store._vpn_role.lock_for_promotion`): an apply that
    waited for a promotion then reads the role it left. With the state row
    alone locked, PostgreSQL re-read that row after the wait but took the
    role from the statement's first snapshot: ``standby``, and the stream
    was applied into a VPN already active."""
    yield write(_SHARE_CONFIG, (vpn,))
    found: AppliedLock | None = yield fetch_one(_LOCK_APPLIED, (vpn,), AppliedLock.from_row)
    return found


def set_applied(vpn: str, index: int, epoch: int) -> Statement[None]:
    """Record ``index`` of ``epoch`` as applied (a standby) or acknowledged
    by the standby (the active)."""
    return write(_SET_APPLIED, (index, epoch, vpn))


def applied_position(vpn: str) -> Statement[tuple[int, int] | None]:
    """``vpn``'s applied index and epoch; None when it has no ``vpn_state`` row."""
    return fetch_one(_APPLIED_POSITION, (vpn,), _int_pair)


def ledger_progress(vpn: str) -> Statement[tuple[int, int] | None]:
    """``vpn``'s ledger index and applied index; None when it has no
    ``vpn_state`` row."""
    return fetch_one(_PROGRESS, (vpn,), _int_pair)


def set_bridge_state(vpn: str, state: str) -> Statement[None]:
    """Record the state of ``vpn``'s bridge link (``connected``, ...)."""
    return write(_SET_BRIDGE_STATE, (state, vpn))


def reset_bridge_states(role: Role) -> Statement[None]:
    """Record every VPN of ``role`` as ``disconnected`` (a process starting
    over: no link is up yet)."""
    return write(_RESET_BRIDGE_STATES, (role.value,))


def mark_fenced(vpn: str) -> Statement[None]:
    """Record ``vpn`` as fenced (a standby knows a newer epoch)."""
    return write(_MARK_FENCED, (vpn,))


def record_sync_eligible(vpn: str, eligible: bool) -> Statement[None]:
    """Record whether ``vpn``'s sync-mode confirms wait for the standby."""
    return write(_SYNC_ELIGIBLE, (eligible, vpn))
