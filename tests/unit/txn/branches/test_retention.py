"""A branch published from its log only while its commit marker would still
be there (txn/branches/_manager.py): an older one is refused, since
publishing again could put its work in twice."""

from __future__ import annotations

import pytest

from txn.branches._manager import _markers_kept
from txn.local import CLOCK_SLACK_SECONDS, MARKER_RETENTION_SECONDS, TxnRow
from txn.xa import XaResourceError


def row(age: float) -> TxnRow:
    return TxnRow("xa/x/1.1.1.1", "v", "coordinator", "prepared", False, 0, (), xid="x", age=age)


def test_a_branch_younger_than_the_markers_retention_may_be_published() -> None:
    _markers_kept(row(MARKER_RETENTION_SECONDS - CLOCK_SLACK_SECONDS - 1))


def test_a_branch_older_than_the_markers_retention_is_refused() -> None:
    with pytest.raises(XaResourceError, match="older than the commit markers' retention"):
        _markers_kept(row(MARKER_RETENTION_SECONDS - CLOCK_SLACK_SECONDS + 1))
