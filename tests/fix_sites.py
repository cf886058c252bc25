"""The two-site harness as pytest fixtures.

``sites`` starts two RabbitMQ nodes and two PostgreSQL clusters once per test
session; ``site_a``/``site_b`` hand a test one site reset to a fresh state
(servers running, empty database, only the default vhost) cheaply.
"""

from __future__ import annotations

from collections.abc import Iterator

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
