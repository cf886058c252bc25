"""Client XA branches in ``txn_log``.

A branch an application's transaction manager prepared through the
listener is a ``txn_log`` row like a local transaction's, with its XA
transaction id in ``xid`` (``format_id:gtrid-hex:bqual-hex``). Unlike a
local transaction it is never resolved by recovery alone: it stays
``prepared`` until the transaction manager (or an operator) commits or
rolls it back. ``heuristic``: the branch ended other than as asked, or
was decided by an operator (``commit``, ``rollback``, ``hazard``); the
row is listed by ``recover`` until the transaction manager forgets it.
``hazard``: what happened (a branch committed from the prepared log after
its channel closed: the broker had requeued the messages it acked).
``acks_held``: set at a promotion: the messages the branch acked are kept
out of the new active's broker until the branch is resolved; ``xa_held``
lists them (the materialiser skips them; a commit removes them from the
live state, a rollback publishes them).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_UPGRADE = """
ALTER TABLE txn_log
    ADD COLUMN xid text,
    ADD COLUMN heuristic text CHECK (heuristic IN ('commit', 'rollback', 'hazard')),
    ADD COLUMN hazard text,
    ADD COLUMN acks_held boolean NOT NULL DEFAULT false;
CREATE UNIQUE INDEX txn_log_xid_prepared ON txn_log (vpn, side, xid)
    WHERE xid IS NOT NULL AND state = 'prepared';
CREATE INDEX txn_log_xid ON txn_log (vpn, xid) WHERE xid IS NOT NULL;
CREATE TABLE xa_held (
    vpn               text NOT NULL REFERENCES vpn_config(name) ON DELETE CASCADE,
    repl_id           bytea NOT NULL,
    queue             text NOT NULL,
    txid              text NOT NULL,
    PRIMARY KEY (vpn, repl_id, queue)
);
"""

_DOWNGRADE = """
DROP TABLE xa_held;
DROP INDEX txn_log_xid;
DROP INDEX txn_log_xid_prepared;
ALTER TABLE txn_log DROP COLUMN xid, DROP COLUMN heuristic, DROP COLUMN hazard,
    DROP COLUMN acks_held;
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute(_DOWNGRADE)
