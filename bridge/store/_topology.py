"""A standby's stored definitions: the active's last listing
(``vpn_config.definitions`` and ``definitions_index``) and the topology
changes streamed after it (``topology_change``, written by the apply step).

Each function returns a script of statements (see
:mod:`bridge.store._statement`: run blocking or on asyncio, on the caller's
connection and transaction, never committing). A listing older than the one
stored (a lower index) is not kept: it could only undo changes the stored
one already shows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from bridge._definitions import DefinitionsError, merge_definitions
from bridge._entry import EventDecodeError, decode_event
from bridge._events import TopologyChanged

from ._statement import Result, Row, Statement, Steps, changed, script

__all__ = ["StoredTopology", "keep_definitions", "stored_topology"]

# kept when newer than (or as new as) the stored listing; the index is NULL
# when the active did not say it (protocol 5), and such a listing replaces
# whatever is stored
_KEEP = """
UPDATE vpn_config SET definitions = %(doc)s, definitions_index = %(index)s
WHERE name = %(vpn)s
  AND (%(index)s::bigint IS NULL OR definitions_index IS NULL OR definitions_index <= %(index)s)
"""
_PRUNE = """
DELETE FROM topology_change
WHERE vpn = %(vpn)s AND (%(index)s::bigint IS NULL OR ledger_index <= %(index)s)
RETURNING ledger_index, event
"""
_LISTING = "SELECT definitions, definitions_index FROM vpn_config WHERE name = %s"
_CHANGES = """
SELECT ledger_index, event FROM topology_change
WHERE vpn = %s AND ledger_index > %s ORDER BY ledger_index
"""


@dataclass(frozen=True, slots=True)
class StoredTopology:
    """What a standby holds of a VPN's definitions."""

    vpn: str
    #: the active's last listing (None: none arrived)
    listing: bytes | None
    #: the active's durable ledger index when it read the listing
    index: int | None
    #: the topology changes above ``index``, in index order
    changes: tuple[TopologyChanged, ...]

    def merged(self) -> bytes | None:
        """The definitions document with the changes applied; None when
        there is neither a listing nor a change."""
        if self.listing is None and not self.changes:
            return None
        try:
            listing = json.loads(self.listing) if self.listing else {}
            doc = merge_definitions(listing, self.changes)
        except (ValueError, DefinitionsError) as e:
            raise DefinitionsError(f"the stored definitions of {self.vpn} are unusable: {e}") from e
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _decode(vpn: str, rows: list[Row]) -> tuple[TopologyChanged, ...]:
    out = []
    for index, data in rows:
        try:
            event = decode_event(bytes(data), vpn)
        except EventDecodeError as e:
            raise DefinitionsError(f"topology change {index} of {vpn} is unreadable: {e}") from e
        if not isinstance(event, TopologyChanged):
            raise DefinitionsError(f"topology change {index} of {vpn} is not a topology event")
        out.append(event)
    return tuple(out)


def _rows(result: Result) -> list[Row]:
    return result.rows


@script
def keep_definitions(
    vpn: str, definitions: bytes, index: int | None
) -> Steps[tuple[TopologyChanged, ...] | None]:
    """Keep a listing the active read at ledger ``index`` and forget the
    changes it shows; returns those changes (in index order), or None when
    a newer listing is stored already (nothing changed)."""
    params = {"doc": definitions, "index": index, "vpn": vpn}
    kept: int = yield changed(_KEEP, params)
    if kept == 0:
        return None
    pruned: list[Row] = yield Statement(_PRUNE, params, _rows)
    return _decode(vpn, sorted(pruned))


@script
def stored_topology(vpn: str) -> Steps[StoredTopology]:
    """The listing and the changes above its index (a promotion imports them)."""
    found: list[Row] = yield Statement(_LISTING, (vpn,), _rows)
    row = found[0] if found else None
    listing = bytes(row[0]) if row is not None and row[0] else None
    index = int(row[1]) if row is not None and row[1] is not None else None
    rows: list[Row] = yield Statement(_CHANGES, (vpn, index or 0), _rows)
    return StoredTopology(vpn, listing, index, _decode(vpn, rows))
