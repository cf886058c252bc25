"""Internals, tested beside their module."""

from __future__ import annotations

import asyncio

import pytest

from bridge.active import _stream as _outbound
from plugin.devtools import LocalSite
from tests.two_sites.test_bridge_transport import (
    VPN,
    HeldStandby,
    applied,
    commit_group,
    events,
    held_standby,
    prepare,
    run,
    same_state,
    scalar,
    sql,
    until,
)
from txn.local import encode_events


def test_a_group_committed_early_streams_once_the_standby_answered(
    site_a: LocalSite, site_b: LocalSite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream holds a group the standby was asked to commit early until
    it answers — yes (it skips the copy) or no (it applies the copy) — and
    the two sites end equal either way."""
    monkeypatch.setattr(_outbound, "ANSWER_WAIT", 60.0)  # only an answer releases it
    a_dsn, b_dsn = prepare(site_a, orders="active"), prepare(site_b)

    async def scenario() -> None:
        async with held_standby(site_a, site_b) as (a, b):
            ahead: list[str] = []
            # t1 is prepared on the standby: it commits it ahead
            group = events(31, 6)  # publishes and a consumption
            sql(
                b_dsn,
                "INSERT INTO txn_log (txid, vpn, side, state, events, ledger_floor)"
                " VALUES ('t1', %s, 'participant', 'prepared', %s, 0)",
                VPN,
                encode_events(group),
            )
            first = commit_group(a, "t1", group, ahead)
            end = first + len(group) - 1
            await a.writer.wait_durable(VPN, end)
            await asyncio.sleep(0.3)  # time enough for a copy sent at once to arrive
            b.gate.set()
            await until(lambda: applied(b_dsn) == end, "the group on B")
            assert b.stream_at == [first]  # the copy came after the answer
            assert ahead == ["t1"]
            assert scalar(b_dsn, "SELECT state FROM txn_log WHERE txid = 't1'") == "committed"
            await asyncio.to_thread(same_state, a_dsn, b_dsn)
            # t2 is not prepared there: it says so, and applies the copy
            group = events(37, 6)
            first = commit_group(a, "t2", group, ahead)
            end = first + len(group) - 1
            await until(lambda: applied(b_dsn) == end, "the declined group on B")
            assert b.stream_at[1] == first
            assert ahead == ["t1"]
            await asyncio.to_thread(same_state, a_dsn, b_dsn)

    run(scenario)


def test_a_group_whose_early_commit_is_not_answered_streams_after_a_wait(
    site_a: LocalSite,
    site_b: LocalSite,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(_outbound, "ANSWER_WAIT", 0.5)
    monkeypatch.setattr(HeldStandby, "silent", True)
    a_dsn, b_dsn = prepare(site_a, orders="active"), prepare(site_b)

    async def scenario() -> None:
        async with held_standby(site_a, site_b) as (a, b):
            b.gate.set()
            ahead: list[str] = []
            group = events(31, 6)
            first = commit_group(a, "t1", group, ahead)
            end = first + len(group) - 1
            await until(lambda: applied(b_dsn) == end, "the unanswered group on B")
            assert ahead == []
            await asyncio.to_thread(same_state, a_dsn, b_dsn)
        waited = [r for r in caplog.records if "no answer to an early commit" in r.message]
        assert len(waited) == 1

    run(scenario)
