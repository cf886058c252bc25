"""The fault suite's checker: what clients were told against what the sites hold.

Sans-IO: a :class:`History` (what every client did and was told, with the
faults applied) and the :class:`Final` state read after the sites healed
and drained go in; a :class:`Verdict` per queue comes out, and
:func:`violations` says which of them break the mode's promise
(:data:`EXPECTATIONS`, written once here). ``tests/fault/test_checker.py`` feeds
it histories built by hand, including each kind of violation.

Kinds, per queue:

* **lost**: confirmed (or in a committed transaction), routed to the queue,
  never acked there, and absent from the active broker — unless the mode
  and policy excuse it (below: **lost, excused**);
* **duplicated**: present more than once; explained by a client's retry
  when the number was published more than once;
* **unexpected**: present, never published by any client;
* **resurrected**: acked (the ack was sent) and present again; explained
  by an ACK in flight when the ack was sent within :data:`ACK_IN_FLIGHT`
  seconds before a fault began or while one lasted, or by a client's retry
  (the acked copy was one of two);
* **order**: two numbers one publisher sent in order on one channel,
  present in the other order (checked on queues no consumer takes from;
  a client's retry and a republished tail may come after later numbers);
* **half-applied**: a transaction some of whose publishes are present and
  some absent (on a queue no consumer takes from);
* **unreplicated**: confirmed (or committed), in the active broker, never
  acked, and not in the active's live state: a failover would lose it;
* **standby differs**: the standby's live state is not the active's;
* **phantom** (reported, allowed): in the live state of both sites but not
  in the broker, from a publish whose confirm never came — the broker died
  before taking it.

What may be lost after a promotion (:class:`OldActive` says what the old
active's ledger showed, read from its PostgreSQL afterwards), per mode and
sync-timeout policy (:data:`EXPECTATIONS` and :func:`_excuse`):

* sync + ``reject``: nothing, tail or not;
* sync + ``degrade``: only what the old active confirmed while the VPN was
  sync-ineligible (its ledger index inside a window the product recorded)
  and the standby had not applied;
* async: only what lay past the standby's applied index at the promotion;
* either way, when the old active came back and ``demote`` exported its
  tail, only what is in that tail; after ``republish``, nothing.

An ack counts once the client sent it **and** a synchronous call on the
same channel returned after it (the broker had it); an ack sent with no
such call after it is *unsure*: its message may be present or not.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "ACK_IN_FLIGHT",
    "EXPECTATIONS",
    "Fault",
    "Final",
    "History",
    "OldActive",
    "Publish",
    "Txn",
    "Verdict",
    "check",
    "table",
    "violations",
]

#: an ack sent this long before a fault (or during it) may not have reached
#: the ledger: its message may come back
ACK_IN_FLIGHT = 10.0


@dataclass
class Publish:
    """One number a publisher sent: how the client was told it ended."""

    queues: tuple[str, ...]
    outcome: str  # confirmed, nacked, uncertain (sent, no answer before the connection died)
    publisher: int = 0  # which publisher (order is checked per publisher)
    attempts: int = 1  # sent more than once: a client retry
    #: the site whose listener gave the last answer ("a", "b"; "" unknown)
    answered_by: str = ""


@dataclass
class Txn:
    numbers: tuple[int, ...]
    queues: tuple[str, ...]
    outcome: str  # committed, failed (an error), uncertain (connection lost at commit)


@dataclass
class Fault:
    name: str
    start: float
    end: float


@dataclass
class OldActive:
    """What a promotion left behind, read from the old active's database."""

    #: the old active's ledger index the standby had applied when promoted
    #: (the new epoch's ``taken_over_at``)
    applied_at_promotion: int
    #: number -> the old active's ledger index of its publish
    index_of: dict[int, int] = field(default_factory=dict)
    #: ledger index ranges (first, last) the old active confirmed while the
    #: VPN was sync-ineligible (sync + ``degrade``)
    ineligible: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class History:
    mode: str
    #: the sync-timeout policy (sync mode): ``reject`` or ``degrade``
    policy: str = "reject"
    published: dict[int, Publish] = field(default_factory=dict)
    #: (number, queue) -> when the ack was sent; only acks a later
    #: synchronous call on their channel showed the broker had
    acked: dict[tuple[int, str], float] = field(default_factory=dict)
    #: acks sent with no synchronous call returning after them
    acks_unsure: set[tuple[int, str]] = field(default_factory=set)
    txns: list[Txn] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    #: queues some consumer takes from (no order or atomicity check there)
    consumed_queues: frozenset[str] = frozenset()
    #: numbers a demoted former active exported as its unreplicated tail
    #: (None: nothing exported — no promotion, or the old active never came back)
    exported_tail: frozenset[int] | None = None
    #: set by a promotion: what the old active's ledger showed
    old_active: OldActive | None = None
    #: the exported tail was republished on the new active
    republished: bool = False


@dataclass
class Final:
    """The sites after healing and draining."""

    #: queue -> numbers in the active broker, in queue order
    broker: dict[str, list[int]]
    #: queue -> numbers in the active's and the standby's live state (None:
    #: no standby — the old active is gone for good)
    active_live: dict[str, set[int]]
    standby_live: dict[str, set[int]] | None


@dataclass
class Verdict:
    queue: str
    expected: int = 0
    present: int = 0
    lost: list[int] = field(default_factory=list)
    duplicated: list[int] = field(default_factory=list)
    duplicated_unexplained: list[int] = field(default_factory=list)
    unexpected: list[int] = field(default_factory=list)
    resurrected: list[int] = field(default_factory=list)
    resurrected_unexplained: list[int] = field(default_factory=list)
    order: list[tuple[int, int]] = field(default_factory=list)
    half_applied: list[tuple[int, ...]] = field(default_factory=list)
    standby_missing: list[int] = field(default_factory=list)
    standby_extra: list[int] = field(default_factory=list)
    #: lost, and what the mode and policy allow to be lost (:func:`_excuse`)
    lost_excused: list[int] = field(default_factory=list)
    unreplicated: list[int] = field(default_factory=list)
    phantoms: list[int] = field(default_factory=list)
    phantoms_unexplained: list[int] = field(default_factory=list)


#: what every mode and policy promises: a kind listed here must be empty.
#: They differ only in what a promotion may lose, which :func:`_excuse`
#: decides number by number (``lost_excused``).
EXPECTATIONS = (
    "lost",
    "unreplicated",
    "phantoms_unexplained",
    "duplicated_unexplained",
    "unexpected",
    "resurrected_unexplained",
    "order",
    "half_applied",
    "standby_missing",
    "standby_extra",
)


def _excuse(history: History, n: int) -> bool:
    """May the confirmed ``n``, missing from the active, be lost?"""
    old = history.old_active
    if old is None or history.republished:
        return False  # no promotion; or the tail went back in
    if history.exported_tail is not None and n not in history.exported_tail:
        return False  # the old active came back: what it lacked is in its tail
    index = old.index_of.get(n)
    if index is None or index <= old.applied_at_promotion:
        return False  # the standby had it: a promotion keeps it
    if history.mode == "async":
        return True
    if history.policy == "degrade":
        return any(first <= index <= last for first, last in old.ineligible)
    return False  # sync + reject: a confirm waited for the standby


def _in_flight(sent: float, faults: list[Fault]) -> bool:
    return any(f.start - ACK_IN_FLIGHT <= sent <= f.end for f in faults)


def _told_present(history: History) -> dict[str, set[int]]:
    """Queue -> numbers a client was told are there (confirmed publishes,
    committed transactions)."""
    told: dict[str, set[int]] = {}
    for n, p in history.published.items():
        if p.outcome == "confirmed":
            for q in p.queues:
                told.setdefault(q, set()).add(n)
    for t in history.txns:
        if t.outcome == "committed":
            for q in t.queues:
                told.setdefault(q, set()).update(t.numbers)
    return told


def check(history: History, final: Final) -> list[Verdict]:
    """One verdict per queue the history or the sites name."""
    told = _told_present(history)
    known: set[int] = set(history.published)
    for t in history.txns:
        known.update(t.numbers)
    queues = sorted(set(told) | set(final.broker) | set(final.active_live))
    return [_verdict(q, history, final, told.get(q, set()), known) for q in queues]


def _verdict(q: str, history: History, final: Final, told: set[int], known: set[int]) -> Verdict:
    v = Verdict(q)
    in_broker = final.broker.get(q, [])
    counts = Counter(in_broker)
    acked = {n for (n, queue) in history.acked if queue == q}
    unsure = {n for (n, queue) in history.acks_unsure if queue == q}
    expected = told - acked - unsure
    v.expected, v.present = len(expected), len(in_broker)
    for n in sorted(expected - set(counts)):
        (v.lost_excused if _excuse(history, n) else v.lost).append(n)
    for n, c in sorted(counts.items()):
        p = history.published.get(n)
        if c > 1:
            v.duplicated.append(n)
            if p is None or p.attempts < 2:
                v.duplicated_unexplained.append(n)
        if n not in known:
            v.unexpected.append(n)
        if n in acked:
            v.resurrected.append(n)
            retried = p is not None and p.attempts > 1  # its other copy stays
            if not retried and not _in_flight(history.acked[(n, q)], history.faults):
                v.resurrected_unexplained.append(n)
    if q not in history.consumed_queues:
        # a republished tail comes after what the new active took meanwhile
        moved = history.exported_tail if history.republished else None
        v.order = _order_violations(in_broker, history, moved or frozenset())
        v.half_applied = [
            t.numbers
            for t in history.txns
            if q in t.queues and 0 < len(set(t.numbers) & set(counts)) < len(t.numbers)
        ]
    active = final.active_live.get(q, set())
    if final.standby_live is not None:
        standby = final.standby_live.get(q, set())
        v.standby_missing = sorted(active - standby)
        v.standby_extra = sorted(standby - active)
    v.unreplicated = sorted((expected & set(counts)) - active)
    v.phantoms = sorted(active - set(counts) - acked - unsure)
    v.phantoms_unexplained = [
        n
        for n in v.phantoms
        if _told_confirmed(history, n) and n not in v.lost and n not in v.lost_excused
    ]
    return v


def _told_confirmed(history: History, n: int) -> bool:
    p = history.published.get(n)
    return p is None or p.outcome == "confirmed"


def _order_violations(
    in_broker: list[int], history: History, republished: frozenset[int]
) -> list[tuple[int, int]]:
    """Adjacent pairs of one publisher's numbers (first copies) out of order;
    a retry and a republished number may come after later ones."""
    last: dict[int, int] = {}
    seen: set[int] = set()
    out = []
    for n in in_broker:
        p = history.published.get(n)
        if p is None or n in seen or p.attempts > 1 or n in republished:
            continue
        seen.add(n)
        before = last.get(p.publisher)
        if before is not None and n < before:
            out.append((before, n))
        last[p.publisher] = n
    return out


def violations(history: History, verdicts: list[Verdict]) -> dict[str, dict[str, list[Any]]]:
    """Queue -> kind -> what breaks ``history.mode``'s promise (empty: none)."""
    out: dict[str, dict[str, list[Any]]] = {}
    for v in verdicts:
        broken = {k: getattr(v, k) for k in EXPECTATIONS if getattr(v, k)}
        if broken:
            out[v.queue] = broken
    return out


def table(verdicts: list[Verdict]) -> str:
    """The short text table of a run's report."""
    head = (
        "queue", "expected", "present", "lost", "excused", "dup (unexpl.)", "unexpected",
        "resurrected (unexpl.)", "order", "half", "unrepl.", "phantoms", "standby -/+",
    )  # fmt: skip
    rows = [head]
    for v in verdicts:
        rows.append(
            (
                v.queue,
                str(v.expected),
                str(v.present),
                str(len(v.lost)),
                str(len(v.lost_excused)),
                f"{len(v.duplicated)} ({len(v.duplicated_unexplained)})",
                str(len(v.unexpected)),
                f"{len(v.resurrected)} ({len(v.resurrected_unexplained)})",
                str(len(v.order)),
                str(len(v.half_applied)),
                str(len(v.unreplicated)),
                f"{len(v.phantoms)} ({len(v.phantoms_unexplained)})",
                f"{len(v.standby_missing)}/{len(v.standby_extra)}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def report_json(history: History, verdicts: list[Verdict], extra: dict[str, Any]) -> str:
    return json.dumps(
        {
            "mode": history.mode,
            "policy": history.policy,
            "faults": [asdict(f) for f in history.faults],
            "published": len(history.published),
            "acked": len(history.acked),
            "transactions": Counter(t.outcome for t in history.txns),
            "verdicts": [asdict(v) for v in verdicts],
            "violations": violations(history, verdicts),
            **extra,
        },
        indent=1,
        default=list,
    )
