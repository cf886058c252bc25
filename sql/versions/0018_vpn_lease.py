"""``vpn_lease``: which node of a site leads each VPN, and under which term.

Several nodes may serve one site; one at a time leads a VPN (writes its
ledger, decides its transactions). ``holder`` names the node process
(its name and incarnation, so a restarted node is a new holder); ``term``
rises each time the lease changes hands and fences what an earlier holder
still tries to write; ``expires_at`` is judged by this database's clock
for a taker, while the holder judges its own lease on its monotonic clock
from before each renewal (``bridge/store/_vpn_lease.py``).

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
CREATE TABLE vpn_lease (
    vpn               text PRIMARY KEY REFERENCES vpn_config(name) ON DELETE CASCADE,
    holder            text NOT NULL,
    term              bigint NOT NULL CHECK (term > 0),
    expires_at        timestamptz NOT NULL,
    taken_at          timestamptz NOT NULL DEFAULT now(),
    renewed_at        timestamptz NOT NULL DEFAULT now()
);
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute("DROP TABLE vpn_lease")
