"""``vpnrepl audit`` (plugin/ops/_audit.py) against a real PostgreSQL: what
the CLI did itself, with no node running, is in the trail with who asked
and how it ended."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from plugin import StateError
from plugin.devtools import LocalSite
from plugin.ops import Progress, audit_rows, render_audit, run_command


def test_what_the_cli_did_itself_is_in_the_audit_trail(dsn: str, site_a: LocalSite) -> None:
    async def local(progress: Progress) -> dict[str, Any]:
        return {"line": "done here"}

    async def failing(progress: Progress) -> dict[str, Any]:
        raise StateError("VPN 'nope' is not enabled here")

    asyncio.run(run_command(dsn, "promote", "orders", {}, local, lambda d, t: None))
    with pytest.raises(StateError):
        asyncio.run(run_command(dsn, "demote", "nope", {}, failing, lambda d, t: None))
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        rows = audit_rows(conn, 10)
    assert [(r["command"], r["vpn"], r["state"], r["by"]) for r in rows[:2]] == [
        ("demote", "nope", "failed", "postgres"),
        ("promote", "orders", "done", "postgres"),
    ]
    assert "not enabled" in rows[0]["error"]
    text = render_audit(rows)
    assert "demote" in text and "failed: VPN 'nope' is not enabled here" in text
