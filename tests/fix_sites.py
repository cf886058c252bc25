"""The two-site harness as pytest fixtures.

``sites`` starts two RabbitMQ nodes and two PostgreSQL clusters once per test
session; ``site_a``/``site_b`` hand a test one site reset to a fresh state
(servers running, empty database, only the default vhost) cheaply.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import psycopg
import pytest

from plugin.devtools import LocalSite, LocalSites


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


@pytest.fixture(scope="module")
def cluster_sites() -> Iterator[LocalSites]:
    """Two sites of their own for one test module: site A a cluster of
    three RabbitMQ nodes, site B one."""
    two = LocalSites(brokers=(3, 1))
    try:
        two.start()
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


_LOCK_WAITERS = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE wait_event_type = 'Lock' AND datname = current_database()"
)


def until_a_lock_waits(
    dsn: str, what: str, alive: Callable[[], bool] | None = None, timeout: float = 10.0
) -> None:
    """Until a session of the database waits for a lock: ``what`` (a
    statement the test started behind a blocker it holds) is held back.
    ``alive``: false once the waiter ended, so it cannot wait any more."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as watch:
        while not (row := watch.execute(_LOCK_WAITERS).fetchone()) or not row[0]:
            assert alive is None or alive(), f"{what} ended without waiting for the lock"
            assert time.monotonic() < deadline, f"{what} did not wait for the lock"
            time.sleep(0.02)
