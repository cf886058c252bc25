"""PostgreSQL schema of a site, as Alembic migrations.

Why Alembic rather than hand-applied SQL files: ``vpnrepl init`` must create
*or upgrade* a site's schema idempotently, and Alembic already keeps the
applied revision in ``alembic_version`` and runs each migration in a
transaction. Migrations are written with ``op`` calls (no ORM models): the hot
path talks to these tables through psycopg, not SQLAlchemy.

:func:`migrate` holds a PostgreSQL advisory lock while it runs, so two
``init`` commands racing on one database serialise instead of failing.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

__all__ = ["alembic_config", "head_revision", "migrate", "sqlalchemy_url"]

_HERE = Path(__file__).resolve().parent
_LOCK_KEY = 0x7670_6E72  # "vpnr": serialises concurrent `vpnrepl init`


def sqlalchemy_url(dsn: str) -> str:
    """The SQLAlchemy URL for a libpq DSN, using the psycopg 3 driver."""
    scheme, sep, rest = dsn.partition("://")
    if not sep or scheme not in ("postgresql", "postgres"):
        raise ValueError("expected a postgresql:// DSN")
    return f"postgresql+psycopg://{rest}"


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_HERE))
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None  # noqa: S101 - the package ships its migrations
    return head


def migrate(dsn: str, target: str = "head") -> tuple[str | None, str]:
    """Upgrade the schema at ``dsn`` to the newest revision (or ``target``,
    an upgrade test's previous one).

    Returns ``(revision before, revision after)``; equal when nothing was to do.
    """
    engine = sa.create_engine(sqlalchemy_url(dsn), poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LOCK_KEY})
            before = MigrationContext.configure(conn).get_current_revision()
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, target)
            after = MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
    assert after is not None  # noqa: S101 - upgrade to head always lands somewhere
    return before, after
