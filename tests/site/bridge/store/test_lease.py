"""A VPN's lease among a site's nodes (bridge/store/_lease.py) against a
real PostgreSQL: one holder at a time, the term rising when the lease
changes hands, an earlier holder fenced by the term, a release handing it
over at once."""

from __future__ import annotations

import time

import psycopg

from bridge.store import holds_term, lease_of, release_lease, renew_lease, take_lease
from tests.site.bridge.store.test_vpn_config import enable


def test_one_holder_at_a_time_and_the_term_fences_the_one_before(dsn: str) -> None:
    enable(dsn, "orders", "active")
    with psycopg.connect(dsn, autocommit=True) as db:
        assert lease_of("orders").run(db) is None
        assert take_lease("orders", "a1#1", 0.5).run(db) == 1
        assert take_lease("orders", "a2#1", 0.5).run(db) is None  # a1's lease runs
        assert take_lease("orders", "a1#1", 0.5).run(db) == 1  # a holder takes it again: same term
        assert renew_lease("orders", "a1#1", 1, 0.5).run(db) == 1
        holder, term, left = lease_of("orders").run(db) or ("", 0, 0.0)
        assert (holder, term) == ("a1#1", 1) and 0 < left <= 0.5
        time.sleep(0.6)  # a1 paused past its lease
        assert take_lease("orders", "a2#1", 5).run(db) == 2
        # a1 wakes: it cannot renew, and a write under its term is refused
        assert renew_lease("orders", "a1#1", 1, 5).run(db) is None
        assert holds_term("orders", "a1#1", 1).run(db) is False
        assert holds_term("orders", "a2#1", 2).run(db) is True
        assert take_lease("orders", "a1#1", 5).run(db) is None
        # a2 hands over: the next taker need not wait for the expiry
        assert release_lease("orders", "a2#1", 2).run(db) == 2
        assert release_lease("orders", "a2#1", 2).run(db) == 2  # again: harmless
        assert take_lease("orders", "a1#2", 5).run(db) == 3  # a restarted a1 is a new holder
        assert release_lease("orders", "a2#1", 2).run(db) is None  # not a2's any more


def test_a_lease_that_expired_unclaimed_is_a_new_term_even_for_its_holder(dsn: str) -> None:
    """A holder whose lease expired may renew it while nobody took it (the
    term is still its own); taking it again after the expiry starts a new
    term, since anything may have happened in between."""
    enable(dsn, "orders", "active")
    with psycopg.connect(dsn, autocommit=True) as db:
        assert take_lease("orders", "a1#1", 0.2).run(db) == 1
        time.sleep(0.3)
        assert renew_lease("orders", "a1#1", 1, 5).run(db) == 1
        assert holds_term("orders", "a1#1", 1).run(db) is True
        db.execute("UPDATE lease SET expires_at = now() WHERE scope = 'orders'")
        assert take_lease("orders", "a1#1", 5).run(db) == 2
