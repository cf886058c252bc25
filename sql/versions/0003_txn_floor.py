"""Transactions: where the coordinator's decision can be found in the ledger.

``ledger_floor`` is the VPN's ledger index when the coordinator prepared the
transaction; ``ledger_last`` the last index of its group once decided (a
degraded transaction ends when the standby has acknowledged it). The
decision to commit is the transaction's events appended to the ledger as one
group, after that index; recovery of a prepared row looks
for them there (``txn/local/_recovery.py``), so a crash between the ledger
commit and the row's update to ``committed`` cannot turn a commit into an
abort.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "ALTER TABLE txn_log ADD COLUMN ledger_floor bigint NOT NULL DEFAULT 0"
        " CHECK (ledger_floor >= 0),"
        " ADD COLUMN ledger_last bigint NOT NULL DEFAULT 0 CHECK (ledger_last >= 0)"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE txn_log DROP COLUMN ledger_floor, DROP COLUMN ledger_last")
