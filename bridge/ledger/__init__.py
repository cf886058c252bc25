"""The active's ledger and the one apply step of both sites.

The ledger writer (events in listener order, queued and group-committed;
its live-state applier), its reader for replay and pruning, its bound, the
store retry its commits use, and the apply step that turns ledger entries
into ``live_message`` rows on either site.
"""

from __future__ import annotations

from ._apply import (
    DELETE_ACKED,
    GuardedApply,
    GuardedTemplate,
    apply_entries,
    apply_entries_async,
    guarded_apply,
    guarded_template,
    run_guarded,
    run_guarded_async,
)
from ._arrays import bytea_array, text_array
from ._bound import LedgerBound
from ._errors import (
    LedgerClosed,
    LedgerError,
    LedgerFenced,
    LedgerPruned,
    UnstorableEvent,
    VpnNotOpen,
    describe_error,
)
from ._reader import LedgerReader
from ._retry import retry_log_level, retry_store
from ._writer import LedgerWriter, WriterStats

__all__ = [
    "DELETE_ACKED",
    "GuardedApply",
    "GuardedTemplate",
    "LedgerBound",
    "LedgerClosed",
    "LedgerError",
    "LedgerFenced",
    "LedgerPruned",
    "LedgerReader",
    "LedgerWriter",
    "UnstorableEvent",
    "VpnNotOpen",
    "WriterStats",
    "apply_entries",
    "apply_entries_async",
    "bytea_array",
    "describe_error",
    "guarded_apply",
    "guarded_template",
    "retry_log_level",
    "retry_store",
    "run_guarded",
    "run_guarded_async",
    "text_array",
]
