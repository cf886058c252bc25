"""The privileges the migrations take back (sql/_grants.py): a table the
peer site's role must not read, or write, is revoked from every role but
the node's, whatever a default privilege or an earlier README granted."""

from __future__ import annotations

import psycopg
import pytest

from plugin.devtools import LocalSite
from sql import migrate
from tests.fix_sites import role_dsn


def test_the_peer_role_reads_no_window_even_with_a_default_grant(site_a: LocalSite) -> None:
    """Only the owner's role touches ``sync_window``: a default privilege
    given to another role before the upgrade (``ALTER DEFAULT PRIVILEGES``)
    is revoked by it."""
    dsn = site_a.pg.dsn()
    migrate(dsn, "0015")
    peer = role_dsn(site_a, "vpnrepl_window_peer")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER DEFAULT PRIVILEGES GRANT SELECT ON TABLES TO vpnrepl_window_peer")
    try:
        migrate(dsn)
        with psycopg.connect(peer) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT * FROM sync_window")
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "ALTER DEFAULT PRIVILEGES REVOKE SELECT ON TABLES FROM vpnrepl_window_peer"
            )


def test_the_upgrade_takes_back_the_insert_the_previous_readme_granted(
    site_a: LocalSite,
) -> None:
    """The previous release's README granted the peer's role INSERT on
    ``operator_request``; with it the peer could still queue a promote."""
    dsn = site_a.pg.dsn()
    migrate(dsn, "0012")
    old = role_dsn(site_a, "vpnrepl_old_peer", "INSERT ON operator_request TO {role}",
                   "USAGE ON SEQUENCE operator_request_id_seq TO {role}")  # fmt: skip
    with psycopg.connect(old, autocommit=True) as conn:
        conn.execute("INSERT INTO operator_request (command, vpn) VALUES ('noop', 'orders')")
    migrate(dsn)
    with psycopg.connect(old, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("INSERT INTO operator_request (command, vpn) VALUES ('promote', 'x')")
