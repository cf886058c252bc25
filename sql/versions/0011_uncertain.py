"""Uncertain publishes.

``uncertain_publish``: a replicated publish (per queue) whose broker
confirm never came because the client's broker connection died without a
close (``plugin.node._uncertain``). The broker may not hold it; ``status``
counts the ones still live, and ``vpnrepl reconcile --repair`` retires
those the broker's drift shows it does not hold.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_UPGRADE = """
CREATE TABLE uncertain_publish (
    vpn               text NOT NULL REFERENCES vpn_config(name) ON DELETE CASCADE,
    queue             text NOT NULL,
    repl_id           bytea NOT NULL,
    recorded_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (vpn, queue, repl_id)
);
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute("DROP TABLE uncertain_publish")
