"""Initial schema: VPN config and state, ledger, live messages, txn log.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_UPGRADE = """
CREATE TABLE vpn_config (
    name              text PRIMARY KEY CHECK (octet_length(name) BETWEEN 1 AND 255),
    enabled           boolean NOT NULL DEFAULT true,
    role              text NOT NULL CHECK (role IN ('active', 'standby')),
    epoch             bigint NOT NULL DEFAULT 1 CHECK (epoch >= 1),
    mode              text NOT NULL CHECK (mode IN ('sync', 'async')),
    sync_timeout_ms   integer NOT NULL CHECK (sync_timeout_ms > 0),
    on_sync_timeout   text NOT NULL CHECK (on_sync_timeout IN ('degrade', 'reject')),
    queue_patterns    text[] NOT NULL DEFAULT '{}',
    topic_filters     text[] NOT NULL DEFAULT '{}',
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE vpn_config IS
    'Per-VPN replication settings, written by `vpnrepl vpn enable/disable`.';

-- Progress of replication per VPN. On the active: ledger_index is the last
-- durable ledger entry and applied_index the standby's last durable ack. On the
-- standby: applied_index is the last ledger entry applied (in the same
-- transaction as its effects, which makes apply exactly-once).
CREATE TABLE vpn_state (
    vpn               text PRIMARY KEY REFERENCES vpn_config(name) ON DELETE CASCADE,
    ledger_index      bigint NOT NULL DEFAULT 0,
    applied_index     bigint NOT NULL DEFAULT 0,
    applied_epoch     bigint NOT NULL DEFAULT 0,
    applied_at        timestamptz,
    sync_eligible     boolean NOT NULL DEFAULT true,
    fenced            boolean NOT NULL DEFAULT false,
    bridge_state      text NOT NULL DEFAULT 'disconnected',
    unknown_acks      bigint NOT NULL DEFAULT 0,
    updated_at        timestamptz NOT NULL DEFAULT now()
);

-- The ordered event log of the active site, replayed to standbys.
CREATE TABLE ledger (
    vpn               text NOT NULL REFERENCES vpn_config(name) ON DELETE CASCADE,
    idx               bigint NOT NULL CHECK (idx >= 1),
    epoch             bigint NOT NULL,
    kind              text NOT NULL,
    event             bytea NOT NULL,
    appended_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (vpn, idx)
);

-- Replicated messages not yet consumed, per (VPN, queue). Both sites keep it
-- with the same apply code, so their state compares row for row.
CREATE TABLE live_message (
    vpn               text NOT NULL REFERENCES vpn_config(name) ON DELETE CASCADE,
    queue             text NOT NULL,
    repl_id           bytea NOT NULL CHECK (octet_length(repl_id) = 16),
    publish_index     bigint NOT NULL,
    exchange          text NOT NULL,
    routing_key       text NOT NULL,
    properties        bytea NOT NULL,
    body              bytea NOT NULL,
    PRIMARY KEY (vpn, queue, repl_id)
);
CREATE INDEX live_message_order ON live_message (vpn, queue, publish_index);

-- Internal two-phase (XA) transactions, coordinator and participant side.
CREATE TABLE txn_log (
    txid              text PRIMARY KEY,
    vpn               text NOT NULL REFERENCES vpn_config(name) ON DELETE CASCADE,
    side              text NOT NULL CHECK (side IN ('coordinator', 'participant')),
    state             text NOT NULL
                      CHECK (state IN ('prepared', 'committed', 'aborted', 'ended')),
    degraded          boolean NOT NULL DEFAULT false,
    events            bytea NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX txn_log_open ON txn_log (vpn, state) WHERE state <> 'ended';

-- One row per start of a site process: the incarnation number is the high
-- half of every replication id that process hands out, so ids stay unique
-- across crashes even before their ledger entry was durable.
CREATE TABLE node_incarnation (
    incarnation       bigserial PRIMARY KEY,
    site              text NOT NULL,
    started_at        timestamptz NOT NULL DEFAULT now()
);
"""

_DOWNGRADE = """
DROP TABLE node_incarnation;
DROP TABLE txn_log;
DROP TABLE live_message;
DROP TABLE ledger;
DROP TABLE vpn_state;
DROP TABLE vpn_config;
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute(_DOWNGRADE)
