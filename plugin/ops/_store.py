"""The site database as the admin commands see it: VPN settings and status.

The per-VPN rows (``vpn_config``, ``vpn_state``) are read and written
through ``bridge``'s store functions, the rest of the status with plain
parameterised SQL, all on the connection :func:`connect` gives (one
transaction, committed on success); every foreign error is translated here
into the plugin's taxonomy (:class:`StoreUnavailable` when the server cannot
be reached, :class:`StateError` when the schema is missing or a request
conflicts with what is stored).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from operator import itemgetter
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import dict_row

from bridge import Role, VpnSettings, redact_url
from bridge.store import (
    add_vpn_state,
    disable_replication,
    lock_vpn_config,
    record_first_epoch,
    save_vpn_settings,
    vpn_status_rows,
    windows_by_vpn,
)
from plugin._errors import StateError, StoreUnavailable

__all__ = [
    "add_broker_depths",
    "connect",
    "disable_vpn",
    "enable_vpn",
    "status",
    "store_unreachable",
]


def store_unreachable(dsn: str, e: BaseException) -> StoreUnavailable:
    """The error for a site database that could not be reached: its
    address (password redacted) and libpq's last line of why."""
    reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return StoreUnavailable(f"cannot connect to {redact_url(dsn)}: {reason}")


@contextmanager
def connect(dsn: str) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    """A connection that commits on success; errors translated at this edge."""
    try:
        conn = psycopg.connect(dsn, row_factory=dict_row, connect_timeout=10)
    except psycopg.OperationalError as e:
        raise store_unreachable(dsn, e) from e
    try:
        with conn:
            yield conn
    except pg_errors.UndefinedTable as e:
        raise StateError("the site database has no schema: run `vpnrepl init` first") from e


def enable_vpn(conn: psycopg.Connection[dict[str, Any]], s: VpnSettings, site: str = "") -> bool:
    """Store ``s``; returns True when the VPN was newly enabled.

    Re-enabling an enabled VPN updates its mode, timeout, policy and scope. Its
    role is not changed here: a role change moves the fencing epoch and must go
    through ``promote``/``demote``.
    """
    found = lock_vpn_config(s.name).run(conn)
    if found is not None and found.enabled and found.role != s.role:
        raise StateError(
            f"VPN {s.name!r} is already enabled as {found.role.value}; "
            "use `vpnrepl promote` or `vpnrepl demote` to change its role"
        )
    save_vpn_settings(s).run(conn)
    add_vpn_state(s.name).run(conn)
    record_first_epoch(s.name, site).run(conn)  # the epoch history starts with this site active
    return found is None or not found.enabled


def disable_vpn(conn: psycopg.Connection[dict[str, Any]], name: str) -> None:
    """Stop replicating ``name``; its replicated state is kept for a later enable."""
    if not disable_replication(name).run(conn):
        raise StateError(f"VPN {name!r} is not enabled for replication")


def add_broker_depths(doc: dict[str, Any], api: Any) -> None:
    """Add each VPN's broker-side queue depths next to the replicated counts.

    Publishes that bypass the listener (management UI, direct clients) are
    not replicated; a broker depth above the replicated live count shows
    them. ``out_of_scope`` names the queues holding persistent messages that
    the VPN's scope does not take (see :func:`~plugin.topology._scope_report.out_of_scope`).
    ``api`` is a :class:`bridge.ManagementAPI`; when the broker cannot be
    asked, ``broker_queues`` and ``out_of_scope`` are null and
    ``broker_error`` says why, and the rest of the status stands.
    """
    from urllib.parse import quote

    from bridge import TopicFilter
    from bridge.broker import ManagementUnavailable
    from plugin.topology import DEPTH_COLUMNS, ReplicationScope, out_of_scope, replicable_depth

    for vpn in doc["vpns"]:
        path = f"queues/{quote(vpn['name'], safe='')}?columns={DEPTH_COLUMNS}"
        try:
            queues = api.get(path)
        except ManagementUnavailable as e:
            vpn["broker_queues"] = None
            vpn["out_of_scope"] = None
            vpn["broker_error"] = str(e)
            continue
        vpn["broker_queues"] = {q["name"]: q.get("messages", 0) for q in queues}
        scope = ReplicationScope(
            tuple(vpn["scope"]["queues"]),
            tuple(TopicFilter.parse(t) for t in vpn["scope"]["topics"]),
        )
        persistent = {q["name"]: replicable_depth(q) for q in queues}
        vpn["out_of_scope"] = out_of_scope(scope, persistent, vpn["queues"])


def _has_table(conn: psycopg.Connection[dict[str, Any]], name: str) -> bool:
    """Whether the schema has ``name`` yet: ``status`` also reads a site
    whose node still runs the previous release (an upgrade one site at a
    time), before its ``init``."""
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL AS found", (name,)).fetchone()
    return bool(row and row["found"])


# client XA branches this site coordinates: prepared (awaiting their
# transaction manager), ended heuristically, and with a hazard, not forgotten
_XA_BRANCHES = """
SELECT vpn, count(*) FILTER (WHERE state = 'prepared') AS prepared,
       count(*) FILTER (WHERE heuristic IS NOT NULL) AS heuristic,
       count(*) FILTER (WHERE heuristic = 'hazard') AS hazards
FROM txn_log WHERE side = 'coordinator' AND xid IS NOT NULL GROUP BY vpn
"""


# replicated publishes a dead broker never confirmed, still live (plugin.node._uncertain)
_UNCERTAIN = """
SELECT u.vpn, count(*) AS n FROM uncertain_publish u
JOIN live_message m ON m.vpn = u.vpn AND m.queue = u.queue AND m.repl_id = u.repl_id
GROUP BY u.vpn
"""


_SPLIT_BRAIN = "SELECT vpn, split_brain FROM vpn_state"


def _has_column(conn: psycopg.Connection[dict[str, Any]], table: str, column: str) -> bool:
    """Whether ``table`` has ``column`` yet (a site of the previous schema)."""
    row = conn.execute(
        "SELECT count(*) AS n FROM information_schema.columns"
        " WHERE table_schema = current_schema() AND table_name = %s AND column_name = %s",
        (table, column),
    ).fetchone()
    return bool(row and row["n"])


# a standby's definitions: the listing's index, and the topology changes
# streamed above it (bridge.store._topology)
_DEFINITIONS = """
SELECT c.name AS vpn, c.definitions_index, c.definitions IS NOT NULL AS listed,
       (SELECT count(*) FROM topology_change t
        WHERE t.vpn = c.name AND t.ledger_index > coalesce(c.definitions_index, 0)) AS changes
FROM vpn_config c
"""


def _by_vpn(
    conn: psycopg.Connection[dict[str, Any]],
    present: bool,
    query: str,
    value: Callable[[dict[str, Any]], Any],
) -> dict[str, Any]:
    """``value`` of each of ``query``'s rows, by their VPN; nothing on a
    schema older than what the query reads (``present`` false)."""
    return {row["vpn"]: value(row) for row in conn.execute(query)} if present else {}


def status(
    conn: psycopg.Connection[dict[str, Any]],
    site: str,
    queues: bool = True,
    *,
    bridge_authenticated: bool = True,
) -> dict[str, Any]:
    """The ``status --json`` object for this site (key names are a contract).
    ``bridge_authenticated``: false when the site's bridge is plain TCP
    (``[insecure] plaintext_bridge``), so no peer proves its name.

    ``queues=False`` leaves each VPN's ``queues`` (live counts) empty: the
    count reads the whole live state, which ``/metrics`` and the lag history
    do not need every few seconds."""
    counts: dict[str, dict[str, int]] = {}
    for row in (
        conn.execute(
            "SELECT vpn, queue, count(*) AS n FROM live_message GROUP BY vpn, queue ORDER BY 1, 2"
        )
        if queues
        else ()
    ):
        counts.setdefault(row["vpn"], {})[row["queue"]] = row["n"]
    promotions = {
        row["vpn"]: {
            "state": row["state"],
            "materialised": row["materialised"],
            "total": row["total"],
            "epoch": row["epoch"],
            "txns_committed": row["txns_committed"],
        }
        for row in conn.execute(
            "SELECT vpn, state, materialised, total, epoch, txns_committed FROM promotion"
        )
    }
    reconciled = _by_vpn(
        conn,
        _has_table(conn, "reconcile_run"),
        "SELECT DISTINCT ON (vpn) vpn, finished_at, outcome, missing_on_standby,"
        " extra_on_standby, differs, repaired, broker_drift, seconds"
        " FROM reconcile_run ORDER BY vpn, id DESC",
        lambda row: {
            "finished_at": row["finished_at"].isoformat(),
            "outcome": row["outcome"],
            "missing_on_standby": row["missing_on_standby"],
            "extra_on_standby": row["extra_on_standby"],
            "differs": row["differs"],
            "repaired": row["repaired"],
            "broker_drift": len(row["broker_drift"] or {}),
            "seconds": round(row["seconds"], 3),
        },
    )
    branches = _by_vpn(
        conn,
        _has_table(conn, "xa_held"),
        _XA_BRANCHES,
        lambda row: {key: row[key] for key in ("prepared", "heuristic", "hazards")},
    )
    uncertain = _by_vpn(conn, _has_table(conn, "uncertain_publish"), _UNCERTAIN, itemgetter("n"))
    definitions = _by_vpn(
        conn,
        _has_table(conn, "topology_change"),
        _DEFINITIONS,
        lambda row: {
            "listed": row["listed"],
            "listing_index": row["definitions_index"],
            "streamed_changes": row["changes"],
        },
    )
    split = _by_vpn(
        conn,
        _has_column(conn, "vpn_state", "split_brain"),
        _SPLIT_BRAIN,
        itemgetter("split_brain"),
    )
    windows = windows_by_vpn().run(conn) if _has_table(conn, "sync_window") else {}
    epochs: dict[str, list[dict[str, Any]]] = {}
    for row in conn.execute("SELECT vpn, epoch, site, since FROM vpn_epoch ORDER BY vpn, epoch"):
        epochs.setdefault(row["vpn"], []).append(
            {"epoch": row["epoch"], "site": row["site"], "since": row["since"].isoformat()}
        )
    vpns = []
    for r in vpn_status_rows().run(conn):
        lag = max(r.ledger_index - r.applied_index, 0) if r.role is Role.ACTIVE else 0
        vpns.append(
            {
                "name": r.name,
                "role": r.role.value,
                "epoch": r.epoch,
                "mode": r.mode,
                "sync_timeout_ms": r.sync_timeout_ms,
                "on_sync_timeout": r.on_sync_timeout,
                "scope": {"queues": r.queue_patterns, "topics": r.topic_filters},
                "expose_id": r.expose_id,
                "sync_eligible": r.sync_eligible,
                "fenced": r.fenced,
                "split_brain": bool(split.get(r.name, False)),
                "bridge": r.bridge_state,
                "ledger_index": r.ledger_index,
                "applied_index": r.applied_index,
                "lag_events": lag,
                "lag_seconds": round(r.since_applied, 3) if lag else 0.0,
                "in_doubt_txns": r.in_doubt_txns,
                "degraded_txns": r.degraded_txns,
                "sync_windows": [w.as_dict() for w in windows[r.name].newest]
                if r.name in windows
                else [],
                "sync_windows_total": windows[r.name].total if r.name in windows else 0,
                "unknown_acks": r.unknown_acks,
                "queues": counts.get(r.name, {}),
                "promotion": promotions.get(
                    r.name, {"state": "none", "materialised": 0, "total": 0}
                ),
                "epochs": epochs.get(r.name, []),
                "reconcile": reconciled.get(r.name),
                "xa": branches.get(r.name, {"prepared": 0, "heuristic": 0, "hazards": 0}),
                "uncertain_publishes": uncertain.get(r.name, 0),
                "definitions": definitions.get(
                    r.name, {"listed": False, "listing_index": None, "streamed_changes": 0}
                ),
            }
        )
    return {"site": site, "bridge_authenticated": bridge_authenticated, "vpns": vpns}
