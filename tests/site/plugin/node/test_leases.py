"""A node's VPN leases (plugin/node/_leases.py) against a real PostgreSQL:
while one node renews, another cannot take the VPN; a node that hangs
judges its lease gone when its time runs out, before another takes it,
and when it wakes its renewal finds the new term and reports the loss."""

from __future__ import annotations

import asyncio

import psycopg

from plugin.devtools import LocalSite
from plugin.node._leases import LeaseKeeper
from sql import migrate
from tests.site.bridge.store.test_vpn_config import enable

SECONDS = 0.6


def test_a_hung_leader_judges_its_lease_gone_before_another_node_takes_it(
    site_a: LocalSite,
) -> None:
    dsn = site_a.pg.dsn()
    migrate(dsn)
    enable(dsn, "orders", "active")
    lost: list[tuple[str, str, int]] = []

    async def scenario() -> None:
        a1 = LeaseKeeper(dsn, "a1#1", SECONDS, lambda vpn, term: lost.append(("a1", vpn, term)))
        a2 = LeaseKeeper(dsn, "a2#1", SECONDS, lambda vpn, term: lost.append(("a2", vpn, term)))
        assert await a1.take("orders") == 1 and a1.term("orders") == 1
        renewing = asyncio.create_task(a1.run())
        for _ in range(4):  # two lease times: a1 renews, a2 never gets it
            await asyncio.sleep(SECONDS / 2)
            assert await a2.take("orders") is None
        renewing.cancel()  # a1 hangs: no renewal goes out
        await asyncio.sleep(SECONDS)
        assert a1.term("orders") is None  # judged on its own clock, before a2 took it
        assert lost == [("a1", "orders", 1)]
        assert await a2.take("orders") == 2
        await a1.renew()  # a1 wakes: nothing to renew, nothing reported twice
        assert lost == [("a1", "orders", 1)] and a2.term("orders") == 2
        await a2.close()  # released: a1 may take it at once, as a new holder
        assert await a1.take("orders") == 3 and a1.holder_id.endswith("-1")  # a new holder
        await a1.close()

    asyncio.run(scenario())


def test_a_renewal_that_finds_another_term_reports_the_loss(site_a: LocalSite) -> None:
    """The lease was taken over while its holder still judged it valid (a
    lease time set longer on the taker's side, or an operator's takeover):
    the next renewal finds another term and the holder stops at once."""
    dsn = site_a.pg.dsn()
    migrate(dsn)
    enable(dsn, "orders", "active")
    lost: list[tuple[str, int]] = []

    async def scenario() -> None:
        a1 = LeaseKeeper(dsn, "a1#1", 30, lambda vpn, term: lost.append((vpn, term)))
        a2 = LeaseKeeper(dsn, "a2#1", 30, lambda vpn, term: lost.append((vpn, term)))
        assert await a1.take("orders") == 1
        with psycopg.connect(dsn, autocommit=True) as db:  # a takeover behind a1's back
            db.execute("UPDATE lease SET expires_at = now() WHERE scope = 'orders'")
        assert await a2.take("orders") == 2
        assert a1.term("orders") == 1  # its own clock still says so
        await a1.renew()
        assert a1.term("orders") is None and lost == [("orders", 1)]
        # a1 takes it again once a2 lets go: a new term, which fences what
        # a1 wrote before it noticed the loss
        await a2.release("orders")
        assert await a1.take("orders") == 3
        await a1.close()
        await a2.close()

    asyncio.run(scenario())
