"""Unit tests run without servers: the harness's fixture fails here, so a
test that needs RabbitMQ or PostgreSQL belongs in ``tests/site`` or
``tests/two_sites``."""

from __future__ import annotations

from typing import NoReturn

import pytest


@pytest.fixture(scope="session")
def sites() -> NoReturn:
    pytest.fail("a unit test asked for the harness's servers: move it out of tests/unit")
