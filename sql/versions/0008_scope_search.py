"""Scope patterns are searched in a queue name, as RabbitMQ policy patterns are.

Until this revision a ``--queues`` pattern had to match the whole queue name;
from now on it matches where it is found anywhere in the name (``^orders\\.``
is a prefix, ``.`` is every name). The stored patterns of enabled VPNs keep
their meaning: each becomes ``\\A(?:P)\\Z``, with a leading run of global
inline flags (``(?i)``, Python refuses them mid-pattern) kept in front, and
under ``(?x)`` a line end before the closing parenthesis, so that a comment
in P cannot swallow it. ``\\Z`` and not ``$``, which would also match before
a trailing newline.

The downgrade undoes the wrapping where it is this revision's, and otherwise
rewrites a searched pattern as the whole-name pattern that matches the same
names (``(?s:.*?)(?:P)(?s:.*)``).

The rewrites live here alone (the schema package stands alone, and a
migration keeps what it did when it was written); version 4 of the bridge
protocol, which needed them too, is gone. ``tests/two_sites/test_scope_patterns.py``
tests them.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import re
from collections.abc import Callable

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_LEADING_FLAGS = re.compile(r"(?:\(\?[aiLmsux]+\))+")


def _split(pattern: str) -> tuple[str, str, str]:
    m = _LEADING_FLAGS.match(pattern)
    flags = m.group(0) if m else ""
    return flags, pattern[len(flags) :], "\n" if "x" in flags else ""


def anchored(pattern: str) -> str:
    """The searched pattern that matches what ``pattern`` matched whole."""
    flags, rest, eol = _split(pattern)
    return f"{flags}\\A(?:{rest}{eol})\\Z"


def unanchored(pattern: str) -> str:
    """The whole-name pattern that matches where ``pattern`` is found; the
    exact inverse of :func:`anchored` for a pattern it wrapped."""
    flags, rest, eol = _split(pattern)
    prefix, suffix = "\\A(?:", f"{eol})\\Z"
    if rest.startswith(prefix) and rest.endswith(suffix):
        return flags + rest[len(prefix) : -len(suffix)]
    return f"{flags}(?s:.*?)(?:{rest}{eol})(?s:.*)"


def _rewrite(change: Callable[[str], str]) -> None:
    conn = op.get_bind()
    rows = conn.execute(
        sa.text("SELECT name, queue_patterns FROM vpn_config WHERE cardinality(queue_patterns) > 0")
    ).all()
    for name, patterns in rows:
        conn.execute(
            sa.text("UPDATE vpn_config SET queue_patterns = :patterns WHERE name = :name"),
            {"patterns": [change(p) for p in patterns], "name": name},
        )


def upgrade() -> None:
    _rewrite(anchored)


def downgrade() -> None:
    _rewrite(unanchored)
