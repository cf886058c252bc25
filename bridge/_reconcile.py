"""Reconcile: what a comparison of two sites' live state reads and decides.

A VPN's live state on a site is its ``live_message`` rows, compared per
(queue, segment) — the low 16 bits of an id's counter modulo the segment
count — as a count and an order-independent sum of row digests, and row by
row only where a segment differs; a digest covers all a consumer would get.
Each side is read in one snapshot with the ledger index it reflects, and a
row that differs only because entries between the two indexes touched it is
in flight (:func:`touched`). The reasons: docs/behaviour.md,
"Reconciliation". SQL text and pure functions only: the caller runs the
reads (Spark's JDBC source, or psycopg).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from ._events import Consumed, DeadLettered, Event, Published, Purged

__all__ = [
    "MISSING_ON_STANDBY",
    "EXTRA_ON_STANDBY",
    "DIFFERS",
    "KINDS",
    "MAX_SEGMENTS",
    "REFLECTED_INDEX",
    "ROWS_OF_KEYS",
    "Difference",
    "LiveKey",
    "compare_rows",
    "live_rows_query",
    "quote_literal",
    "row_digest_sql",
    "segment_hashes_query",
    "segment_rows_query",
    "segment_sql",
    "touched",
]

MISSING_ON_STANDBY: Final = "missing_on_standby"
EXTRA_ON_STANDBY: Final = "extra_on_standby"
DIFFERS: Final = "differs"
KINDS: Final = (MISSING_ON_STANDBY, EXTRA_ON_STANDBY, DIFFERS)

#: (queue, replication id bytes): a live row's key within a VPN
LiveKey = tuple[str, bytes]

#: a live row's content without its key: (publish index, exchange, routing
#: key, properties, body)
RowContent = tuple[int, str, str, bytes, bytes]

MAX_SEGMENTS: Final = 65536

#: role -> the ledger index a site's live state of a VPN reflects: the
#: active's ``live_index`` (its ``live_message`` follows its ledger), the
#: standby's ``applied_index``; parameter (vpn)
REFLECTED_INDEX: Final = {
    "active": "SELECT live_index FROM vpn_live_state WHERE vpn = %s",
    "standby": "SELECT applied_index FROM vpn_state WHERE vpn = %s",
}

#: a VPN's live rows of given keys: parameters (queues, ids, vpn), the keys
#: as two arrays (``live_message`` column order)
ROWS_OF_KEYS: Final = """
SELECT m.queue, m.repl_id, m.publish_index, m.exchange, m.routing_key, m.properties, m.body
FROM live_message m JOIN unnest(%s::text[], %s::bytea[]) AS k(queue, repl_id)
  ON m.queue = k.queue AND m.repl_id = k.repl_id
WHERE m.vpn = %s
"""


def segment_sql(segments: int) -> str:
    """The segment of a ``live_message`` row, as SQL."""
    if not 1 <= segments <= MAX_SEGMENTS:
        raise ValueError(f"segments must be 1 to {MAX_SEGMENTS}, got {segments}")
    return f"mod(get_byte(repl_id, 14) * 256 + get_byte(repl_id, 15), {int(segments)})"


def row_digest_sql() -> str:
    """A row's 64-bit digest, computed by PostgreSQL (push-down): the
    extended hash of the record of its fields (``hash_record_extended``,
    PostgreSQL 14 on; the same functions hash partitioning relies on, so
    both sites compute the same value given the same byte order). About a
    quarter of the CPU of an MD5 over the concatenated fields
    (``bench/RESULTS.md``); not cryptographic, which a comparison of two
    sites' own copies does not need."""
    return (
        "hash_record_extended((repl_id, publish_index, exchange, routing_key, properties, body), 0)"
    )


def quote_literal(text: str) -> str:
    """``text`` as an SQL string literal, for a statement that takes no
    parameters (Spark's JDBC source sends the query text as it is). The
    server's ``standard_conforming_strings`` is on (PostgreSQL's default
    since 9.1, and the schema's migrations check nothing else); a NUL,
    which PostgreSQL text cannot hold, is refused."""
    if "\x00" in text:
        raise ValueError("a NUL character cannot be in an SQL literal")
    return "'" + text.replace("'", "''") + "'"


# The queries Spark's JDBC source sends. It takes no bind parameters, so the
# VPN's name goes in as a literal quoted by quote_literal (the caller checks
# the server reads literals the standard way); everything else in them is
# this module's text and integers.


def segment_hashes_query(vpn: str, segments: int) -> str:
    """Per (queue, segment) of ``vpn``: row count and digest sum (as text),
    computed in PostgreSQL."""
    return (
        f"SELECT queue, {segment_sql(segments)} AS segment, count(*) AS n, "  # noqa: S608
        f"sum({row_digest_sql()})::text AS total "
        f"FROM live_message WHERE vpn = {quote_literal(vpn)} GROUP BY 1, 2"
    )


def segment_rows_query(vpn: str, segments: int, which: Iterable[tuple[str, int]]) -> str:
    """Key, segment and digest of each row of ``vpn`` in the (queue,
    segment) pairs ``which``."""
    seg = segment_sql(segments)
    listed = ", ".join(f"({quote_literal(q)}, {int(s)})" for q, s in which)
    return (
        f"SELECT queue, repl_id, {seg} AS segment, {row_digest_sql()} AS digest "  # noqa: S608
        f"FROM live_message WHERE vpn = {quote_literal(vpn)} "
        f"AND (queue, {seg}) IN (VALUES {listed})"
    )


def live_rows_query(vpn: str, segments: int, partitions: int) -> str:
    """Every live row of ``vpn`` with its segment and a read partition
    (``part``, in ``[0, partitions)``) for parallel reads."""
    return (
        "SELECT queue, repl_id, publish_index, exchange, routing_key, properties, body, "  # noqa: S608
        f"{segment_sql(segments)} AS segment, "
        f"mod(get_byte(repl_id, 15), {int(partitions)}) AS part "
        f"FROM live_message WHERE vpn = {quote_literal(vpn)}"
    )


@dataclass(frozen=True, slots=True)
class Difference:
    """One row that differs: the kind, and the key."""

    kind: str
    queue: str
    repl_id: bytes


def compare_rows(
    active: Mapping[LiveKey, RowContent],
    standby: Mapping[LiveKey, RowContent],
    keys: Iterable[LiveKey],
) -> list[Difference]:
    """How the two sites' rows of ``keys`` differ (rows absent from a map
    are absent on that site)."""
    out = []
    for key in keys:
        a, b = active.get(key), standby.get(key)
        if a == b:
            continue
        kind = MISSING_ON_STANDBY if b is None else EXTRA_ON_STANDBY if a is None else DIFFERS
        out.append(Difference(kind, key[0], key[1]))
    return out


def touched(events: Iterable[Event]) -> tuple[set[LiveKey], set[str]]:
    """The live rows ``events`` change: their keys, and the queues a purge
    or delete changes as a whole."""
    keys: set[LiveKey] = set()
    queues: set[str] = set()
    for event in events:
        if isinstance(event, Published):
            keys.update((q, event.repl_id.value) for q in event.queues)
        elif isinstance(event, Consumed):
            keys.add((event.queue, event.repl_id.value))
        elif isinstance(event, DeadLettered):
            keys.add((event.queue, event.repl_id.value))
            keys.update((q, event.repl_id.value) for q in event.to)
        elif isinstance(event, Purged):
            queues.add(event.queue)
    return keys, queues
