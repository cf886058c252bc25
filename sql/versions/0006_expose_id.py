"""Per VPN: whether consumers see the replication id header.

The listener removes ``x-vpnrepl-id`` from every message it hands a client,
so consumers see the properties exactly as the publisher sent them;
``vpn enable --expose-id`` keeps it visible (tracing). Existing VPNs keep
the default, hidden.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE vpn_config ADD COLUMN expose_id boolean NOT NULL DEFAULT false")


def downgrade() -> None:
    op.execute("ALTER TABLE vpn_config DROP COLUMN expose_id")
