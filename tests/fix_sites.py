"""The two-site harness as pytest fixtures.

``sites`` starts two RabbitMQ nodes and two PostgreSQL clusters once per test
session; ``site_a``/``site_b`` hand a test one site reset to a fresh state
(servers running, empty database, only the default vhost) cheaply.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from plugin._localsites import LocalSite, LocalSites


@pytest.fixture(scope="session")
def sites() -> Iterator[LocalSites]:
    two = LocalSites()
    try:
        two.start()
        print(
            f"\n[harness] two RabbitMQ nodes + two PostgreSQL clusters up in "
            f"{two.startup_seconds:.1f} s"
        )
        yield two
    finally:
        two.close()


def _fresh(site: LocalSite) -> LocalSite:
    if not site.rabbit.alive():
        site.rabbit.start()
    if not site.pg.alive():
        site.pg.start()
    site.rabbit.reset()
    site.pg.reset()
    return site


@pytest.fixture
def site_a(sites: LocalSites) -> LocalSite:
    return _fresh(sites.a)


@pytest.fixture
def site_b(sites: LocalSites) -> LocalSite:
    return _fresh(sites.b)


def role_dsn(site: LocalSite, role: str, *grants: str) -> str:
    """A login role on ``site``'s store given ``grants`` (SQL after
    ``GRANT``, ``{role}`` standing for the role), and a DSN that logs in
    with it. Roles are the cluster's: made once, granted per database."""
    with psycopg.connect(site.pg.dsn(), autocommit=True) as db:
        db.execute(
            f"DO $$ BEGIN CREATE ROLE {role} LOGIN;"
            " EXCEPTION WHEN duplicate_object THEN NULL; END $$"
        )
        for grant in ("CONNECT ON DATABASE vpnrepl TO {role}", "USAGE ON SCHEMA public TO {role}",
                      *grants):  # fmt: skip
            db.execute(f"GRANT {grant.format(role=role)}")
    return site.pg.dsn().replace("postgres@", f"{role}@")
