"""``vpnrepl audit``: every operator action on this site, newest first.

The trail is ``operator_request``: a command a running node carried out,
one the CLI carried out itself when no node ran, and a switchover step the
peer site asked for, each with the database role that asked
(``requested_by``), when, and how it ended.
"""

from __future__ import annotations

from typing import Any

import psycopg

__all__ = ["audit_rows", "render_audit"]

_ROWS = """
SELECT id, created_at, finished_at, requested_by, command, vpn, state, error
FROM operator_request WHERE %(vpn)s::text IS NULL OR vpn = %(vpn)s
ORDER BY id DESC LIMIT %(limit)s
"""


def audit_rows(
    conn: psycopg.Connection[dict[str, Any]], limit: int, vpn: str | None = None
) -> list[dict[str, Any]]:
    """The newest ``limit`` actions (of ``vpn``), JSON-ready."""
    rows = conn.execute(_ROWS, {"vpn": vpn, "limit": limit}).fetchall()
    return [
        {
            "id": r["id"],
            "at": r["created_at"].isoformat(),
            "finished_at": r["finished_at"].isoformat() if r["finished_at"] else None,
            "by": r["requested_by"],
            "command": r["command"],
            "vpn": r["vpn"],
            "state": r["state"],
            "error": r["error"],
        }
        for r in rows
    ]


def render_audit(rows: list[dict[str, Any]]) -> str:
    """A table, one action a line."""
    if not rows:
        return "no operator action recorded\n"
    lines = ["ID    WHEN                 BY                COMMAND             VPN        STATE"]
    for r in rows:
        when = r["at"][:19].replace("T", " ")
        line = f"{r['id']:<5} {when}  {r['by']:<17} {r['command']:<19} {r['vpn']:<10} {r['state']}"
        if r["error"]:
            line += f": {r['error'].splitlines()[0][:120]}"
        lines.append(line)
    return "\n".join(lines) + "\n"
