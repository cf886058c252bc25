"""Who may hold the site, and who owns an XA branch.

``site_lock``: an empty table whose ``EXCLUSIVE`` lock a running node (or
the CLI acting without one) holds for as long as it runs. It replaces the
advisory lock of earlier releases, which any role that could connect was
able to take, and so keep the node from starting: ``LOCK TABLE`` in this
mode needs ``UPDATE``, ``DELETE`` or ``TRUNCATE`` on the table, which only
its owner (the node's role) has. A role without them is refused before it
waits; a plain ``SELECT`` (granted to no one but the owner either) would
take only ``ACCESS SHARE``, which the lock lets through.

``txn_log.xa_owner``: the broker user that started an XA branch (on the
active's coordinator row, and on the standby's participant row from the
prepare frame); only that user may end, prepare, commit, roll back, recover
or forget the branch. NULL on rows written before this revision: such a
branch is anyone's, as before.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_UPGRADE = """
CREATE TABLE site_lock ();
REVOKE ALL ON site_lock FROM PUBLIC;
ALTER TABLE txn_log ADD COLUMN xa_owner text;
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute("ALTER TABLE txn_log DROP COLUMN xa_owner; DROP TABLE site_lock")
