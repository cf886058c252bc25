"""Promotion, epochs and operator requests.

* ``vpn_epoch``: every epoch a VPN has had, the site that took it (``status``
  shows the history: which site was active since when), and the index of the
  old epoch's ledger up to which that site had applied it when it took over
  (a demoted former active exports what it confirmed after that index).
* ``republished``: the replication ids ``vpnrepl republish`` has sent through
  this (active) site, so a file is republished at most once per id.
* ``promotion``: one row per VPN, the state of its last promotion
  (``running`` until the materialisation is done and the role flipped) and
  its counts, so ``status`` can show progress and a re-run after a crash
  knows where it stands.
* ``promotion_queue``: per queue of a running promotion, whether its live
  messages are all in the broker (``done``, every publish confirmed). A
  queue not done is emptied and materialised again on a re-run: clients are
  not admitted before the promotion finishes, so the queue holds only what
  the promotion put there, and nothing is lost or duplicated.
* ``vpn_config.definitions``: on a standby, the RabbitMQ definitions (with
  the users and permissions) the active sent last, so a promotion imports
  the newest topology even when the active is gone.
* ``operator_request``: a command (promote, demote, switchover, ...) the CLI
  hands the running node through the database (LISTEN/NOTIFY on
  ``vpnrepl_request``); the node answers in the same row.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_UPGRADE = """
ALTER TABLE vpn_config ADD COLUMN definitions bytea;

CREATE TABLE vpn_epoch (
    vpn               text NOT NULL REFERENCES vpn_config(name) ON DELETE CASCADE,
    epoch             bigint NOT NULL CHECK (epoch >= 1),
    site              text NOT NULL,
    since             timestamptz NOT NULL DEFAULT now(),
    taken_over_at     bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (vpn, epoch)
);

CREATE TABLE republished (
    vpn               text NOT NULL,
    repl_id           bytea NOT NULL,
    state             text NOT NULL CHECK (state IN ('sending', 'sent')),
    at                timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (vpn, repl_id)
);
-- the epochs of existing VPNs: which site took them is not known any more
INSERT INTO vpn_epoch (vpn, epoch, site, since)
SELECT name, epoch, '', created_at FROM vpn_config;

CREATE TABLE promotion (
    vpn               text PRIMARY KEY REFERENCES vpn_config(name) ON DELETE CASCADE,
    epoch             bigint NOT NULL,
    state             text NOT NULL CHECK (state IN ('running', 'done', 'failed')),
    materialised      bigint NOT NULL DEFAULT 0,
    total             bigint NOT NULL DEFAULT 0,
    txns_committed    bigint NOT NULL DEFAULT 0,
    txns_aborted      bigint NOT NULL DEFAULT 0,
    error             text,
    started_at        timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz
);

CREATE TABLE promotion_queue (
    vpn               text NOT NULL REFERENCES vpn_config(name) ON DELETE CASCADE,
    queue             text NOT NULL,
    epoch             bigint NOT NULL,
    messages          bigint NOT NULL,
    done              boolean NOT NULL DEFAULT false,
    PRIMARY KEY (vpn, queue)
);

CREATE TABLE operator_request (
    id                bigserial PRIMARY KEY,
    command           text NOT NULL,
    vpn               text NOT NULL,
    args              jsonb NOT NULL DEFAULT '{}',
    state             text NOT NULL DEFAULT 'pending'
                      CHECK (state IN ('pending', 'running', 'done', 'failed')),
    progress          jsonb,
    result            jsonb,
    error             text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz
);
CREATE INDEX operator_request_pending ON operator_request (id) WHERE state = 'pending';
"""

_DOWNGRADE = """
DROP TABLE operator_request;
DROP TABLE republished;
DROP TABLE promotion_queue;
DROP TABLE promotion;
DROP TABLE vpn_epoch;
ALTER TABLE vpn_config DROP COLUMN definitions;
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute(_DOWNGRADE)
