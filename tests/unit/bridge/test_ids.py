"""Replication ids: the header's 64-bit form and the source that hands them out."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from bridge import (
    COUNTER_LIMIT,
    INCARNATION_LIMIT,
    RENEW_MARGIN,
    IdsExhausted,
    IdSource,
    ReplicationId,
)

incarnations = st.integers(1, INCARNATION_LIMIT - 1)
counters = st.integers(0, COUNTER_LIMIT - 1)


@given(incarnations, counters)
def test_the_header_form_is_a_positive_int64_that_gives_the_id_back(inc: int, n: int) -> None:
    rid = ReplicationId.from_parts(inc, n)
    assert 0 < rid.wire < 2**63
    assert ReplicationId.from_wire(rid.wire) == rid


@given(st.tuples(incarnations, counters), st.tuples(incarnations, counters))
def test_distinct_ids_have_distinct_header_values(a: tuple[int, int], b: tuple[int, int]) -> None:
    ra, rb = ReplicationId.from_parts(*a), ReplicationId.from_parts(*b)
    assert (ra.wire == rb.wire) == (ra == rb)


@pytest.mark.parametrize(("inc", "n"), [(INCARNATION_LIMIT, 1), (1, COUNTER_LIMIT), (2**64 - 1, 0)])
def test_ids_outside_the_header_form_are_refused_not_truncated(inc: int, n: int) -> None:
    with pytest.raises(ValueError, match="does not fit the 64-bit header form"):
        _ = ReplicationId.from_parts(inc, n).wire


@pytest.mark.parametrize("wire", [-1, 2**63])
def test_a_header_value_outside_int64_positive_is_not_an_id(wire: int) -> None:
    with pytest.raises(ValueError, match="positive int64"):
        ReplicationId.from_wire(wire)


@pytest.mark.parametrize("inc", [0, -3, INCARNATION_LIMIT])
def test_an_incarnation_the_id_cannot_hold_is_refused(inc: int) -> None:
    with pytest.raises(ValueError, match=f"incarnation {inc} does not fit"):
        IdSource(inc)


def test_ids_count_up_within_their_incarnation() -> None:
    ids = IdSource(5)
    assert [ids.next() for _ in range(3)] == [ReplicationId.from_parts(5, n) for n in (1, 2, 3)]


def test_running_low_asks_once_for_a_new_incarnation_and_continues_with_it() -> None:
    asked: list[int] = []
    first = COUNTER_LIMIT - RENEW_MARGIN - 1
    ids = IdSource(5, first=first, on_low=lambda: asked.append(1))
    before = ids.next()
    assert asked == []
    low = [ids.next() for _ in range(3)]
    assert asked == [1]  # once, however many ids follow
    ids.renew(6)
    after = ids.next()
    assert after == ReplicationId.from_parts(6, 1)
    assert len({before, *low, after}) == 5


def test_without_a_new_incarnation_the_source_stops_rather_than_reuse_ids() -> None:
    ids = IdSource(5, first=COUNTER_LIMIT - 1)
    last = ids.next()
    assert last.wire == (5 << 44) | (COUNTER_LIMIT - 1)
    with pytest.raises(IdsExhausted, match="restart the node"):
        ids.next()
