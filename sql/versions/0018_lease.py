"""``lease``: which node of a site leads, and under which term.

Several nodes may serve one site; one at a time leads it (writes its
ledger, decides its transactions, runs its bridge). A lease is named by its
``scope``: ``site`` is the site's whole work, the scope every node of this
release takes. ``holder`` names the node process (its name and a
generation, so a node that lost the lease and takes it again is a new
holder); ``term`` rises each time the lease changes hands and fences what an
earlier holder still tries to write; ``expires_at`` is judged by this
database's clock for a taker, while the holder judges its own lease on its
monotonic clock from before each renewal (``bridge/store/_lease.py``).
``node_heartbeat`` is each node's last sign of life, whether it leads or
relays (``vpnrepl nodes``).

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

_UPGRADE = """
CREATE TABLE lease (
    scope             text PRIMARY KEY,
    holder            text NOT NULL,
    term              bigint NOT NULL CHECK (term > 0),
    expires_at        timestamptz NOT NULL,
    taken_at          timestamptz NOT NULL DEFAULT now(),
    renewed_at        timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE node_heartbeat (
    node              text PRIMARY KEY,
    holder            text NOT NULL,
    leads             boolean NOT NULL,
    seen_at           timestamptz NOT NULL DEFAULT now()
);
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute("DROP TABLE node_heartbeat")
    op.execute("DROP TABLE lease")
