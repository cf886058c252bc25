"""The fault suite's checker, fed histories built by hand: each kind of
violation is found, and each allowed anomaly is allowed only with its cause."""

from __future__ import annotations

import json

from tests.fault.checker import (
    Fault,
    Final,
    History,
    OldActive,
    Publish,
    Txn,
    check,
    report_json,
    table,
    violations,
)

Q1, Q2 = "orders.q1", "orders.q2"


def history(mode: str = "sync") -> History:
    h = History(mode, consumed_queues=frozenset({Q1}))
    for n in range(1, 6):
        h.published[n] = Publish((Q1, Q2), "confirmed")
    return h


def final(broker: dict[str, list[int]], standby: dict[str, set[int]] | None = None) -> Final:
    live = {q: set(ns) for q, ns in broker.items()}
    return Final(broker, live, live if standby is None else standby)


def broken(h: History, f: Final) -> dict[str, dict[str, list[object]]]:
    return violations(h, check(h, f))


def test_a_clean_run_has_no_violation() -> None:
    h = history()
    h.acked[(1, Q1)] = 10.0
    assert broken(h, final({Q1: [2, 3, 4, 5], Q2: [1, 2, 3, 4, 5]})) == {}


def test_a_confirmed_message_missing_is_lost() -> None:
    assert broken(history(), final({Q1: [1, 2, 3, 4, 5], Q2: [1, 2, 4, 5]})) == {Q2: {"lost": [3]}}


def promoted(mode: str, policy: str = "reject", applied: int = 3) -> History:
    """Numbers 1-5 at the old active's ledger indexes 1-5; the standby had
    applied up to ``applied`` when it was promoted."""
    h = history(mode)
    h.policy = policy
    h.old_active = OldActive(applied, index_of={n: n for n in range(1, 6)})
    return h


def test_in_sync_reject_a_confirmed_message_only_in_the_exported_tail_is_lost() -> None:
    h = promoted("sync", "reject")
    h.exported_tail = frozenset({5})
    assert broken(h, final({Q1: [1, 2, 3, 4], Q2: [1, 2, 3, 4]})) == {
        Q1: {"lost": [5]},
        Q2: {"lost": [5]},
    }


def test_in_sync_reject_nothing_past_the_applied_index_may_be_lost_either() -> None:
    h = promoted("sync", "reject")  # the old active never came back: no tail
    assert broken(h, final({Q1: [1, 2, 3], Q2: [1, 2, 3, 4]})) == {
        Q1: {"lost": [4, 5]},
        Q2: {"lost": [5]},
    }


def test_in_sync_degrade_only_what_was_confirmed_while_ineligible_may_be_lost() -> None:
    h = promoted("sync", "degrade", applied=2)
    h.old_active.ineligible = [(4, 4)]  # type: ignore[union-attr]
    verdicts = check(h, final({Q1: [1], Q2: [1]}))
    # 2: the standby had it; 3 and 5: confirmed while the VPN was eligible
    assert violations(h, verdicts) == {Q1: {"lost": [2, 3, 5]}, Q2: {"lost": [2, 3, 5]}}
    assert [v.lost_excused for v in verdicts] == [[4], [4]]


def test_in_async_only_what_lay_past_the_applied_index_may_be_lost() -> None:
    h = promoted("async", applied=3)
    verdicts = check(h, final({Q1: [1, 4], Q2: [1, 4]}))
    assert violations(h, verdicts) == {Q1: {"lost": [2, 3]}, Q2: {"lost": [2, 3]}}
    assert [v.lost_excused for v in verdicts] == [[5], [5]]


def test_in_async_an_old_active_that_came_back_may_lose_only_its_exported_tail() -> None:
    h = promoted("async", applied=3)
    h.exported_tail = frozenset({5})
    verdicts = check(h, final({Q1: [1, 2, 3], Q2: [1, 2, 3]}))
    assert violations(h, verdicts) == {Q1: {"lost": [4]}, Q2: {"lost": [4]}}
    assert [v.lost_excused for v in verdicts] == [[5], [5]]


def test_after_republish_nothing_may_be_lost() -> None:
    h = promoted("async", applied=3)
    h.exported_tail = frozenset({4, 5})
    h.republished = True
    assert broken(h, final({Q1: [1, 2, 3, 4], Q2: [1, 2, 3, 4]})) == {
        Q1: {"lost": [5]},
        Q2: {"lost": [5]},
    }


def test_a_republished_tail_may_come_after_later_numbers_but_nothing_else() -> None:
    h = promoted("async", applied=3)
    h.exported_tail = frozenset({4})
    h.republished = True
    got = broken(h, final({Q1: [1, 2, 3, 4, 5], Q2: [1, 3, 2, 5, 4]}))
    assert got == {Q2: {"order": [(3, 2)]}}


def test_an_unsure_ack_makes_its_message_neither_lost_nor_resurrected() -> None:
    h = history()
    h.acks_unsure |= {(1, Q1), (2, Q1)}  # sent; no synchronous call came back after
    h.acked[(3, Q1)] = 50.0  # sent, and the broker had it
    got = broken(h, final({Q1: [2, 3, 4, 5], Q2: [1, 2, 3, 4, 5]}))
    assert got == {Q1: {"resurrected_unexplained": [3]}}


def test_with_the_old_active_gone_there_is_no_standby_to_compare() -> None:
    f = final({Q1: [1, 2, 3, 4, 5], Q2: [1, 2, 3, 4, 5]})
    f.standby_live = None
    assert broken(history(), f) == {}


def test_a_duplicate_is_allowed_only_after_a_client_retry() -> None:
    h = history()
    h.published[2].attempts = 2
    got = broken(h, final({Q1: [1, 2, 2, 3, 3, 4, 5], Q2: [1, 2, 3, 4, 5]}))
    assert got == {Q1: {"duplicated_unexplained": [3]}}


def test_a_message_nobody_published_is_unexpected() -> None:
    assert broken(history(), final({Q1: [1, 2, 3, 4, 5, 99], Q2: [1, 2, 3, 4, 5]})) == {
        Q1: {"unexpected": [99]}
    }


def test_a_resurrection_is_allowed_only_for_an_ack_in_flight() -> None:
    h = history()
    h.faults.append(Fault("kill node a", 100.0, 105.0))
    h.acked[(1, Q1)] = 95.0  # in flight when the fault began
    h.acked[(2, Q1)] = 50.0  # long before: it was replicated
    got = broken(h, final({Q1: [1, 2, 3, 4, 5], Q2: [1, 2, 3, 4, 5]}))
    assert got == {Q1: {"resurrected_unexplained": [2]}}
    h.published[2].attempts = 2  # a retry made a second copy: one was acked
    assert broken(h, final({Q1: [1, 2, 3, 4, 5], Q2: [1, 2, 3, 4, 5]})) == {}


def test_order_is_checked_per_publisher_on_queues_nobody_consumes() -> None:
    h = history()
    for n in (6, 7):
        h.published[n] = Publish((Q1, Q2), "confirmed", publisher=1)
    # 6 and 7 interleave with publisher 0's numbers freely; 3 before 2 does not
    got = broken(h, final({Q1: [3, 2, 1, 4, 5, 6, 7], Q2: [1, 6, 3, 2, 7, 4, 5]}))
    assert got == {Q2: {"order": [(3, 2)]}}


def test_a_transaction_half_present_is_half_applied() -> None:
    h = history()
    h.txns.append(Txn((10, 15), (Q2,), "committed"))
    h.txns.append(Txn((20, 25), (Q2,), "uncertain"))
    got = broken(h, final({Q1: [1, 2, 3, 4, 5], Q2: [1, 2, 3, 4, 5, 10, 20, 25]}))
    assert got == {Q2: {"lost": [15], "half_applied": [(10, 15)]}}


def test_the_standby_must_hold_what_the_active_holds() -> None:
    f = final({Q1: [1, 2, 3, 4, 5], Q2: [1, 2, 3, 4, 5]})
    f.standby_live = {Q1: {1, 2, 3, 4, 5, 6}, Q2: {1, 2, 3, 4}}
    assert broken(history(), f) == {Q1: {"standby_extra": [6]}, Q2: {"standby_missing": [5]}}


def test_the_report_is_json_and_a_table() -> None:
    h = history()
    verdicts = check(h, final({Q1: [1, 2, 3, 4, 5], Q2: [1, 2, 4, 5]}))
    doc = json.loads(report_json(h, verdicts, {"nemesis": "none"}))
    assert doc["violations"] == {Q2: {"lost": [3]}} and doc["nemesis"] == "none"
    text = table(verdicts)
    assert text.splitlines()[0].split()[:3] == ["queue", "expected", "present"]
    assert "orders.q2" in text


def test_a_confirmed_message_the_live_state_lacks_is_unreplicated() -> None:
    f = final({Q1: [1, 2, 3, 4, 5], Q2: [1, 2, 3, 4, 5]})
    f.active_live = f.standby_live = {Q1: {1, 2, 3, 4, 5}, Q2: {1, 2, 4, 5}}
    assert broken(history(), f) == {Q2: {"unreplicated": [3]}}


def test_a_phantom_is_allowed_only_from_an_unconfirmed_publish() -> None:
    h = history()
    h.published[6] = Publish((Q1, Q2), "uncertain")
    h.published[7] = Publish((Q1, Q2), "uncertain")
    f = final({Q1: [1, 2, 3, 4, 5, 7], Q2: [1, 2, 3, 4, 5, 7]})
    f.active_live = f.standby_live = {q: {1, 2, 3, 4, 5, 6, 7} for q in (Q1, Q2)}
    verdicts = check(h, f)
    assert violations(h, verdicts) == {}
    assert [v.phantoms for v in verdicts] == [[6], [6]]
