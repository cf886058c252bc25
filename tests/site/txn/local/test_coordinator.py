"""Internals, tested beside their module."""

from __future__ import annotations

import asyncio
import time

import psycopg
import pytest

from bridge import (
    IdSource,
    TransactionRefused,
    VpnSettings,
)
from plugin.devtools import LocalSite
from tests.site.test_txn_coordinator import (
    NoStandby,
    RecordingStandby,
    active_site,
    opened,
    states,
    txn,
)
from txn.local import (
    Coordinator,
    MarkerStore,
)


def test_a_prepare_the_sites_database_does_not_record_in_time_is_refused(
    site_a: LocalSite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The site's PostgreSQL hangs (here: a lock holds ``txn_log``): the
    client's commit is refused after the bound, not held for as long as
    the database hangs; the standby's row is aborted at once, the local
    row once its write gets through."""
    from tests.fix_sites import until_a_lock_waits
    from txn.local import _coordinator

    monkeypatch.setattr(_coordinator, "PREPARE_BOUND_SECONDS", 0.5)
    dsn = active_site(site_a)
    ids = IdSource(18)
    t1 = txn(ids, 1)
    calls: list[tuple[str, str]] = []

    async def scenario() -> None:
        log, writer = await opened(dsn)
        standby = RecordingStandby(set(), calls)
        c = Coordinator(log, MarkerStore(site_a.rabbit.amqp_url()), writer, standby, standby)
        c.configure(VpnSettings.from_args("v", "active", "sync"))
        await c.markers.declare("v")
        with psycopg.connect(dsn) as locker:
            locker.execute("LOCK TABLE txn_log IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            with pytest.raises(TransactionRefused, match="did not record the prepare within 0.5 s"):
                await c.prepare(t1)
            assert time.monotonic() - started < 5
            assert calls == [("outcome", t1.txid)]  # the standby aborts its row
            await asyncio.to_thread(until_a_lock_waits, dsn, "the late prepare", lambda: True)
            locker.commit()
        for _ in range(100):
            if states(dsn).get(t1.txid) == "aborted":
                break
            await asyncio.sleep(0.05)
        await c.close()
        await writer.close()
        await log.close()

    asyncio.run(scenario())
    assert states(dsn) == {t1.txid: "aborted"}


def test_a_decision_the_sites_database_does_not_record_in_time_ends_the_clients_wait(
    site_a: LocalSite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker committed, then the site's PostgreSQL hangs (here: a lock
    holds the ledger): the client is told, after the bound, that the
    outcome is unknown, not kept waiting as long as the database hangs; the
    decision still commits once the database answers."""
    from tests.fix_sites import until_a_lock_waits
    from txn.local import _decision

    monkeypatch.setattr(_decision, "DECISION_BOUND_SECONDS", 0.5)
    dsn = active_site(site_a)
    ids = IdSource(19)
    t1 = txn(ids, 1)

    async def scenario() -> None:
        log, writer = await opened(dsn)
        c = Coordinator(log, MarkerStore(site_a.rabbit.amqp_url()), writer, NoStandby())
        c.configure(VpnSettings.from_args("v", "active"))
        await c.prepare(t1)
        answered: asyncio.Future[BaseException | None] = asyncio.Future()
        with psycopg.connect(dsn) as locker:
            locker.execute("LOCK TABLE ledger IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            c.commit_soon(t1, answered.set_result)
            error = await asyncio.wait_for(answered, 10)
            assert isinstance(error, TransactionRefused)
            assert "did not record the commit decision within 0.5 s" in str(error)
            assert time.monotonic() - started < 5
            await asyncio.to_thread(until_a_lock_waits, dsn, "the decision", lambda: True)
            locker.commit()
        await asyncio.wait_for(writer.wait_durable("v", 3), 10)
        for _ in range(100):
            if not c._live:
                break
            await asyncio.sleep(0.05)
        assert not c._live  # its books closed once the decision was durable
        await c.close()
        await writer.close()
        await log.close()

    asyncio.run(scenario())
    assert states(dsn) == {t1.txid: "committed"}
