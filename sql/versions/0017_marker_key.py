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
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT grantee FROM information_schema.role_table_grants
             WHERE table_schema = current_schema() AND table_name = 'marker_key'
               AND grantee <> current_user
    LOOP
        EXECUTE 'REVOKE ALL ON marker_key FROM '
            || CASE WHEN r.grantee = 'PUBLIC' THEN 'PUBLIC' ELSE quote_ident(r.grantee) END;
    END LOOP;
END
$$;
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute("DROP TABLE marker_key")
