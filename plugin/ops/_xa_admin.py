"""``vpnrepl xa``: an operator resolves XA branches whose transaction
manager is gone.

``list`` reads the site's database (no node needed); ``commit`` and
``rollback`` are requests to the running node (``plugin.ops._requests``),
which resolves the branch as its transaction manager would — from its
prepared row, through the broker — and records the decision as
heuristic, so the transaction manager, if it comes back, hears
``XA_HEURCOM`` or ``XA_HEURRB`` and forgets it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plugin._errors import StateError, UsageError
from txn.branches import XaCoordinator
from txn.local import XA_PENDING
from txn.xa import Xid, XidError

from ._store import connect

__all__ = ["decide_branch", "list_branches"]

#: two constants, no input
_BRANCHES = "SELECT xid, state, heuristic, hazard, created_at, updated_at FROM txn_log" + XA_PENDING  # noqa: S608


async def decide_branch(xa: XaCoordinator, vpn: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """The node's side of ``vpnrepl xa commit|rollback``."""
    try:
        xid = Xid.from_string(str(args["xid"]))
        commit = args["commit"]
    except KeyError as e:
        raise UsageError(f"an xa-decide request needs {e.args[0]!r}") from e
    except XidError as e:
        raise UsageError(str(e)) from e
    if not isinstance(commit, bool):
        raise UsageError("an xa-decide request's 'commit' must be true or false")
    reply = await xa.decide(vpn, xid, commit)
    if reply.code not in ("XA_OK", "XA_HEURHAZ"):
        raise StateError(f"VPN {vpn!r}: XA branch {xid}: {reply.code}: {reply.text}")
    return {"xid": str(xid), "code": reply.code, "text": reply.text}


def list_branches(store_dsn: str, vpn: str) -> list[dict[str, Any]]:
    """The VPN's prepared and heuristic branches on this site."""
    with connect(store_dsn) as conn:
        rows = conn.execute(_BRANCHES, (vpn,)).fetchall()
    return [
        {
            "xid": row["xid"],
            "state": row["state"],
            "heuristic": row["heuristic"],
            "hazard": row["hazard"],
            "prepared_at": row["created_at"].isoformat(),
            "updated_at": row["updated_at"].isoformat(),
        }
        for row in rows
    ]
