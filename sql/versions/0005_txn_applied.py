"""Transactions: a participant row can be ``applied`` ahead of the stream.

A sync-mode VPN's standby commits a transaction from its prepared row as
soon as the active says the broker committed (``TxnCommit``), while the
active's ledger write runs; the row moves ``prepared`` → ``applied`` in the
same database transaction as the effects, and ``ledger_floor`` holds the
index before the group as the active assigned it. When the group's copy
arrives with the ledger stream it is skipped, and the row moves on to
``committed`` (``bridge/standby/_early.py``).

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_STATES = "('prepared', 'applied', 'committed', 'aborted', 'ended')"
_OLD_STATES = "('prepared', 'committed', 'aborted', 'ended')"


def upgrade() -> None:
    op.execute(
        "ALTER TABLE txn_log DROP CONSTRAINT txn_log_state_check,"
        f" ADD CONSTRAINT txn_log_state_check CHECK (state IN {_STATES})"
    )


def downgrade() -> None:
    # An applied row's effects are in live_message already: it is committed.
    op.execute("UPDATE txn_log SET state = 'committed' WHERE state = 'applied'")
    op.execute(
        "ALTER TABLE txn_log DROP CONSTRAINT txn_log_state_check,"
        f" ADD CONSTRAINT txn_log_state_check CHECK (state IN {_OLD_STATES})"
    )
