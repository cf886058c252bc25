"""``vpnrepl reconcile``'s report on a terminal (``--json`` prints the
result's dictionary instead)."""

from __future__ import annotations

from typing import Any

from bridge import KINDS

__all__ = ["render"]


def render(doc: dict[str, Any], repaired: bool) -> str:
    """The report of a run's ``as_dict()``; ``repaired``: ``--repair`` was given."""
    remaining = doc["remaining"]
    agree = not any(remaining.values())
    verdict = "the sites agree" if agree else "the sites DIFFER"
    lines = [
        f"reconcile {doc['vpn']}: {verdict} ({doc['method']}, {doc['segments']} segments, "
        f"{doc['seconds']:g} s)",
        f"  live rows: {doc['rows_active']} on the active (index {doc['active_index']}), "
        f"{doc['rows_standby']} on the standby (index {doc['standby_index']})",
        f"  segments that differed: {doc['dirty_segments']}",
    ]
    width = max(len(k) for k in KINDS)
    for kind in KINDS:
        line = f"  {kind.ljust(width)}  {doc[kind]}"
        if repaired:
            line += f"  ({remaining[kind]} left after repair)"
        lines.append(line)
    if doc["in_flight"]:
        lines.append(
            f"  in flight, not differences: {doc['in_flight']} (the stream was moving them)"
        )
    if repaired:
        lines.append(f"  repaired: {doc['repaired']}")
    for d in doc["differences"][:20]:
        lines.append(f"    {d['kind']}: {d['queue']} {d['repl_id']}")
    if doc["broker_drift"]:
        lines.append("  broker drift (persistent at the broker vs replicated):")
        for queue, n in doc["broker_drift"].items():
            line = f"    {queue}: {n['broker']} at the broker, {n['replicated']} replicated"
            if n.get("uncertain"):
                line += f"; {n['uncertain']} uncertain publishes"
            if n.get("phantoms"):
                how = "retired" if n.get("retired") else "retire them with --repair"
                line += f": {n['phantoms']} phantoms the broker never took ({how})"
            lines.append(line)
    return "\n".join(lines) + "\n"
