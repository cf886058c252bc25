"""Reconciliation runs.

``reconcile_run``: one row per ``vpnrepl reconcile`` of a VPN on this
(active) site, written when the run ends: what it compared (rows on each
site, segments, the segments that differed), what it found per kind
(``missing_on_standby``, ``extra_on_standby``, ``differs``), what it
repaired, the broker drift it saw (queue -> {broker, replicated}), how
long it took, and whether the sites agreed at its end (``agree``), still
differed (``differ``) or the run failed (``failed``, with ``error``). The
node exports the newest run of each VPN as metrics.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_UPGRADE = """
CREATE TABLE reconcile_run (
    id                  bigserial PRIMARY KEY,
    vpn                 text NOT NULL REFERENCES vpn_config(name) ON DELETE CASCADE,
    started_at          timestamptz NOT NULL,
    finished_at         timestamptz NOT NULL DEFAULT now(),
    outcome             text NOT NULL CHECK (outcome IN ('agree', 'differ', 'failed')),
    method              text NOT NULL,
    rows_active         bigint NOT NULL DEFAULT 0,
    rows_standby        bigint NOT NULL DEFAULT 0,
    segments            integer NOT NULL DEFAULT 0,
    dirty_segments      integer NOT NULL DEFAULT 0,
    missing_on_standby  bigint NOT NULL DEFAULT 0,
    extra_on_standby    bigint NOT NULL DEFAULT 0,
    differs             bigint NOT NULL DEFAULT 0,
    repaired            bigint NOT NULL DEFAULT 0,
    broker_drift        jsonb NOT NULL DEFAULT '{}',
    seconds             double precision NOT NULL DEFAULT 0,
    error               text
);
CREATE INDEX reconcile_run_newest ON reconcile_run (vpn, id DESC);
COMMENT ON TABLE reconcile_run IS
    'Reconciliation runs of `vpnrepl reconcile`, newest per VPN exported as metrics.';
"""

_DOWNGRADE = """
DROP TABLE reconcile_run;
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute(_DOWNGRADE)
