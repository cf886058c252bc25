"""The ledger's errors, shared by its writer, live-state applier and reader.

One root (:class:`LedgerError`, a :class:`~bridge._errors.BridgeError`), so
a caller of any of the three catches one class; each subclass says what the
caller should do (retry later, stop, ship a checkpoint, open the VPN).
Database errors are translated where they happen, and
:func:`describe_error` renders them without statement data, so no message
body or parameter reaches a log line.
"""

from __future__ import annotations

import psycopg

from bridge._errors import BridgeError

__all__ = [
    "LedgerClosed",
    "LedgerConflict",
    "LedgerError",
    "LedgerFenced",
    "LedgerPruned",
    "LedgerUnavailable",
    "UnstorableEvent",
    "VpnNotOpen",
    "describe_error",
]


class LedgerError(BridgeError):
    """Root of the ledger's errors."""


class LedgerUnavailable(LedgerError):
    """The site database could not be reached for a ledger read or at start."""


class LedgerClosed(LedgerError):
    """The writer is not running (not started, closing, or stopped by a failure)."""


class LedgerConflict(LedgerError):
    """The stored ledger does not continue what this writer holds: a second
    writer, or a database restored behind the writer's back. Fatal."""


class LedgerFenced(LedgerError):
    """The lease this writer writes under is not the site's any more:
    another node took over, and this one must write nothing more. Fatal."""


class VpnNotOpen(LedgerError, LookupError):
    """No ledger is open for this VPN on this writer (see
    :meth:`~bridge.ledger._writer.LedgerWriter.open_vpn`)."""


class UnstorableEvent(LedgerError, ValueError):
    """An event that could never be committed (refused before it takes an index)."""


class LedgerPruned(LedgerError):
    """The requested start of a replay is no longer retained: ship a checkpoint."""

    def __init__(self, vpn: str, from_index: int, oldest: int) -> None:
        super().__init__(f"ledger index {from_index} was pruned (oldest retained is {oldest})", vpn)
        self.from_index, self.oldest = from_index, oldest


def describe_error(e: BaseException) -> str:
    """An error in one line, without statement data (COPY contexts quote rows)."""
    if isinstance(e, psycopg.Error):
        text = e.diag.message_primary or (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {text}"
    return f"{type(e).__name__}: {e}"
