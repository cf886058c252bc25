"""Drop ``live_message_order``: acks must find their row by the primary key.

The apply step removes an acknowledged message's row by one primary-key
probe per ``(queue, repl_id)`` (``bridge/ledger/_apply.py``). With no statistics
for ``live_message`` (never analysed, or analysed while empty — a queue
whose consumers keep up is empty most of the time, and that is when
autovacuum analyses it) PostgreSQL 15 estimated both indexes on
``(vpn, queue, ...)`` at one row and chose the smaller one,
``(vpn, queue, publish_index)``, filtering ``repl_id``: every ack then read
the whole queue. Measured on a 10,000-message queue: 520-1,000 ms for a
batch of 500 acks, against 1 ms through the primary key (after an
``ANALYZE`` with rows in the table). ``tests/site/bridge/ledger/test_apply.py``
checks the plan with the statistics of an empty table.

The index had no reader that needs it: a checkpoint sorts the VPN's rows
(rare, and the standby sorts nothing), and a purge's ``publish_index <``
filter runs over the queue's rows found by the primary key's prefix. Every
live row's insert and delete no longer maintains a second index either.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("DROP INDEX IF EXISTS live_message_order")


def downgrade() -> None:
    op.execute("CREATE INDEX live_message_order ON live_message (vpn, queue, publish_index)")
