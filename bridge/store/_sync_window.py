"""The sync-ineligible windows of the site database (``sync_window``).

A window is a range of an active VPN's ledger indexes this site confirmed
without its standby (docs/behaviour.md, "Sync-ineligible windows"). Each
function returns its statement (:mod:`bridge.store._statement`); each is
idempotent, so a writer that lost a reply runs it again. A window carries
the epoch ``vpn_config`` holds when it is written: the epoch the ledger
entries are written with, which changes only with the VPN's role, never
while it confirms.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ._statement import Result, Row, Statement, fetch_all, write

__all__ = [
    "NEWEST_WINDOWS",
    "SyncWindow",
    "WindowCount",
    "add_window",
    "close_left_open",
    "close_window",
    "open_window",
    "windows_by_vpn",
]

#: how many windows per VPN the status document lists
NEWEST_WINDOWS = 10

_OPEN = """
INSERT INTO sync_window (vpn, epoch, first_index)
SELECT name, epoch, %(first)s FROM vpn_config WHERE name = %(vpn)s
ON CONFLICT (vpn, epoch, first_index) DO NOTHING
"""
# at most one window of a VPN is open: the sync gate's (a crash's is
# closed at the next start, a demotion's by the demotion)
_CLOSE = """
UPDATE sync_window SET last_index = %(last)s, closed_at = now()
WHERE vpn = %(vpn)s AND first_index = %(first)s AND last_index IS NULL
"""
# a degraded transaction: its group, opened and closed at once
_ADD = """
INSERT INTO sync_window (vpn, epoch, first_index, last_index, closed_at)
SELECT name, epoch, %(first)s, %(last)s, now() FROM vpn_config WHERE name = %(vpn)s
ON CONFLICT (vpn, epoch, first_index) DO NOTHING
"""
# The restart rule: a window still open was left by a crash (or a stop
# that could not record its end); nothing was confirmed past the VPN's
# durable ledger index, so it ends there. (Never below its first index: a
# ledger index reset to 0 by a demotion of an older release is no bound.)
_CLOSE_LEFT_OPEN = """
UPDATE sync_window w SET last_index = GREATEST(s.ledger_index, w.first_index), closed_at = now()
FROM vpn_state s
WHERE s.vpn = w.vpn AND w.last_index IS NULL AND (%(vpn)s::text IS NULL OR w.vpn = %(vpn)s)
RETURNING w.vpn, w.epoch, w.first_index, w.last_index, w.opened_at, w.closed_at
"""
_NEWEST = """
SELECT vpn, epoch, first_index, last_index, opened_at, closed_at, total FROM (
    SELECT w.*, count(*) OVER (PARTITION BY vpn) AS total,
           row_number() OVER (PARTITION BY vpn ORDER BY epoch DESC, first_index DESC) AS n
    FROM sync_window w) t
WHERE n <= %s
ORDER BY vpn, epoch DESC, first_index DESC
"""


@dataclass(frozen=True, slots=True)
class SyncWindow:
    """Ledger indexes ``first``..``last`` of ``vpn`` at ``epoch`` were
    confirmed without the standby (``last`` None: still open)."""

    vpn: str
    epoch: int
    first: int
    last: int | None
    opened_at: datetime
    closed_at: datetime | None

    def as_dict(self) -> dict[str, Any]:
        """The window in the ``status --json`` document."""
        return {
            "epoch": self.epoch,
            "first_index": self.first,
            "last_index": self.last,
            "opened_at": self.opened_at.isoformat(),
            "closed_at": None if self.closed_at is None else self.closed_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class WindowCount:
    """A VPN's windows: how many were recorded, and the newest."""

    total: int
    newest: tuple[SyncWindow, ...]


def _window(row: Row) -> SyncWindow:
    vpn, epoch, first, last, opened_at, closed_at = row[:6]
    return SyncWindow(
        vpn, int(epoch), int(first), None if last is None else int(last), opened_at, closed_at
    )


def open_window(vpn: str, first: int) -> Statement[None]:
    """Record that ``vpn`` confirms without the standby from ``first`` on."""
    return write(_OPEN, {"vpn": vpn, "first": first})


def close_window(vpn: str, first: int, last: int) -> Statement[None]:
    """End ``vpn``'s open window from ``first`` at ``last`` (a window already
    closed is left as it is)."""
    return write(_CLOSE, {"vpn": vpn, "first": first, "last": last})


def add_window(vpn: str, first: int, last: int) -> Statement[None]:
    """Record ``first``..``last`` as confirmed without the standby at once
    (a degraded transaction's group)."""
    return write(_ADD, {"vpn": vpn, "first": first, "last": last})


def close_left_open(vpn: str | None = None) -> Statement[list[SyncWindow]]:
    """Close every window left open at the VPN's ledger index, or ``vpn``'s
    alone; the windows closed. Every VPN's at the node's start, before it
    confirms anything; a demotion's VPN before its ledger index is reset."""
    return fetch_all(_CLOSE_LEFT_OPEN, {"vpn": vpn}, _window)


def windows_by_vpn(newest: int = NEWEST_WINDOWS) -> Statement[dict[str, WindowCount]]:
    """Per VPN with windows: their number and the ``newest`` of them, the
    latest first (by epoch, then first index)."""
    return Statement(_NEWEST, (newest,), _count_windows)


def _count_windows(result: Result) -> dict[str, WindowCount]:
    out: dict[str, tuple[int, list[SyncWindow]]] = {}
    for row in result.rows:
        total, windows = out.setdefault(row[0], (int(row[6]), []))
        windows.append(_window(row))
    return {vpn: WindowCount(total, tuple(windows)) for vpn, (total, windows) in out.items()}
