"""The ledger-index ranges a sync VPN confirmed without its standby.

``sync_window``: one row per *sync-ineligible window* of an active VPN —
from the first ledger index the node confirmed without the standby's
acknowledgement (the sync timeout under ``--on-sync-timeout degrade``, or
a local transaction the coordinator degraded) to the last such index.
The row is written with ``last_index`` and ``closed_at`` NULL *before*
the first of those confirms goes out (``bridge/active/_syncgate.py`` holds them
until then), and closed when the standby has caught up; a window a crash
left open is closed at the VPN's ledger index by the next node start (the
node confirms nothing past its durable ledger). A confirmed message
missing after a promotion is excused only when its old-active ledger
index lies inside one of these windows (``docs/behaviour.md``).

Keyed by the epoch as well: a site's ledger indexes start again at the
take-over index when it is promoted, so an index alone may repeat across
its epochs. Only the owner (the node's role) reads or writes the table:
reconcile and a switchover, the peer's role's work, never need it, so
any privilege a default grant may have given another role is revoked.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

from alembic import op

from sql._grants import revoke_from_others

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

_UPGRADE = """
CREATE TABLE sync_window (
    vpn               text NOT NULL REFERENCES vpn_config(name) ON DELETE CASCADE,
    epoch             bigint NOT NULL,
    first_index       bigint NOT NULL CHECK (first_index >= 1),
    last_index        bigint CHECK (last_index >= first_index),
    opened_at         timestamptz NOT NULL DEFAULT now(),
    closed_at         timestamptz,
    CHECK ((last_index IS NULL) = (closed_at IS NULL)),
    PRIMARY KEY (vpn, epoch, first_index)
);
REVOKE ALL ON sync_window FROM PUBLIC;
-- a role given privileges on new tables (ALTER DEFAULT PRIVILEGES) gets none here
"""


def upgrade() -> None:
    op.execute(_UPGRADE)
    op.execute(revoke_from_others("sync_window"))


def downgrade() -> None:
    op.execute("DROP TABLE sync_window")
