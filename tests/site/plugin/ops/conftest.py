"""The migrated store (site A's PostgreSQL) the operator's commands' tests
run on."""

from __future__ import annotations

import pytest

from plugin.devtools import LocalSite
from sql import migrate


@pytest.fixture
def dsn(site_a: LocalSite) -> str:
    dsn = site_a.pg.dsn()
    migrate(dsn)
    return dsn
