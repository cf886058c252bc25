"""The bridge over TCP and TLS between two real sites.

Each test runs the active's :class:`ActiveBridge` (site A's PostgreSQL and
RabbitMQ) and the standby's :class:`StandbyBridge` (site B's) in one event
loop, feeds A's ledger with ``LedgerWriter.append`` and compares the two
sites' ``live_message`` row for row. Links are cut with a TCP proxy in the
aiormq style; certificates are made by the ``openssl`` CLI per module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from bridge import (
    Consumed,
    Event,
    HostPort,
    LedgerEntry,
    Published,
    ReplicationId,
    Role,
    StaleEpoch,
    TlsConfig,
    VpnSettings,
)
from bridge.active import ActiveBridge, Replicator
from bridge.ledger import LedgerWriter
from bridge.link import TlsSetupError, make_client_context, make_server_context
from bridge.standby import StandbyApplier, StandbyBridge
from bridge.wire import (
    NEED_DATA,
    PROTOCOL_VERSION,
    Ack,
    BridgeConnection,
    Error,
    Events,
    Frame,
    GetAllResources,
    Heartbeat,
    Hello,
    ResourceList,
    SyncAccepted,
    SyncFinished,
    SyncRequest,
    VpnResource,
)
from plugin.devtools import LocalSite
from plugin.ops import connect, disable_vpn, enable_vpn, status
from sql import migrate
from tests.fix_tls import Pki

VPN = "orders"
QUEUES = ("orders.q1", "orders.q2")
LIVE_SQL = (
    "SELECT queue, repl_id, publish_index, exchange, routing_key, properties, body"
    " FROM live_message WHERE vpn = %s ORDER BY queue, repl_id"
)
FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 3.0}
#: the active is site a, serving its peer b; the standby is b, of peer a
SERVER_FAST: dict[str, Any] = {**FAST, "peers": ("b",)}
CLIENT_FAST: dict[str, Any] = {
    **FAST, "min_backoff": 0.05, "max_backoff": 0.3, "connect_timeout": 3.0, "peer_site": "a",
}  # fmt: skip


# ---------------------------------------------------------------- helpers


def prepare(site: LocalSite, **roles: str) -> str:
    dsn = site.pg.dsn()
    migrate(dsn)
    with connect(dsn) as conn:
        for name, role in roles.items():
            enable_vpn(conn, VpnSettings.from_args(name, role))
    return dsn


def sql(dsn: str, statement: str, *params: Any) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchone() if cur.description else None


def scalar(dsn: str, statement: str, *params: Any) -> Any:
    row = sql(dsn, statement, *params)
    assert row is not None
    return row[0]


def live(dsn: str, vpn: str = VPN) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(LIVE_SQL, (vpn,)).fetchall()


def applied(dsn: str, vpn: str = VPN) -> int:
    row = sql(dsn, "SELECT applied_index FROM vpn_state WHERE vpn = %s", vpn)
    return -1 if row is None else int(row[0])


def rid(n: int) -> ReplicationId:
    return ReplicationId.from_parts(11, n)


def events(first: int, count: int, vpn: str = VPN) -> list[Event]:
    """Publishes to both queues; every third one consumes an earlier message
    from q1, so a consumption applied twice would show as an unknown ACK."""
    out: list[Event] = []
    for n in range(first, first + count):
        body = n.to_bytes(4, "big") * 32
        out.append(Published(vpn, rid(n), "amq.direct", f"rk.{n}", b"\x90\x00", body, QUEUES))
        if n % 3 == 0:
            out.append(Consumed(vpn, rid(n - 1), QUEUES[0]))
    return out


async def feed(writer: LedgerWriter, batch: list[Event]) -> LedgerEntry:
    last = None
    for event in batch:
        last = writer.append(event)
    assert last is not None
    await writer.wait_durable(last.vpn, last.index)
    return last


async def until(
    check: Callable[[], Any], what: str, within: float = 30.0, every: float = 0.05
) -> None:
    """Poll ``check`` (sync, run in a thread) until it is truthy."""
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        last = await asyncio.to_thread(check)
        if last:
            return
        await asyncio.sleep(every)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def run(scenario: Callable[[], Awaitable[None]], timeout: float = 90.0) -> None:
    async def main() -> None:
        async with asyncio.timeout(timeout):
            await scenario()

    asyncio.run(main())


def live_caught_up(dsn: str, vpn: str = VPN, within: float = 10.0) -> None:
    """Wait until the active's live state reflects its whole ledger (it is
    applied after the ledger commit, in a transaction of its own)."""
    deadline = time.monotonic() + within
    while not scalar(
        dsn,
        "SELECT s.ledger_index = l.live_index FROM vpn_state s"
        " JOIN vpn_live_state l USING (vpn) WHERE s.vpn = %s",
        vpn,
    ):
        if time.monotonic() > deadline:
            raise AssertionError(f"the live state of {vpn} did not catch up with the ledger")
        time.sleep(0.01)


def same_state(a_dsn: str, b_dsn: str, vpn: str = VPN) -> None:
    live_caught_up(a_dsn, vpn)
    ours, theirs = live(a_dsn, vpn), live(b_dsn, vpn)
    assert theirs == ours
    assert applied(b_dsn, vpn) == scalar(
        a_dsn, "SELECT ledger_index FROM vpn_state WHERE vpn = %s", vpn
    )
    assert scalar(b_dsn, "SELECT unknown_acks FROM vpn_state WHERE vpn = %s", vpn) == 0


@dataclass
class Active:
    writer: LedgerWriter
    replicator: Replicator
    server: ActiveBridge


@contextlib.asynccontextmanager
async def active(site: LocalSite, **kwargs: Any) -> AsyncIterator[Active]:
    dsn = site.pg.dsn()
    writer = LedgerWriter(dsn)
    await writer.start()
    replicator = Replicator(writer)
    replicator.start()
    server = ActiveBridge("a", dsn, writer, replicator, **{**SERVER_FAST, **kwargs})
    try:
        await server.start("127.0.0.1", site.bridge_port)
        yield Active(writer, replicator, server)
    finally:
        await server.close()
        await replicator.close()
        await writer.close()


@contextlib.asynccontextmanager
async def standby(
    site: LocalSite, port: int, cls: type[StandbyBridge] = StandbyBridge, **kwargs: Any
) -> AsyncIterator[StandbyBridge]:
    client = cls("b", site.pg.dsn(), HostPort("127.0.0.1", port), **{**CLIENT_FAST, **kwargs})
    task = asyncio.create_task(client.run())
    try:
        yield client
    finally:
        await client.close()
        await task


class Proxy:
    """A TCP relay the test can cut, like a network failure (RST both ways)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self.pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self.flowing: list[asyncio.Event] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Both sides are aborted however this ends: asyncio.run() cancels a
        # handler still dialling, or still piping a frozen pair.
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        except BaseException:
            writer.transport.abort()
            raise
        self.pairs.append((writer, up_writer))
        flowing = asyncio.Event()
        flowing.set()
        self.flowing.append(flowing)
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, flowing),
                self._pipe(up_reader, writer, flowing),
                return_exceptions=True,
            )
        finally:
            for w in (writer, up_writer):
                w.transport.abort()

    @staticmethod
    async def _pipe(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, flowing: asyncio.Event
    ) -> None:
        while data := await reader.read(65536):
            await flowing.wait()
            writer.write(data)
            await writer.drain()
        writer.transport.abort()

    def freeze(self) -> None:
        """The current connections stay open but carry nothing any more."""
        for flowing in self.flowing:
            flowing.clear()
        self.flowing.clear()

    def cut(self) -> None:
        for down, up in self.pairs:
            down.transport.abort()
            up.transport.abort()
        self.pairs.clear()

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


# ---------------------------------------------------------------- streaming


def test_catch_up_replay_then_live_streaming(site_a: LocalSite, site_b: LocalSite) -> None:
    a_dsn, b_dsn = prepare(site_a, orders="active"), prepare(site_b)

    async def scenario() -> None:
        async with active(site_a) as a:
            last = await feed(a.writer, events(1, 900))  # > 2 replay batches of 500
            assert last.index == 1200
            async with standby(site_b, site_a.bridge_port) as b:
                await until(lambda: applied(b_dsn) == 1200, "the catch-up")
                await until(lambda: b.bridge_state(VPN) == "connected", "B live")
                assert a.server.bridge_state(VPN) == "connected"
                await asyncio.to_thread(same_state, a_dsn, b_dsn)
                for first in range(901, 1201, 60):  # live, in several commits
                    last = await feed(a.writer, events(first, 60))
                await until(lambda: applied(b_dsn) == last.index, "live events")
                await asyncio.to_thread(same_state, a_dsn, b_dsn)
                # The active records the standby's acknowledgement and the
                # bridge state, which is what `vpnrepl status` shows.
                await until(lambda: applied(a_dsn) == last.index, "A's applied_index")
                with connect(a_dsn) as conn:
                    [row] = status(conn, "a")["vpns"]
                assert (row["bridge"], row["lag_events"]) == ("connected", 0)
                with connect(b_dsn) as conn:
                    [row] = status(conn, "b")["vpns"]
                assert (row["role"], row["bridge"]) == ("standby", "connected")
            await until(
                lambda: scalar(a_dsn, "SELECT bridge_state FROM vpn_state") == "disconnected",
                "A to see the standby go",
            )
        assert scalar(b_dsn, "SELECT bridge_state FROM vpn_state") == "disconnected"

    run(scenario)


def test_cut_link_and_restarted_standby_resync_without_loss_or_double_apply(
    site_a: LocalSite, site_b: LocalSite
) -> None:
    a_dsn, b_dsn = prepare(site_a, orders="active"), prepare(site_b)

    async def scenario() -> None:
        async with active(site_a) as a:
            proxy = Proxy(site_a.bridge_port)
            await proxy.start()
            stop = asyncio.Event()

            async def produce() -> None:
                n = 1
                while not stop.is_set():
                    await feed(a.writer, events(n, 40))
                    n += 40
                    await asyncio.sleep(0.01)

            producer = asyncio.create_task(produce())
            try:
                async with standby(site_b, proxy.port) as b:
                    await until(lambda: applied(b_dsn) > 200, "some progress")
                    proxy.cut()  # mid-stream: the client redials by itself
                    cut_at = applied(b_dsn)
                    await until(lambda: applied(b_dsn) > cut_at + 200, "progress after the cut")
                    assert b.sessions >= 2
                    proxy.cut()  # and now the standby process dies as well
                killed_at = applied(b_dsn)
                async with standby(site_b, proxy.port) as b:
                    await until(lambda: applied(b_dsn) > killed_at + 200, "progress after restart")
                    stop.set()
                    await producer
                    durable = a.writer.durable_index(VPN)
                    await until(lambda: applied(b_dsn) == durable, "B to catch up")
                    await asyncio.to_thread(same_state, a_dsn, b_dsn)
            finally:
                stop.set()
                await asyncio.gather(producer, return_exceptions=True)
                await proxy.close()

    run(scenario)


def test_a_silent_link_is_dropped_by_both_sides_and_redialled(
    site_a: LocalSite, site_b: LocalSite, caplog: pytest.LogCaptureFixture
) -> None:
    a_dsn, b_dsn = prepare(site_a, orders="active"), prepare(site_b)

    async def scenario() -> None:
        async with active(site_a, heartbeat_timeout=1.0) as a:
            proxy = Proxy(site_a.bridge_port)
            await proxy.start()
            try:
                async with standby(site_b, proxy.port, heartbeat_timeout=1.0) as b:
                    await until(lambda: b.bridge_state(VPN) == "connected", "B live")
                    proxy.freeze()  # a dead network path: no RST, no FIN
                    last = await feed(a.writer, events(1, 50))
                    await until(lambda: applied(b_dsn) == last.index, "redial after the silence")
                    assert b.sessions == 2
                    await asyncio.to_thread(same_state, a_dsn, b_dsn)
            finally:
                await proxy.close()

    run(scenario)
    silent = [r.message for r in caplog.records if "nothing received for 1 s" in r.message]
    assert any(m.startswith("bridge to 127.0.0.1:") for m in silent), silent
    assert any(m.startswith("bridge: standby 'b' at 127.0.0.1:") for m in silent), silent


def test_a_standby_too_slow_for_the_live_feed_is_dropped_and_resyncs(
    site_a: LocalSite, site_b: LocalSite, caplog: pytest.LogCaptureFixture
) -> None:
    a_dsn, b_dsn = prepare(site_a, orders="active"), prepare(site_b)

    async def scenario() -> None:
        # One queued byte is already too many: every live batch drops the
        # standby, and only the replay from the ledger brings it up to date.
        async with active(site_a, max_queued_bytes=1) as a:
            async with standby(site_b, site_a.bridge_port) as b:
                await until(lambda: b.bridge_state(VPN) == "connected", "B live")
                last = await feed(a.writer, events(1, 50))
                await until(lambda: applied(b_dsn) == last.index, "the resync")
                assert b.sessions >= 2
                await asyncio.to_thread(same_state, a_dsn, b_dsn)

    run(scenario)
    assert any("too slow" in r.message for r in caplog.records)


def test_a_vpn_enabled_later_is_synced_on_relist_and_a_disabled_one_stops(
    site_a: LocalSite, site_b: LocalSite
) -> None:
    a_dsn, b_dsn = prepare(site_a, orders="active"), prepare(site_b)

    async def scenario() -> None:
        async with active(site_a) as a, standby(site_b, site_a.bridge_port) as b:
            await until(lambda: b.bridge_state(VPN) == "connected", "orders live")
            with connect(a_dsn) as conn:
                enable_vpn(conn, VpnSettings.from_args("billing", "active"))
            await a.writer.open_vpn("billing")
            last = await feed(a.writer, events(1, 10, vpn="billing"))
            await a.server.relist()
            await until(lambda: applied(b_dsn, "billing") == last.index, "billing synced")
            await asyncio.to_thread(same_state, a_dsn, b_dsn, "billing")
            with connect(a_dsn) as conn:
                disable_vpn(conn, VPN)
            await a.server.relist()
            await until(lambda: b.bridge_state(VPN) == "disconnected", "orders to stop")
            assert a.server.bridge_state(VPN) == "disconnected"
            assert b.bridge_state("billing") == a.server.bridge_state("billing") == "connected"

    run(scenario)


def test_the_standby_resyncs_after_a_gap_and_refuses_a_stale_active(
    site_b: LocalSite, caplog: pytest.LogCaptureFixture
) -> None:
    """Against a scripted active that loses an entry, then sends one from an
    older epoch (bytes written past its own protocol checks)."""
    b_dsn = prepare(site_b, orders="standby")
    sql(b_dsn, "UPDATE vpn_config SET epoch = 3")
    entries = [LedgerEntry(VPN, 3, n, e) for n, e in enumerate(events(1, 9), start=1)]
    seen: list[Frame] = []
    finished = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = BridgeConnection(Role.ACTIVE, "a")

        async def expect(kind: type[Frame]) -> Any:
            while True:
                frame = conn.next_event()
                if frame is NEED_DATA:
                    conn.receive_data(await reader.read(65536))
                elif not isinstance(frame, Heartbeat | Ack):
                    seen.append(frame)  # type: ignore[arg-type]
                    assert isinstance(frame, kind), frame
                    return frame

        def send(*frames: Frame) -> None:
            writer.write(b"".join(conn.send(f) for f in frames))

        try:
            await expect(Hello)
            send(Hello("a", PROTOCOL_VERSION, Role.ACTIVE))
            await expect(GetAllResources)
            settings = VpnSettings.from_args(VPN, "active")
            send(ResourceList((VpnResource.from_settings(settings, 3, b""),)))
            first = await expect(SyncRequest)
            assert (first.epoch, first.last_applied_index, first.last_applied_epoch) == (3, 0, 0)
            send(SyncAccepted(VPN, 3, 1), Events(VPN, 3, tuple(entries[:5])))
            send(SyncFinished(VPN, 3, 5))
            writer.write(Events(VPN, 3, tuple(entries[6:8])).encode())  # entry 6 got lost
            again = await expect(SyncRequest)
            assert (again.last_applied_index, again.last_applied_epoch) == (5, 3)
            send(SyncAccepted(VPN, 3, 6), Events(VPN, 3, tuple(entries[5:8])))
            send(SyncFinished(VPN, 3, 8))
            fenced = LedgerEntry(VPN, 2, 9, entries[8].event)
            writer.write(Events(VPN, 2, (fenced,)).encode())  # from an active with an old epoch
            refusal = await expect(Error)
            assert isinstance(refusal.exception(), StaleEpoch) and refusal.vpn == VPN
            finished.set()
            await reader.read()  # hold the link until the standby leaves
        finally:
            writer.transport.abort()

    async def scenario() -> None:
        server = await asyncio.start_server(script, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with standby(site_b, port) as b:
                await asyncio.wait_for(finished.wait(), 30)
                await until(lambda: applied(b_dsn) == 8, "the resync")
                await asyncio.sleep(0.3)  # nothing more is applied or asked for
                assert applied(b_dsn) == 8
                assert b.sessions == 1 and b.bridge_state(VPN) == "disconnected"
        finally:
            server.close()
            await server.wait_closed()

    run(scenario)
    assert [type(f).__name__ for f in seen] == [
        "Hello", "GetAllResources", "SyncRequest", "SyncRequest", "Error",
    ]  # fmt: skip
    assert scalar(b_dsn, "SELECT unknown_acks FROM vpn_state") == 0
    assert len(live(b_dsn)) == 2 * 6 - 2  # P1..P6 on two queues, C2 and C5 consumed
    assert any("waiting for an active with a current epoch" in r.message for r in caplog.records)


@pytest.mark.parametrize("case", ["behind the pruned ledger", "diverged history"])
def test_a_standby_that_cannot_follow_the_ledger_gets_a_checkpoint(
    site_a: LocalSite, site_b: LocalSite, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    a_dsn, b_dsn = prepare(site_a, orders="active"), prepare(site_b, orders="standby")
    if case == "diverged history":
        # B applied ten entries of epoch 1 that A, at epoch 2, never wrote.
        sql(a_dsn, "UPDATE vpn_config SET epoch = 2")
        with StandbyApplier(b_dsn) as applier:
            old = [Published(VPN, rid(9000 + n), "x", "k", b"", b"old", QUEUES) for n in range(10)]
            applier.apply_batch(VPN, [LedgerEntry(VPN, 1, n + 1, e) for n, e in enumerate(old)])
        assert len(live(b_dsn)) == 20

    async def scenario() -> None:
        async with active(site_a) as a:
            await a.writer.wait_live(VPN, (await feed(a.writer, events(1, 300))).index)
            if case == "behind the pruned ledger":
                assert await a.writer.reader.prune(VPN, 250, 0) == 250
                assert await a.writer.reader.oldest_retained(VPN) == 251
            async with standby(site_b, site_a.bridge_port) as b:
                await until(lambda: b.bridge_state(VPN) == "connected", "B live")
                await asyncio.to_thread(same_state, a_dsn, b_dsn)
                last = await feed(a.writer, events(301, 60))
                await until(lambda: applied(b_dsn) == last.index, "live events")
                await asyncio.to_thread(same_state, a_dsn, b_dsn)

    run(scenario)
    installed = [r.message for r in caplog.records if "installed a checkpoint" in r.message]
    assert installed == [
        "bridge: VPN orders: installed a checkpoint of 500 live messages at index 400"
    ]


def test_a_fenced_active_is_refused_and_the_standby_waits(
    site_a: LocalSite, site_b: LocalSite, caplog: pytest.LogCaptureFixture
) -> None:
    a_dsn, b_dsn = prepare(site_a, orders="active"), prepare(site_b, orders="standby")
    sql(b_dsn, "UPDATE vpn_config SET epoch = 2")  # B knows of a promotion A missed

    async def scenario() -> None:
        async with active(site_a) as a:
            await feed(a.writer, events(1, 30))
            async with standby(site_b, site_a.bridge_port, relist_interval=0.2) as b:
                await until(lambda: VPN in a.replicator.fenced, "A to learn it is fenced")
                await asyncio.sleep(1.0)  # several relists: nothing is asked again
                assert b.sessions == 1
                assert b.bridge_state(VPN) == "disconnected"
                assert a.server.bridge_state(VPN) == "disconnected"
        assert scalar(a_dsn, "SELECT fenced FROM vpn_state") is True
        assert applied(b_dsn) == 0 and live(b_dsn) == []

    run(scenario)
    bridge_ends = ("bridge.active.", "bridge.standby.")  # the two ends of the link
    fenced = [r for r in caplog.records if r.name.startswith(bridge_ends) and "fenced" in r.message]
    assert any("refuses its publishes" in r.message for r in fenced), fenced
    assert [r.levelno for r in fenced if "not replicating from it" in r.message] == [logging.ERROR]


def test_a_sync_request_that_fences_the_active_records_where_its_epoch_took_over(
    site_a: LocalSite, site_b: LocalSite
) -> None:
    """B took the VPN over at epoch 2 from A's index 10 (then became a
    standby again); A, which never heard of it, confirmed up to 40. B's
    SyncRequest fences A, and A records what a listing of epoch 2 would
    have told it: the epoch, the site and the take-over index, and the
    split brain (A confirmed past index 10)."""
    a_dsn, b_dsn = prepare(site_a, orders="active"), prepare(site_b, orders="standby")
    sql(b_dsn, "UPDATE vpn_config SET epoch = 2")
    took = "INSERT INTO vpn_epoch (vpn, epoch, site, taken_over_at) VALUES (%s, 2, 'b', 10)"
    sql(b_dsn, took, VPN)
    epochs = "SELECT epoch, site, taken_over_at FROM vpn_epoch WHERE vpn = %s ORDER BY epoch"

    told: list[tuple[str, int, str]] = []

    async def scenario() -> None:
        async with active(site_a) as a:
            # the node closes the VPN's clients and refuses new ones when told
            a.server.on_fenced = lambda vpn, epoch, site: told.append((vpn, epoch, site))
            last = await feed(a.writer, events(1, 30))
            assert last.index == 40
            async with standby(site_b, site_a.bridge_port):
                await until(lambda: VPN in a.replicator.fenced, "A to learn it is fenced")
                await until(
                    lambda: scalar(a_dsn, "SELECT fenced FROM vpn_state WHERE vpn = %s", VPN),
                    "A to record it",
                )

    run(scenario)
    with psycopg.connect(a_dsn) as conn:
        assert conn.execute(epochs, (VPN,)).fetchall()[-1] == (2, "b", 10)
    assert scalar(a_dsn, "SELECT split_brain FROM vpn_state WHERE vpn = %s", VPN) is True
    assert told == [(VPN, 2, "b")]


def test_an_ack_records_applied_index_prunes_and_releases_a_sync_confirm(
    site_a: LocalSite, site_b: LocalSite
) -> None:
    a_dsn, b_dsn = prepare(site_a), prepare(site_b)
    with connect(a_dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args(VPN, "active", "sync", 20_000, "reject"))

    async def scenario() -> None:
        async with active(site_a, retain_seconds=0) as a:
            a.replicator.configure(
                VpnSettings.from_args(VPN, "active", "sync", 20_000, "reject"), 0
            )
            async with standby(site_b, site_a.bridge_port) as b:
                await until(lambda: b.bridge_state(VPN) == "connected", "B live")
                loop = asyncio.get_running_loop()
                confirms = [loop.create_future() for _ in range(5)]
                started = time.monotonic()
                for n, done in enumerate(confirms, start=1):
                    event = events(n, 1)[0]
                    a.replicator.append(event, lambda ok, f=done: f.done() or f.set_result(ok))
                assert await asyncio.gather(*confirms) == [True] * 5
                assert time.monotonic() - started < 5  # the standby's Ack, not the timeout
                await until(lambda: applied(a_dsn) == 5, "A's applied_index")
                assert scalar(a_dsn, "SELECT applied_epoch FROM vpn_state") == 1
                assert scalar(a_dsn, "SELECT applied_at IS NOT NULL FROM vpn_state")
                # Pruned up to the acknowledged entry, which is kept.
                await until(lambda: scalar(a_dsn, "SELECT min(idx) FROM ledger") == 5, "the prune")
                # Prunes are spaced (PRUNE_INTERVAL), but the newest ack always
                # gets one, also when no other ack follows it.
                more = [loop.create_future() for _ in range(5)]
                for n, done in enumerate(more, start=6):
                    event = events(n, 1)[0]
                    a.replicator.append(event, lambda ok, f=done: f.done() or f.set_result(ok))
                assert await asyncio.gather(*more) == [True] * 5
                await until(lambda: scalar(a_dsn, "SELECT min(idx) FROM ledger") == 10, "prune 2")

    run(scenario)
    assert applied(b_dsn) == 10


class HeldStandby(StandbyBridge):
    """A standby that takes up an early commit only once ``gate`` is set,
    noting how far the stream had reached it by then, and (``silent``)
    may never answer it, like a standby whose answer is lost."""

    gate: asyncio.Event
    silent = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = asyncio.Event()
        self.stream_at: list[int | None] = []
        commit_early = self.txn_link.commit_early

        async def held(link: Any, stream: Any, frame: Any) -> None:
            await self.gate.wait()
            self.stream_at.append(link.conn.next_index(frame.vpn))
            if not self.silent:
                await commit_early(link, stream, frame)

        # the VPN's worker takes up a TxnCommit through this, in stream order
        self.txn_link.commit_early = held  # type: ignore[method-assign]


@contextlib.asynccontextmanager
async def held_standby(
    site_a: LocalSite, site_b: LocalSite
) -> AsyncIterator[tuple[Active, HeldStandby]]:
    """An active with 30 publishes (and their consumptions) in its ledger,
    and a :class:`HeldStandby` that has caught up and streams live."""
    async with active(site_a) as a:
        last = await feed(a.writer, events(1, 30))
        async with standby(site_b, site_a.bridge_port, HeldStandby) as b:
            assert isinstance(b, HeldStandby)
            await until(lambda: applied(site_b.pg.dsn()) == last.index, "the catch-up")
            await until(lambda: a.server.bridge_state(VPN) == "connected", "A live")
            yield a, b


def commit_group(a: Active, txid: str, group: list[Event], committed_early: list[str]) -> int:
    """What the coordinator does at a sync transaction's decision: append
    the group, then tell the standby (returns the group's first index)."""
    last = a.writer.append_group(group, None)
    first = last - len(group) + 1
    assert a.server.txn_link.commit_early(VPN, txid, first, lambda: committed_early.append(txid))
    return first


def test_config_sync_creates_the_vhost_its_queues_and_the_standby_vpn(
    site_a: LocalSite, site_b: LocalSite, caplog: pytest.LogCaptureFixture
) -> None:
    a_dsn, b_dsn = prepare(site_a, billing="active"), prepare(site_b, billing="active")
    with connect(a_dsn) as conn:
        settings = VpnSettings.from_args(
            VPN, "active", "sync", 1500, "reject", ("orders\\..*",), ("amq.topic:eu.#",)
        )
        enable_vpn(conn, settings)
    sql(a_dsn, "UPDATE vpn_config SET epoch = 4 WHERE name = %s", VPN)
    rabbit = site_a.rabbit
    rabbit.add_vhost(VPN)
    for queue in QUEUES:
        rabbit.api("PUT", f"queues/{VPN}/{queue}", {"durable": True})
    rabbit.api("PUT", f"exchanges/{VPN}/orders.x", {"type": "topic", "durable": True})
    rabbit.api("POST", f"bindings/{VPN}/e/orders.x/q/orders.q1", {"routing_key": "eu.#"})

    async def scenario() -> None:
        async with active(site_a, management_url=rabbit.management_url) as a:
            await feed(a.writer, events(1, 10))
            async with standby(
                site_b, site_a.bridge_port, management_url=site_b.rabbit.management_url
            ) as b:
                await until(lambda: b.bridge_state(VPN) == "connected", "B live")
                await until(lambda: applied(b_dsn) == 13, "the replay")

    run(scenario)
    queues = {q["name"] for q in site_b.rabbit.api("GET", f"queues/{VPN}")}
    assert queues == set(QUEUES)
    bindings = site_b.rabbit.api("GET", f"exchanges/{VPN}/orders.x/bindings/source")
    assert [(x["destination"], x["routing_key"]) for x in bindings] == [("orders.q1", "eu.#")]
    row = sql(
        b_dsn,
        "SELECT role, epoch, mode, sync_timeout_ms, on_sync_timeout, queue_patterns,"
        " topic_filters FROM vpn_config WHERE name = %s",
        VPN,
    )
    assert row == ("standby", 4, "sync", 1500, "reject", ["orders\\..*"], ["amq.topic:eu.#"])
    # A VPN that is active on both sites is a conflict: left alone, and said so.
    assert scalar(b_dsn, "SELECT role FROM vpn_config WHERE name = 'billing'") == "active"
    assert "billing" not in {v["name"] for v in site_b.rabbit.api("GET", "vhosts")}
    conflicts = [r.message for r in caplog.records if "enabled as active on this site" in r.message]
    assert len(conflicts) == 1 and "billing" in conflicts[0]


# ---------------------------------------------------------------- TLS


@pytest.mark.parametrize("mutual", [False, True], ids=["server-only TLS", "mutual TLS"])
def test_replication_over_tls(site_a: LocalSite, site_b: LocalSite, pki: Pki, mutual: bool) -> None:
    a_dsn, b_dsn = prepare(site_a, orders="active"), prepare(site_b)
    server_tls = pki.tls("a", "ca" if mutual else None)

    async def scenario() -> None:
        async with active(site_a, tls=server_tls) as a:
            last = await feed(a.writer, events(1, 100))
            async with standby(site_b, site_a.bridge_port, tls=pki.tls("b")):
                await until(lambda: applied(b_dsn) == last.index, "the replay over TLS")
                await asyncio.to_thread(same_state, a_dsn, b_dsn)

    run(scenario)


@pytest.mark.parametrize(
    ("client", "server", "standby_says", "active_says"),
    [
        (
            "rogue",
            "a",
            "refused this site's certificate",
            "certificate verify failed: unable to get local issuer certificate "
            "(the standby's certificate is not signed by",
        ),
        (
            "b",
            "rogue",
            "TLS handshake with the active failed: certificate verify failed: "
            "unable to get local issuer certificate",
            "did it refuse this site's certificate?",
        ),
    ],
    ids=["standby certificate from another CA", "active certificate from another CA"],
)
def test_a_certificate_from_another_ca_is_refused_and_both_sides_say_why(
    site_a: LocalSite,
    site_b: LocalSite,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    client: str,
    server: str,
    standby_says: str,
    active_says: str,
) -> None:
    prepare(site_a, orders="active")
    b_dsn = prepare(site_b)
    caplog.set_level(logging.INFO, logger="bridge")

    peer = f"127.0.0.1:{site_a.bridge_port}"

    def lines() -> tuple[list[str], list[str]]:
        messages = [r.message for r in caplog.records]
        return (
            [m for m in messages if m.startswith(f"bridge to {peer}: ")],
            [m for m in messages if "standby at 127.0.0.1:" in m],
        )

    async def scenario() -> tuple[list[str], list[str]]:
        async with active(site_a, tls=pki.tls(server)) as a:
            await feed(a.writer, events(1, 5))
            async with standby(site_b, site_a.bridge_port, tls=pki.tls(client)) as b:
                await until(lambda: min(map(len, lines())) >= 2, "two refused attempts")
                assert b.sessions == 0
                # (the attempt under way when the test stops is cut short)
                return lines()

    standby_lines, active_lines = asyncio.run(scenario())
    assert applied(b_dsn) == -1  # not even listed: the VPN was never adopted
    for line in standby_lines[:2]:
        assert standby_says in line and "; retrying in" in line and "\n" not in line
    for line in active_lines[:2]:
        assert active_says in line and "\n" not in line


def test_unusable_tls_files_are_named(pki: Pki, tmp_path: Path) -> None:
    good = pki.tls("a")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    missing = tmp_path / "missing.key"
    cases = [
        (TlsConfig(good.cert, missing, good.ca), f"TLS key {missing}: file not found"),
        (TlsConfig(garbage, good.key, good.ca), f"TLS certificate {garbage}:"),
        (
            TlsConfig(good.cert, pki.dir / "b.key", good.ca),
            f"TLS key {pki.dir / 'b.key'}: key values mismatch (not a PEM private key, or not",
        ),
        (TlsConfig(good.cert, good.key, garbage), f"TLS CA {garbage}:"),
    ]
    for config, text in cases:
        for make in (make_server_context, make_client_context):
            with pytest.raises(TlsSetupError) as info:
                make(config)
            assert text in str(info.value)
    server, client = make_server_context(good), make_client_context(good)
    assert server.minimum_version.name == client.minimum_version.name == "TLSv1_2"
    assert client.check_hostname is False  # verified against the private CA instead
    assert make_client_context(pki.tls("b", None)).check_hostname is True


def test_a_plaintext_standby_is_refused_by_a_tls_active(
    site_a: LocalSite, site_b: LocalSite, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """A standby without ``[tls]`` dialling an active that speaks TLS: no
    session, nothing applied, and each side says why."""
    prepare(site_a, orders="active")
    b_dsn = prepare(site_b)
    caplog.set_level(logging.INFO, logger="bridge")
    peer = f"127.0.0.1:{site_a.bridge_port}"

    def refused() -> list[str]:
        return [r.message for r in caplog.records if r.message.startswith(f"bridge to {peer}: ")]

    async def scenario() -> None:
        async with active(site_a, tls=pki.tls("a", "ca")) as a:
            await feed(a.writer, events(1, 5))
            async with standby(site_b, site_a.bridge_port) as b:
                await until(lambda: len(refused()) >= 2, "two refused attempts")
                assert b.sessions == 0

    run(scenario)
    assert applied(b_dsn) == -1
    assert all("; retrying in" in line for line in refused()[:2]), refused()


class StallsAfterConnect(StandbyBridge):
    """A standby whose database fails (``fails``) or stalls right after its
    TCP connect to the active, keeping every connection it dialled."""

    def __init__(self, *args: Any, fails: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fails = fails
        self.writers: list[asyncio.StreamWriter] = []
        self.stalled = asyncio.Event()

    async def _dial(self, address: HostPort) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await super()._dial(address)
        self.writers.append(writer)
        return reader, writer

    async def _known_epochs(self) -> dict[str, int]:
        if self.fails:
            raise psycopg.OperationalError("the database went away")
        self.stalled.set()
        await asyncio.Event().wait()  # until close() cancels the session
        raise AssertionError("not reached")


@pytest.mark.parametrize("fails", [False, True], ids=["cancelled", "database fails"])
def test_a_dial_that_ends_before_the_link_is_made_closes_its_connection(
    site_b: LocalSite, fails: bool
) -> None:
    """The standby is stopped (or its database fails) between the TCP
    connect and the Hello: the connection is closed, not left to the
    garbage collector (an "unclosed StreamWriter" ResourceWarning)."""
    prepare(site_b)

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read()
        finally:
            writer.transport.abort()

    async def scenario() -> None:
        server = await asyncio.start_server(hold, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with standby(site_b, port, cls=StallsAfterConnect, fails=fails) as b:
                assert isinstance(b, StallsAfterConnect)
                if fails:
                    await until(lambda: len(b.writers) >= 2, "two dials")
                else:
                    await asyncio.wait_for(b.stalled.wait(), 10)
            assert b.sessions == 0 and b.writers
            assert all(w.is_closing() for w in b.writers)
        finally:
            server.close()
            await server.wait_closed()

    run(scenario)
