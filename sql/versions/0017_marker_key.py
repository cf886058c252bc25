"""The site's commit-marker key: markers only the node can make.

``marker_key``: one row, the secret with which the listener tags each
commit marker (``txn/_marker_key.py``) and recovery checks them, so a
message a client routed into the marker queue (a ``CC`` header naming it)
is no marker. ``signs_from`` is the first node incarnation that tags its
markers: an untagged marker of an earlier incarnation (a node of an
earlier release, running while the schema was upgraded) is still believed.

The secret is 32 bytes of ``gen_random_uuid()`` (PostgreSQL's strong random
source; 244 random bits). Only the owner (the node's role) reads the table:
any privilege a default grant gave another role is revoked.

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

from alembic import op

from sql._grants import revoke_from_others

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

_UPGRADE = """
CREATE TABLE marker_key (
    one               boolean PRIMARY KEY DEFAULT true CHECK (one),
    secret            bytea NOT NULL CHECK (length(secret) = 32),
    signs_from        bigint NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now()
);
INSERT INTO marker_key (secret, signs_from)
SELECT decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex'),
       coalesce((SELECT max(incarnation) FROM node_incarnation), 0) + 1;
REVOKE ALL ON marker_key FROM PUBLIC;
"""


def upgrade() -> None:
    op.execute(_UPGRADE)
    op.execute(revoke_from_others("marker_key"))


def downgrade() -> None:
    op.execute("DROP TABLE marker_key")
