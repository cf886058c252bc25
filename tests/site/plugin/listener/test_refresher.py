"""The directory refresher against a real management API."""

from __future__ import annotations

import asyncio

import pika

from bridge import Role, VpnSettings
from bridge.broker import ManagementAPI
from plugin.devtools import LocalSite
from plugin.listener import DirectoryRefresher
from plugin.topology import VpnDirectory, VpnView


def _declare(site: LocalSite, vhost: str, queue: str, exchange: str = "events") -> None:
    conn = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url(vhost)))
    ch = conn.channel()
    ch.exchange_declare(exchange, "topic", durable=True)
    ch.queue_declare(queue, durable=True)
    ch.queue_bind(queue, exchange, "order.#")
    conn.close()


def _refresher(site: LocalSite, directory: VpnDirectory, settings: list[VpnSettings]):
    async def load() -> list[VpnSettings]:
        return settings

    return DirectoryRefresher(directory, ManagementAPI(site.rabbit.management_url), load)


def test_refresh_loads_enabled_vpns_with_their_topology(site_a: LocalSite) -> None:
    site_a.rabbit.add_vhost("orders")
    _declare(site_a, "orders", "orders.q1")
    directory = VpnDirectory()
    settings = [VpnSettings.from_args("orders", "active", queues=(r"orders\..*",))]
    asyncio.run(_refresher(site_a, directory, settings).refresh())
    view = directory.lookup("orders")
    assert view is not None and view.role is Role.ACTIVE
    assert view.topology.route("events", "order.created", None) == {"orders.q1"}
    assert view.scope.in_scope("events", "order.created", frozenset({"orders.q1"})) == {"orders.q1"}


def test_refresh_picks_up_what_bypassed_the_listener_and_drops_disabled_vpns(
    site_a: LocalSite,
) -> None:
    site_a.rabbit.add_vhost("orders")
    directory = VpnDirectory()
    settings = [VpnSettings.from_args("orders", "active")]
    refresher = _refresher(site_a, directory, settings)
    asyncio.run(refresher.refresh())
    view = directory.lookup("orders")
    assert view is not None
    assert view.topology.route("events", "order.x", None) == frozenset()
    _declare(site_a, "orders", "late.q")  # directly at the broker
    asyncio.run(refresher.refresh())
    assert view.topology.route("events", "order.x", None) == {"late.q"}
    settings.clear()
    asyncio.run(refresher.refresh())
    assert directory.lookup("orders") is None


def test_a_snapshot_never_overwrites_a_newer_wire_change(site_a: LocalSite) -> None:
    site_a.rabbit.add_vhost("orders")
    directory = VpnDirectory()
    refresher = _refresher(site_a, directory, [VpnSettings.from_args("orders", "active")])
    asyncio.run(refresher.refresh())
    view = directory.lookup("orders")
    assert view is not None
    real_definitions = refresher.api.definitions

    def definitions_racing_a_wire_change(vhost: str) -> object:
        snapshot = real_definitions(vhost)
        view.topology.declare_queue("seen.on.the.wire", {})  # while the fetch was out
        return snapshot

    refresher.api.definitions = definitions_racing_a_wire_change  # type: ignore[method-assign]
    asyncio.run(refresher.refresh())
    assert "seen.on.the.wire" in view.topology.queues


def test_unreachable_management_api_keeps_the_old_view(site_a: LocalSite) -> None:
    site_a.rabbit.add_vhost("orders")
    directory = VpnDirectory()
    settings = [VpnSettings.from_args("orders", "active")]
    asyncio.run(_refresher(site_a, directory, settings).refresh())
    view = directory.lookup("orders")
    broken = DirectoryRefresher(
        directory,
        ManagementAPI("http://guest:guest@127.0.0.1:1/"),
        _refresher(site_a, directory, settings).load_settings,
    )
    asyncio.run(broken.refresh())
    assert directory.lookup("orders") is view


def test_a_vpn_whose_definitions_were_never_read_refuses_clients_until_they_are(
    site_a: LocalSite,
) -> None:
    """A node started while its broker was unreachable knows no queue of
    the VPN: admitted, its clients' publishes would route to no in-scope
    queue and be confirmed unreplicated. Refused (530) until the
    definitions are read, which is tried again every second."""
    site_a.rabbit.add_vhost("orders")
    _declare(site_a, "orders", "orders.q1")
    directory = VpnDirectory()
    settings = [VpnSettings.from_args("orders", "active", queues=(r"orders\..*",))]
    good = _refresher(site_a, directory, settings)
    unreachable = DirectoryRefresher(
        directory, ManagementAPI("http://guest:guest@127.0.0.1:1/"), good.load_settings
    )
    asyncio.run(unreachable.refresh())
    view = directory.lookup("orders")
    assert view is not None and view.refusal is not None
    assert "definitions of vhost 'orders' are not loaded yet" in view.refusal
    assert unreachable.unloaded == {"orders"}
    unreachable.api = good.api  # the broker is back
    asyncio.run(unreachable.refresh())
    assert view.refusal is None and unreachable.unloaded == set()
    assert view.topology.route("events", "order.created", None) == {"orders.q1"}


def test_exclusive_queues_stay_and_deleted_ones_are_reported_for_active_vpns(
    site_a: LocalSite,
) -> None:
    """A definitions export leaves exclusive queues out: one declared through
    the listener keeps its bindings; a queue deleted at the broker is handed
    to ``on_gone``, for an active VPN only."""
    for vhost in ("orders", "backup"):
        site_a.rabbit.add_vhost(vhost)
        _declare(site_a, vhost, f"{vhost}.q1")
        _declare(site_a, vhost, f"{vhost}.q2")
    directory = VpnDirectory()
    settings = [
        VpnSettings.from_args("orders", "active"),
        VpnSettings.from_args("backup", "standby"),
    ]
    reported: list[tuple[str, list[str]]] = []

    async def on_gone(view: VpnView, queues: list[str]) -> None:
        reported.append((view.name, queues))

    refresher = _refresher(site_a, directory, settings)
    refresher.on_gone = on_gone
    asyncio.run(refresher.refresh())
    view = directory.lookup("orders")
    assert view is not None
    owner = pika.BlockingConnection(pika.URLParameters(site_a.rabbit.amqp_url("orders")))
    owner.channel().queue_declare("orders.mine", exclusive=True)
    view.topology.bind_queue("orders.mine", "events", "order.#")  # as the session records it
    for vhost in ("orders", "backup"):
        site_a.rabbit.api("DELETE", f"queues/{vhost}/{vhost}.q2")
    asyncio.run(refresher.refresh())
    owner.close()
    assert reported == [("orders", ["orders.q2"])]
    assert view.topology.route("events", "order.x", None) == {"orders.q1", "orders.mine"}
