"""``vpnrepl status`` as a table an operator reads at a glance.

One row per VPN (role, epoch, mode, eligibility, bridge, indexes, lag,
in-doubt transactions), then per VPN its queues (replicated live count
against the broker's), the queues out of scope that hold persistent
messages, and anything that needs attention (the sync-ineligible windows
recorded among it). Built from the same document
``--json`` prints, so the two cannot disagree.
"""

from __future__ import annotations

from typing import Any

__all__ = ["render"]

_COLUMNS = (
    "VPN",
    "ROLE",
    "EPOCH",
    "MODE",
    "SYNC",
    "BRIDGE",
    "LEDGER",
    "APPLIED",
    "LAG",
    "IN-DOUBT",
)


def _row(v: dict[str, Any]) -> tuple[str, ...]:
    sync = ("eligible" if v["sync_eligible"] else "INELIGIBLE") if v["mode"] == "sync" else "-"
    lag = f"{v['lag_events']} ev / {v['lag_seconds']:g} s"
    role = v["role"] + (" FENCED" if v["fenced"] else "")
    role += " SPLIT-BRAIN" if v.get("split_brain") else ""
    return (
        v["name"],
        role,
        str(v["epoch"]),
        v["mode"],
        sync,
        v["bridge"],
        str(v["ledger_index"]),
        str(v["applied_index"]),
        lag,
        str(v["in_doubt_txns"]),
    )


def _grid(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _details(v: dict[str, Any]) -> list[str]:
    out = [f"{v['name']}:"]
    broker = v.get("broker_queues")
    names = sorted(set(v["queues"]) | set(broker or {}) - set(v.get("out_of_scope") or {}))
    for queue in names:
        at_broker = "?" if broker is None else broker.get(queue, 0)
        out.append(
            f"  {queue}: {v['queues'].get(queue, 0)} replicated live, {at_broker} at the broker"
        )
    for queue, n in (v.get("out_of_scope") or {}).items():
        out.append(f"  {queue}: {n} persistent at the broker, NOT in scope (not replicated)")
    if v.get("broker_error"):
        out.append(f"  broker depths unavailable: {v['broker_error']}")
    if len(out) == 1:
        out.append("  no queues")
    promotion = v.get("promotion") or {}
    if promotion.get("state") not in (None, "none", "done"):
        out.append(
            f"  promotion {promotion['state']}: {promotion['materialised']}"
            f"/{promotion['total']} materialised"
        )
    run = v.get("reconcile")
    if run:
        left = run["missing_on_standby"] + run["extra_on_standby"] + run["differs"]
        verdict = "sites agree" if run["outcome"] == "agree" else run["outcome"]
        out.append(
            f"  last reconcile {run['finished_at'][:19].replace('T', ' ')}: {verdict}"
            + (f", {left} differences left" if left else "")
            + (f", {run['repaired']} repaired" if run["repaired"] else "")
        )
    windows = v.get("sync_windows") or []
    if windows:
        newest = windows[0]
        last = "open" if newest["last_index"] is None else newest["last_index"]
        out.append(
            f"  {v.get('sync_windows_total', len(windows))} sync-ineligible window(s) recorded"
            f" (confirmed without the standby); newest: ledger {newest['first_index']}..{last}"
            f" at epoch {newest['epoch']}"
        )
    if v["unknown_acks"]:
        out.append(f"  {v['unknown_acks']} acks the standby could not match (see the README)")
    return out


def render(doc: dict[str, Any]) -> str:
    """The table for a ``status --json`` document (with broker depths or not)."""
    lines = [f"site {doc['site']}"]
    if not doc.get("bridge_authenticated", True):
        lines.append(
            "bridge: PLAIN TCP, peers not authenticated ([insecure] plaintext_bridge = true)"
        )
    if not doc["vpns"]:
        lines.append("no VPN is enabled for replication")
        return "\n".join(lines) + "\n"
    lines += _grid([_COLUMNS, *(_row(v) for v in doc["vpns"])])
    for v in doc["vpns"]:
        lines.append("")
        lines += _details(v)
    return "\n".join(lines) + "\n"
