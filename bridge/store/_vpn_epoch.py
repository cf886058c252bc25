"""``vpn_epoch``: which site took which epoch of a VPN, and where.

A VPN's epoch rises with each promotion; its history records the site
that took each epoch and the index of the previous epoch's ledger it took
it over at, so a fenced active can tell whether it confirmed past that
index (a split brain). An epoch is recorded in the transaction that takes
or learns it (a promotion, a fence: :mod:`bridge.store._vpn_role`). Each
function here returns its statement (see :mod:`bridge.store._statement`).
"""

from __future__ import annotations

from ._statement import Statement, fetch_one, write

__all__ = ["epoch_taken", "record_epoch", "record_first_epoch"]

# record an epoch, the site holding it, and where it took over
_RECORD_EPOCH = """
INSERT INTO vpn_epoch (vpn, epoch, site, taken_over_at) VALUES (%s, %s, %s, %s)
ON CONFLICT (vpn, epoch) DO UPDATE SET site = EXCLUDED.site, taken_over_at = EXCLUDED.taken_over_at
"""
_EPOCH_TAKEN = "SELECT site, taken_over_at FROM vpn_epoch WHERE vpn = %s AND epoch = %s"
_FIRST_EPOCH = """
INSERT INTO vpn_epoch (vpn, epoch, site) SELECT name, epoch, %s FROM vpn_config
WHERE name = %s AND role = 'active' ON CONFLICT DO NOTHING
"""


def record_epoch(vpn: str, epoch: int, site: str, taken_over_at: int) -> Statement[None]:
    """Record that ``site`` holds ``vpn`` at ``epoch``, taken over at
    ``taken_over_at`` of the previous epoch's ledger."""
    return write(_RECORD_EPOCH, (vpn, epoch, site, taken_over_at))


def epoch_taken(vpn: str, epoch: int) -> Statement[tuple[str, int] | None]:
    """The site that took ``vpn`` at ``epoch`` and the index it took it
    over at, from the epoch history; None when the history lacks it."""
    return fetch_one(_EPOCH_TAKEN, (vpn, epoch), lambda row: (str(row[0]), int(row[1])))


def record_first_epoch(vpn: str, site: str) -> Statement[None]:
    """Start ``vpn``'s epoch history with ``site`` holding it, if it is
    active and has none."""
    return write(_FIRST_EPOCH, (site, vpn))
