"""``txn_log``'s prune finds the rows past their retention through an index.

The sweep (``txn/local/_log.py``, every few minutes) deletes the rows of
transactions over on both sites once their ``updated_at`` is older than the
retention (an hour). Without an index on ``updated_at`` each sweep read the
whole table: every transaction of the last hour. ``txn_log_prunable`` is
that index, partial on exactly the sweep's condition on the state (the
predicate must stay the query's, or PostgreSQL cannot use it), so rows
still undecided or unacknowledged are not in it.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_UPGRADE = """
CREATE INDEX txn_log_prunable ON txn_log (updated_at)
WHERE heuristic IS NULL
  AND (state IN ('ended', 'aborted') OR (side = 'participant' AND state = 'committed'))
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute("DROP INDEX txn_log_prunable")
