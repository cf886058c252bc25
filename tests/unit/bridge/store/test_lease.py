"""How a VPN's leader judges its own lease (bridge/store/_vpn_lease.py)."""

from __future__ import annotations

from bridge.store import HeldLease


def test_the_holder_judges_its_lease_from_before_it_asked() -> None:
    """The holder counts its lease from the moment before it sent the
    request: the database extended it no earlier than that."""
    asked = 100.0
    lease = HeldLease.asked_at("orders", "a1#1", 3, asked, 5.0)
    assert lease.valid(now=104.9) and not lease.valid(now=105.0)
    assert lease.term == 3 and lease.until == 105.0
