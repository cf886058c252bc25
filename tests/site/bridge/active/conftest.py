"""The store the active's end's tests run on: the sync-window tests'
(site A's, migrated, with two sync VPNs enabled)."""

from __future__ import annotations

from tests.site.bridge.store.test_sync_window import dsn  # noqa: F401 - the fixture
