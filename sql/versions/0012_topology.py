"""Topology changes in the stream.

``topology_change``: on a standby, each topology change (declare, delete,
bind, unbind) that came through the active's listener, at its ledger
index, kept until a listing of the definitions taken after it arrives.
``vpn_config.definitions_index``: the active's durable ledger index when it
read the stored listing (NULL: the active did not say, a protocol 5 one).
A promotion imports the listing with the changes above that index
(``bridge._definitions``).

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_UPGRADE = """
ALTER TABLE vpn_config ADD COLUMN definitions_index bigint;
CREATE TABLE topology_change (
    vpn               text NOT NULL REFERENCES vpn_config(name) ON DELETE CASCADE,
    ledger_index      bigint NOT NULL,
    event             bytea NOT NULL,
    PRIMARY KEY (vpn, ledger_index)
);
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute("DROP TABLE topology_change; ALTER TABLE vpn_config DROP COLUMN definitions_index")
