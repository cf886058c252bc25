"""A VPN's role changes: the statements of a promotion, a demotion and a fence.

A role change writes ``vpn_config`` (role, epoch), ``vpn_state`` (what
the VPN has applied or confirmed) and the epoch history together, in the
caller's transaction (``bridge/roles/_roles.py`` drives them). Its locks
are taken in one order, every caller's: a VPN's ``vpn_config`` row before
its ``vpn_state`` row, by one statement (``FOR UPDATE OF c, s``). Each
function here returns a statement or a script (see
:mod:`bridge.store._statement`).
"""

from __future__ import annotations

from dataclasses import dataclass

from bridge._settings import Role

from ._statement import Row, Statement, Steps, changed, fetch_one, maybe_int, script, write
from ._vpn_epoch import record_epoch

__all__ = [
    "DemotionLock",
    "PromotionLock",
    "become_active",
    "become_standby",
    "fence_vpn",
    "lock_for_demotion",
    "lock_for_promotion",
]

_LOCK_FOR_PROMOTION = """
SELECT c.role, c.enabled, c.epoch, s.fenced, s.applied_index, p.state, p.epoch
FROM vpn_config c JOIN vpn_state s ON s.vpn = c.name
LEFT JOIN promotion p ON p.vpn = c.name
WHERE c.name = %s
FOR UPDATE OF c, s
"""
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
# fence this site's active VPN for a higher epoch (a row changed: newly fenced)
# a split brain when this site confirmed past the index the other took over
# at (0: not known, nothing claimed)
_FENCE = """
UPDATE vpn_state s SET fenced = true, updated_at = now(),
    split_brain = s.split_brain OR (%(taken)s > 0 AND s.ledger_index > %(taken)s)
FROM vpn_config c
WHERE s.vpn = c.name AND c.name = %(vpn)s AND c.role = 'active' AND c.epoch < %(epoch)s
  AND NOT s.fenced
"""
# a fence learnt first without the take-over index (a standby's report of
# a newer epoch), then with it (the peer's listing): the split brain the
# index shows is recorded all the same
_FENCED_SPLIT = """
UPDATE vpn_state SET split_brain = true, updated_at = now()
WHERE vpn = %(vpn)s AND fenced AND NOT split_brain AND %(taken)s > 0
  AND ledger_index > %(taken)s
"""
_LOCK_FOR_DEMOTION = """
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

    @classmethod
    def from_row(cls, row: Row) -> PromotionLock:
        """The columns of :data:`_LOCK_FOR_PROMOTION`, in order."""
        role, enabled, epoch, fenced, applied, promotion, promotion_epoch = row
        return cls(
            Role(role),
            bool(enabled),
            int(epoch),
            bool(fenced),
            int(applied),
            promotion,
            maybe_int(promotion_epoch),
        )


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

    @classmethod
    def from_row(cls, row: Row) -> DemotionLock:
        """The columns of :data:`_LOCK_FOR_DEMOTION`, in order."""
        role, enabled, fenced, ledger, live, epoch, taken_over_at, own_epoch = row
        return cls(
            Role(role),
            bool(enabled),
            bool(fenced),
            int(ledger),
            int(live or 0),
            maybe_int(epoch),
            maybe_int(taken_over_at),
            int(own_epoch),
        )


def lock_for_promotion(vpn: str) -> Statement[PromotionLock | None]:
    """Lock ``vpn``'s ``vpn_config`` and ``vpn_state`` rows; None when unknown."""
    return fetch_one(_LOCK_FOR_PROMOTION, (vpn,), PromotionLock.from_row)


def lock_for_demotion(vpn: str) -> Statement[DemotionLock | None]:
    """Lock ``vpn``'s ``vpn_config`` and ``vpn_state`` rows; None when unknown."""
    return fetch_one(_LOCK_FOR_DEMOTION, (vpn,), DemotionLock.from_row)


@script
def become_active(vpn: str, epoch: int, ledger_index: int) -> Steps[None]:
    """Make ``vpn`` active at ``epoch``, its ledger continuing after
    ``ledger_index`` and nothing acknowledged by a standby yet: the config
    row, then the state row."""
    yield write(_BECOME_ACTIVE, (epoch, vpn))
    yield write(_ACTIVE_STATE, (ledger_index, vpn))


@script
def become_standby(vpn: str, epoch: int) -> Steps[None]:
    """Make ``vpn`` a standby of ``epoch`` (or its higher own) with nothing
    applied: the config row, then the state row."""
    yield write(_BECOME_STANDBY, (epoch, vpn))
    yield write(_FORGET_TOPOLOGY, (vpn,))
    yield write(_STANDBY_STATE, (vpn,))


@script
def fence_vpn(vpn: str, epoch: int, site: str, taken_over_at: int = 0) -> Steps[bool]:
    """``site`` holds ``vpn`` active at the higher ``epoch``: this site's
    active VPN is fenced (``vpn_state``), then the epoch recorded. True
    when it was not fenced before."""
    params = {"vpn": vpn, "epoch": epoch, "taken": taken_over_at}
    newly: bool = (yield changed(_FENCE, params)) == 1
    if not newly and taken_over_at:
        yield write(_FENCED_SPLIT, params)
    yield record_epoch(vpn, epoch, site, taken_over_at)
    return newly
