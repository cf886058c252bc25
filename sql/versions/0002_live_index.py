"""The active's live-state index: ``live_message`` is applied after the ledger.

The ledger writer commits a batch of ledger rows (which is what makes a
confirm durable) and applies the batch to ``live_message`` in a following
transaction, so the confirm does not wait for the apply. ``live_index`` is
the last ledger entry ``live_message`` reflects; it is stored in the same
transaction as the apply's effects (which makes the apply exactly-once, as
``applied_index`` does on a standby) and lets the writer catch
``live_message`` up from the ledger after a crash between the two
transactions.

A table of its own rather than a column of ``vpn_state``: the ledger commit
updates ``vpn_state.ledger_index`` in every batch, and two transactions
updating one row wait for each other, so the apply would hold the next
ledger commit (the confirm path) back.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_UPGRADE = """
-- On the active: live_message reflects ledger entries 1..live_index (the rest
-- of the ledger is applied by the writer, or at its next start). Unused on a
-- standby, whose live_message reflects vpn_state.applied_index.
CREATE TABLE vpn_live_state (
    vpn               text PRIMARY KEY REFERENCES vpn_config(name) ON DELETE CASCADE,
    live_index        bigint NOT NULL DEFAULT 0 CHECK (live_index >= 0)
);
-- Until now the ledger writer applied every batch in the transaction that
-- stored it: the live state reflects the whole ledger.
INSERT INTO vpn_live_state (vpn, live_index) SELECT vpn, ledger_index FROM vpn_state;
"""

_DOWNGRADE = """
DROP TABLE vpn_live_state;
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute(_DOWNGRADE)
