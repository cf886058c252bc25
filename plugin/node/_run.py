"""``vpnrepl node``'s life: relay while another node leads, lead once the
site's lease is this node's, and lead no longer once it is lost.

A site runs any number of nodes (``[nodes.NAME]``); one leads it at a time,
by the site's lease (``lease``, scope ``site``; :mod:`plugin.node._leases`).
The others relay their listeners to the leader (:mod:`plugin.node._relay`)
and try for the lease a third of the lease time apart. The one that takes
it stops relaying, starts the whole site (:class:`~plugin.node._node.Node`:
recovery of what the previous leader left in doubt first, clients last) and
commits every ledger batch under its term (``LedgerWriter.fence``). When it
loses the lease (its renewal finds another term, or its own monotonic clock
says the lease ran out unrenewed: a pause, a hung database), it closes its
clients with 320, stops the site's parts, and goes back to relaying as a
new holder. A clean stop releases the lease, so another node takes over
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import psycopg

from bridge import BridgeError, UnknownFailpoint, armed
from bridge.store import (
    SITE,
    Fence,
    beat,
    end_sessions,
    lease_of,
    session_name,
    sessions_of,
)
from plugin._errors import PluginError, StateError, StoreUnavailable, UsageError
from plugin.admin import AdminServer
from plugin.config import NodeConfig, SiteConfig
from plugin.ops import store_unreachable

from ._follower import follower_admin
from ._leases import LeaseKeeper
from ._node import Node
from ._relay import Relay

__all__ = ["run_node"]

log = logging.getLogger("vpnrepl.node")


def lost_text(cfg: SiteConfig) -> str:
    """What a node that lost the lead tells its clients (320)."""
    return (
        f"node {cfg.holder!r} no longer leads site {cfg.site_name!r}: "
        "reconnect (another node of the site serves)"
    )


async def run_node(cfg: SiteConfig, stop: asyncio.Event | None = None) -> None:
    """Run this node until ``stop`` is set or SIGTERM/SIGINT arrives."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    _check_failpoint()
    lost = asyncio.Event()
    keeper = LeaseKeeper(cfg.store_dsn, cfg.holder, cfg.lease_seconds, lambda _s, _t: lost.set())
    try:
        await _check_store(cfg, keeper)
        while not stop.is_set():
            taken = await _follow(cfg, keeper, stop)
            if taken is None:
                break
            lost.clear()
            await _lead(cfg, keeper, *taken, stop, lost)
    except OSError as e:
        raise PluginError(str(e)) from e
    except BridgeError as e:
        raise PluginError(str(e)) from e
    finally:
        await keeper.close()  # a lease still held is released: the next node need not wait
    log.info("site %s: node %s stopped", cfg.site_name, cfg.holder)


def _check_failpoint() -> None:
    try:
        point = armed()  # an unknown name stops the node here
    except UnknownFailpoint as e:
        raise UsageError(str(e)) from e
    if point is not None:
        log.warning("failpoint %s is armed: this node kills itself there", point)


async def _check_store(cfg: SiteConfig, keeper: LeaseKeeper) -> None:
    """The site database answers and has this release's schema: a node
    that cannot start says why at once (later, it rides an outage out)."""
    try:
        await keeper.read(lease_of(SITE))
    except psycopg.errors.UndefinedTable as e:
        raise StateError(
            "the site database's schema is older than this release (no table lease): "
            "run `vpnrepl init`, which creates or upgrades it"
        ) from e
    except (psycopg.OperationalError, TimeoutError) as e:
        raise store_unreachable(cfg.store_dsn, e) from e


async def _follow(
    cfg: SiteConfig, keeper: LeaseKeeper, stop: asyncio.Event
) -> tuple[int, str | None] | None:
    """Relay to the leader until this node takes the lease (its term, and
    the holder it took it from), or ``stop`` (None)."""
    me = cfg.node(cfg.node_name)
    relay = Relay(me) if me is not None else None
    admin: AdminServer | None = None
    said: str | None = None
    try:
        while not stop.is_set():
            # a failed read keeps the leader known before: its relayed clients stay
            leader = relay.leader if relay is not None else None
            try:
                found = await keeper.read(lease_of(SITE))
                taken = await _try_lead(cfg, keeper, found)
                if taken is not None:
                    return taken
                if found is None or found[2] <= 0:  # a take was tried and lost: who won?
                    found = await keeper.read(lease_of(SITE))
                leader = _leader(cfg, found)
            except (TimeoutError, psycopg.Error) as e:
                log.warning("the site's lease could not be read or taken: %s", e)
            if relay is not None:
                relay.leader = leader
                if admin is None:  # listening once the lease was first read
                    await relay.start()
                    admin = follower_admin(cfg, relay)
                    await admin.start(cfg.listen_admin.host, cfg.listen_admin.port)
            await _beat(cfg, keeper, False)
            name = leader.name if leader is not None else "none"
            if name != said:
                log.info("node %s relays to the leader: node %s", cfg.holder, name)
                said = name
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), cfg.lease_seconds / 3)
        return None
    finally:
        if relay is not None:
            await relay.close()
        if admin is not None:
            await admin.close()


async def _try_lead(
    cfg: SiteConfig, keeper: LeaseKeeper, found: tuple[str, int, float] | None
) -> tuple[int, str | None] | None:
    """Take the site's lease if it is free or ran out (``found``: as just
    read): its term and the holder it ran out on. That holder's database
    sessions are ended first: one paused inside a ledger commit share-locks
    the lease row, and the take would wait on it for as long as the session
    lives."""
    before = found[0] if found is not None and found[0] != keeper.holder_id else None
    mine = before is not None and session_name(before) == session_name(keeper.holder_id)
    if found is not None and found[2] > 0 and before is not None:
        # another holder's lease runs; unless it is this node's own, from a
        # process that is gone (a crash and a restart: no session of it is
        # left), this node waits it out
        if before.rpartition(".")[0] != cfg.holder or mine:
            return None
        if await keeper.read(sessions_of(before)) > 0:
            return None
        term = await keeper.take_from(SITE, before)
    else:
        if before is not None and not mine:
            ended = await keeper.read(end_sessions(before))
            if ended:
                log.warning("ended %d database session(s) of %s, whose lease ran out",
                            ended, before)  # fmt: skip
        term = await keeper.take(SITE)
    if term is None:
        return None
    log.info("node %s leads site %s (term %d)", cfg.holder, cfg.site_name, term)
    return term, before


async def _beat(cfg: SiteConfig, keeper: LeaseKeeper, leads: bool) -> None:
    """This node's heartbeat (``vpnrepl nodes``), on a connection of its
    own (a slow one never holds a lease renewal back); a missed one is
    only late."""
    statement = beat(cfg.holder, keeper.holder_id, leads)
    try:
        async with asyncio.timeout(cfg.lease_seconds / 3):
            async with await psycopg.AsyncConnection.connect(
                cfg.store_dsn, autocommit=True
            ) as conn:
                await statement.run_async(conn)
    except (TimeoutError, psycopg.Error) as e:
        log.debug("heartbeat not recorded: %s", e)


async def _beating(cfg: SiteConfig, keeper: LeaseKeeper) -> None:
    while True:
        await _beat(cfg, keeper, True)
        await asyncio.sleep(cfg.lease_seconds / 3)


def _leader(cfg: SiteConfig, found: tuple[str, int, float] | None) -> NodeConfig | None:
    """The node whose lease runs (``found``: the lease as read), if it is
    one of the site's (None: the lease ran out, or a CLI holds it)."""
    if found is None or found[2] <= 0:
        return None
    return cfg.node(found[0].rpartition(".")[0])


async def _lead(
    cfg: SiteConfig,
    keeper: LeaseKeeper,
    term: int,
    before: str | None,
    stop: asyncio.Event,
    lost: asyncio.Event,
) -> None:
    """Run the site under ``term`` until ``stop`` or the lease is ``lost``.
    A database that fails the start sends the node back to relaying (the
    lease released, so another node may try)."""
    # every session this node opens while it leads carries its holder name
    os.environ["PGAPPNAME"] = session_name(keeper.holder_id)
    node = Node(cfg)
    node.writer.fence = Fence(SITE, keeper.holder_id, term)
    node.writer.on_fenced = lambda: keeper.lose(SITE, "a ledger commit found another term")
    node.requests.may_serve = lambda: keeper.term(SITE) == term
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGHUP, node.reload_tls)
    renewing = asyncio.create_task(keeper.run(), name="lease")
    beating = asyncio.create_task(_beating(cfg, keeper), name="heartbeat")
    try:
        try:
            await node.start()
        except (psycopg.Error, StoreUnavailable, TimeoutError) as e:
            log.error("node %s could not start the site as its leader: %s; relaying",
                      cfg.holder, e)  # fmt: skip
            return
        waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(lost.wait())}
        _, waiting = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waiting:
            w.cancel()
        if lost.is_set():
            log.error("node %s lost the lead of site %s: closing its clients (320)",
                      cfg.holder, cfg.site_name)  # fmt: skip
            await node.requests.close()  # no operator command runs on from here
            if node.listener is not None:
                node.listener.close_all(lost_text(cfg))
        else:
            log.info("site %s stopping", cfg.site_name)
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
        await node.stop()  # renewed meanwhile: a clean stop keeps the lease to its end
        renewing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewing
        with contextlib.suppress(TimeoutError, psycopg.Error):
            await keeper.release(SITE)  # the next node need not wait out the lease
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGHUP)
