"""Promotion's materialisation against the harness's real RabbitMQ and PostgreSQL.

Live rows are written straight into the standby's ``live_message`` (what
the apply step would have left there); what the broker then holds is read
back with :class:`RawConsumer`, which keeps each delivery's content-header
property bytes exactly as the broker sent them, so the tests compare bytes,
not decoded values.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct
import subprocess
import sys
import textwrap
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import uvloop
from pamqp import base, body as body_frame, commands, frame, header

from bridge import VpnSettings
from bridge.amqp import persistent_properties
from bridge.roles import MaterialiseError, MaterialiseResult, materialise
from plugin.devtools import LocalSite, LocalSites, RabbitNode
from plugin.ops import connect, enable_vpn
from sql import migrate
from tests.fix_tls import Pki

VPN = "orders"
EPOCH = 2

# ------------------------------------------------------------------ property bytes


def _shortstr(text: str) -> bytes:
    raw = text.encode()
    return bytes([len(raw)]) + raw


def _table(entries: Sequence[tuple[str, bytes]]) -> bytes:
    """An AMQP field table from (name, type octet + encoded value) pairs."""
    body = b"".join(_shortstr(k) + v for k, v in entries)
    return struct.pack(">I", len(body)) + body


def id_header(n: int) -> tuple[str, bytes]:
    return ("x-vpnrepl-id", b"l" + struct.pack(">q", (7 << 44) | n))


def plain_properties(n: int) -> bytes:
    """Headers (our id only) and delivery mode 2: what a compact client's
    replicated message carries."""
    return struct.pack(">H", 0x3000) + _table([id_header(n)]) + b"\x02"


def rich_properties(n: int) -> bytes:
    """Content type, headers with an ``I`` (signed 32-bit) 5 that pamqp would
    re-encode as ``b``, a long string and our id, delivery mode 2, priority,
    message id and timestamp."""
    headers = _table(
        [
            ("count", b"I" + struct.pack(">i", 5)),
            ("note", b"S" + struct.pack(">I", 4) + b"text"),
            id_header(n),
        ]
    )
    return (
        struct.pack(">H", 0x8000 | 0x2000 | 0x1000 | 0x0800 | 0x0080 | 0x0040)
        + _shortstr("application/json")
        + headers
        + b"\x02"
        + b"\x03"
        + _shortstr(f"m-{n}")
        + struct.pack(">Q", 1_700_000_000)
    )


def repl_id(n: int) -> bytes:
    return (7).to_bytes(8, "big") + n.to_bytes(8, "big")


# ------------------------------------------------------------------ set-up


@dataclass(frozen=True)
class Row:
    queue: str
    n: int  # replication counter
    index: int  # publish_index
    properties: bytes
    body: bytes


def prepare(
    site: LocalSite,
    queues: Iterable[str] = ("q1", "q2"),
    epoch: int = EPOCH,
    rabbit: RabbitNode | None = None,
) -> None:
    """Schema, the VPN enabled as standby, a running promotion of ``epoch``,
    the vhost and its (empty, durable) queues (on ``rabbit``, by default the
    site's)."""
    rabbit = rabbit or site.rabbit
    dsn = site.pg.dsn()
    migrate(dsn)
    with connect(dsn) as conn:
        enable_vpn(conn, VpnSettings.from_args(VPN, "standby"))
        conn.execute(
            "INSERT INTO promotion (vpn, epoch, state) VALUES (%s, %s, 'running')", (VPN, epoch)
        )
    rabbit.add_vhost(VPN)
    with RawConsumer(rabbit.amqp_port, VPN) as amqp:
        for q in queues:
            amqp.declare(q)


def insert(site: LocalSite, rows: Iterable[Row]) -> None:
    with psycopg.connect(site.pg.dsn()) as conn, conn.cursor() as cur:
        with cur.copy(
            "COPY live_message (vpn, queue, repl_id, publish_index, exchange, routing_key,"
            " properties, body) FROM STDIN"
        ) as copy:
            for r in rows:
                copy.write_row(
                    (VPN, r.queue, repl_id(r.n), r.index, "ex", "rk", r.properties, r.body)
                )


def many(queues: Sequence[str], per_queue: int, size: int = 100) -> list[Row]:
    """``per_queue`` messages in each queue, publishes interleaved across them."""
    rows = []
    for i in range(per_queue):
        for j, q in enumerate(queues):
            n = i * len(queues) + j + 1
            rows.append(Row(q, n, n, plain_properties(n), f"{q}:{n}:".encode().ljust(size, b".")))
    return rows


def expected(rows: Iterable[Row], queue: str) -> list[tuple[bytes, bytes]]:
    ordered = sorted((r for r in rows if r.queue == queue), key=lambda r: (r.index, repl_id(r.n)))
    return [(persistent_properties(r.properties), r.body) for r in ordered]


def promotion_state(site: LocalSite) -> tuple[Any, ...]:
    with psycopg.connect(site.pg.dsn()) as conn:
        row = conn.execute(
            "SELECT materialised, total FROM promotion WHERE vpn = %s", (VPN,)
        ).fetchone()
        queues = conn.execute(
            "SELECT queue, epoch, messages, done FROM promotion_queue WHERE vpn = %s"
            " ORDER BY queue",
            (VPN,),
        ).fetchall()
    assert row is not None
    return (*row, queues)


def run(site: LocalSite, loop: str = "asyncio", **kwargs: Any) -> MaterialiseResult:
    return run_on(loop, materialise(site.pg.dsn(), site.rabbit.amqp_url(), VPN, EPOCH, **kwargs))


def run_on(loop: str, coro: Coroutine[Any, Any, MaterialiseResult]) -> MaterialiseResult:
    """On asyncio (the CLI) or uvloop (the node)."""
    return uvloop.run(coro) if loop == "uvloop" else asyncio.run(coro)


# ------------------------------------------------------------------ raw consumer


class RawConsumer:
    """A blocking AMQP client for reading back what the broker holds: each
    message as (content-header property bytes, body), untouched by any codec."""

    def __init__(self, port: int, vhost: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self._buf = b""
        self.sock.sendall(b"AMQP\x00\x00\x09\x01")
        self._expect(commands.Connection.Start)
        self._send(commands.Connection.StartOk(mechanism="PLAIN", response="\0guest\0guest"))
        tune = self._expect(commands.Connection.Tune)
        self.frame_max = tune.frame_max
        self._send(commands.Connection.TuneOk(tune.channel_max, tune.frame_max, 0))
        self._send(commands.Connection.Open(virtual_host=vhost))
        self._expect(commands.Connection.OpenOk)
        self._send(commands.Channel.Open(), 1)
        self._expect(commands.Channel.OpenOk)

    def __enter__(self) -> RawConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._send(commands.Connection.Close(200, "bye", 0, 0))
            self._expect(commands.Connection.CloseOk)
        finally:
            self.sock.close()

    def _send(self, method: base.Frame, channel: int = 0) -> None:
        self.sock.sendall(frame.marshal(method, channel))

    def _recv(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the broker closed the connection")
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def _frame(self) -> tuple[int, bytes]:
        """(type, whole frame) of the next frame that is not a heartbeat."""
        while True:
            head = self._recv(7)
            ftype, _, size = struct.unpack(">BHI", head)
            data = head + self._recv(size + 1)
            assert data[-1] == 0xCE
            if ftype != 8:
                return ftype, data

    def _expect(self, cls: type[Any]) -> Any:
        ftype, data = self._frame()
        assert ftype == 1, f"expected a method frame, got type {ftype}"
        _, _, method = frame.unmarshal(data)
        assert isinstance(method, cls), f"expected {cls.__name__}, got {method!r}"
        return method

    def declare(self, queue: str, arguments: dict[str, Any] | None = None) -> None:
        self._send(commands.Queue.Declare(queue=queue, durable=True, arguments=arguments), 1)
        self._expect(commands.Queue.DeclareOk)

    def publish(self, queue: str, body: bytes) -> None:
        """One persistent message, no confirm: a passive declare after it
        returns once the broker has routed it (same channel, in order)."""
        props = commands.Basic.Properties(delivery_mode=2)
        self.sock.sendall(
            frame.marshal(commands.Basic.Publish(exchange="", routing_key=queue), 1)
            + frame.marshal(header.ContentHeader(0, len(body), props), 1)
            + frame.marshal(body_frame.ContentBody(body), 1)
        )
        self.depth(queue)

    def depth(self, queue: str) -> int:
        self._send(commands.Queue.Declare(queue=queue, passive=True), 1)
        return int(self._expect(commands.Queue.DeclareOk).message_count)

    def drain(self, queue: str) -> list[tuple[bytes, bytes]]:
        """Every message of ``queue`` in queue order (consumed, no-ack)."""
        count = self.depth(queue)
        self._send(commands.Basic.Consume(queue=queue, consumer_tag="t", no_ack=True), 1)
        self._expect(commands.Basic.ConsumeOk)
        got = []
        for _ in range(count):
            deliver = self._expect(commands.Basic.Deliver)
            assert not deliver.redelivered
            ftype, data = self._frame()
            assert ftype == 2
            size = struct.unpack_from(">Q", data, 11)[0]
            properties = data[19:-1]
            body = b""
            while len(body) < size:
                ftype, data = self._frame()
                assert ftype == 3
                assert len(data) <= self.frame_max
                body += data[7:-1]
            assert len(body) == size
            got.append((properties, body))
        self._send(commands.Basic.Cancel(consumer_tag="t"), 1)
        self._expect(commands.Basic.CancelOk)
        assert self.depth(queue) == 0
        return got


def broker_contents(site: LocalSite, queues: Iterable[str]) -> dict[str, list[tuple[bytes, bytes]]]:
    with RawConsumer(site.rabbit.amqp_port, VPN) as amqp:
        return {q: amqp.drain(q) for q in queues}


def depths(site: LocalSite, queues: Iterable[str]) -> dict[str, int]:
    with RawConsumer(site.rabbit.amqp_port, VPN) as amqp:
        return {q: amqp.depth(q) for q in queues}


# ------------------------------------------------------------------ tests


def test_each_queue_gets_its_messages_in_order_with_the_exact_property_bytes(
    site_b: LocalSite,
) -> None:
    prepare(site_b)
    # one message routed to both queues: one row per queue, same id and index
    both = rich_properties(1)
    # stored without a delivery mode (never replicated so, but made safe)
    transient = struct.pack(">H", 0x2000) + _table([id_header(5)])
    rows = [
        Row("q2", 4, 40, plain_properties(4), b"q2 second"),
        Row("q1", 1, 10, both, b"to both"),
        Row("q2", 1, 10, both, b"to both"),
        Row("q1", 3, 30, rich_properties(3), b"q1 third"),
        Row("q1", 2, 20, plain_properties(2), b""),
        Row("q1", 5, 50, transient, b"q1 last"),
    ]
    insert(site_b, rows)
    seen: list[tuple[int, int]] = []

    result = run(site_b, progress=lambda done, total: seen.append((done, total)))

    assert (result.messages, result.queues, result.total, result.purged) == (6, 2, 6, 0)
    assert result.skipped_queues == ()
    got = broker_contents(site_b, ["q1", "q2"])
    assert got == {"q1": expected(rows, "q1"), "q2": expected(rows, "q2")}
    assert [b for _, b in got["q1"]] == [b"to both", b"", b"q1 third", b"q1 last"]
    assert got["q1"][0][0] == both  # byte for byte: the "I" 5 is still an "I"
    assert b"\x05countI\x00\x00\x00\x05" in got["q1"][0][0]
    for properties, _ in got["q1"] + got["q2"]:
        decoded = header.ContentHeader()
        decoded.unmarshal(struct.pack(">HHQ", 60, 0, 0) + properties)
        assert decoded.properties.delivery_mode == 2
        assert isinstance(decoded.properties.headers, dict)
        assert "x-vpnrepl-id" in decoded.properties.headers
    # the transient one: delivery mode inserted, every other byte kept
    assert got["q1"][3][0] == struct.pack(">H", 0x3000) + transient[2:] + b"\x02"
    assert promotion_state(site_b) == (6, 6, [("q1", EPOCH, 4, True), ("q2", EPOCH, 2, True)])
    assert seen[0] == (0, 6) and seen[-1] == (6, 6)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_body_bigger_than_frame_max_arrives_whole(site_b: LocalSite, loop: str) -> None:
    prepare(site_b, ["big"])
    body = os.urandom(300 * 1024)  # three body frames at frame_max 131072
    rows = [
        Row("big", 1, 1, plain_properties(1), body),
        Row("big", 2, 2, plain_properties(2), b"small"),
        Row("big", 3, 3, plain_properties(3), body[::-1]),
    ]
    insert(site_b, rows)

    assert run(site_b, loop).messages == 3
    with RawConsumer(site_b.rabbit.amqp_port, VPN) as amqp:
        assert amqp.frame_max == 131072
        assert amqp.drain("big") == expected(rows, "big")


def test_a_rerun_after_success_materialises_nothing_more(site_b: LocalSite) -> None:
    prepare(site_b)
    rows = many(["q1", "q2"], 50)
    insert(site_b, rows)
    run(site_b)
    before = depths(site_b, ["q1", "q2"])

    again = run(site_b)

    assert (again.messages, again.queues, again.total) == (0, 0, 100)
    assert again.skipped_queues == ("q1", "q2")
    assert depths(site_b, ["q1", "q2"]) == before == {"q1": 50, "q2": 50}
    assert promotion_state(site_b)[:2] == (100, 100)


_KILLER = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from bridge.roles import materialise

    dsn, url, vpn, epoch, kill_at = sys.argv[1:]

    def progress(done, total):
        if done >= int(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(materialise(dsn, url, vpn, int(epoch), window=100, progress=progress))
    """
)


@pytest.mark.parametrize("kill_at", [300, 1700], ids=["in-first-queue", "in-second-queue"])
def test_a_run_killed_midway_and_run_again_loses_and_duplicates_nothing(
    site_b: LocalSite, kill_at: int
) -> None:
    queues = ["q1", "q2"]
    prepare(site_b, queues)
    rows = many(queues, 1500)
    insert(site_b, rows)

    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            _KILLER,
            site_b.pg.dsn(),
            site_b.rabbit.amqp_url(),
            VPN,
            str(EPOCH),
            str(kill_at),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert killed.returncode == -9, killed.stderr
    # what the killed run wrote before it died is in the broker, confirmed or not
    partial = depths(site_b, queues)
    assert 0 < sum(partial.values()) < 3000
    materialised, total, recorded = promotion_state(site_b)
    assert total == 3000 and materialised < 3000
    first_done = [q for q, _, _, done in recorded if done]
    assert first_done == ([] if kill_at < 1500 else ["q1"])

    result = run(site_b)

    assert result.skipped_queues == tuple(first_done)
    assert result.purged > 0  # what the killed run left in the queue it was filling
    got = broker_contents(site_b, queues)
    for q in queues:
        assert got[q] == expected(rows, q), f"{q}: {len(got[q])} messages"
    assert promotion_state(site_b) == (
        3000,
        3000,
        [("q1", EPOCH, 1500, True), ("q2", EPOCH, 1500, True)],
    )


def test_a_missing_queue_is_refused_before_anything_is_published(site_b: LocalSite) -> None:
    prepare(site_b, ["q1"])  # q2 and q3 were never imported
    insert(site_b, many(["q1", "q2", "q3"], 3))

    with pytest.raises(MaterialiseError) as err:
        run(site_b)

    text = str(err.value)
    assert "'q2'" in text and "'q3'" in text and "not in the definitions this site holds" in text
    assert err.value.queue == "q2" and err.value.vpn == VPN
    assert depths(site_b, ["q1"]) == {"q1": 0}
    assert all(not done for *_, done in promotion_state(site_b)[2])


def test_a_broker_nack_fails_the_queue_and_leaves_it_not_done(site_b: LocalSite) -> None:
    prepare(site_b, [])
    with RawConsumer(site_b.rabbit.amqp_port, VPN) as amqp:
        amqp.declare("tiny", {"x-max-length": 5, "x-overflow": "reject-publish"})
    insert(site_b, many(["tiny"], 20))

    with pytest.raises(MaterialiseError) as err:
        run(site_b, window=10)

    assert "'tiny'" in str(err.value) and "nack" in str(err.value)
    assert promotion_state(site_b)[2] == [("tiny", EPOCH, 20, False)]


def test_a_promotion_of_another_epoch_is_refused(site_b: LocalSite) -> None:
    prepare(site_b, ["q1"], epoch=EPOCH + 1)
    insert(site_b, many(["q1"], 3))

    with pytest.raises(MaterialiseError, match="no promotion of epoch 2 is recorded"):
        run(site_b)
    assert depths(site_b, ["q1"]) == {"q1": 0}


def test_rows_of_an_older_epoch_are_replaced(site_b: LocalSite) -> None:
    prepare(site_b, ["q1"])
    insert(site_b, many(["q1"], 4))
    with psycopg.connect(site_b.pg.dsn()) as conn:
        conn.execute(
            "INSERT INTO promotion_queue (vpn, queue, epoch, messages, done) VALUES"
            " (%s, 'q1', 1, 99, true), (%s, 'gone', 1, 7, true)",
            (VPN, VPN),
        )

    result = run(site_b)

    assert (result.messages, result.skipped_queues) == (4, ())
    assert promotion_state(site_b) == (4, 4, [("q1", EPOCH, 4, True)])


def test_an_unreachable_broker_is_a_materialise_error(site_b: LocalSite) -> None:
    prepare(site_b, ["q1"])
    insert(site_b, many(["q1"], 2))
    url = site_b.rabbit.amqp_url().replace(str(site_b.rabbit.amqp_port), "1")

    with pytest.raises(MaterialiseError, match="cannot connect"):
        asyncio.run(materialise(site_b.pg.dsn(), url, VPN, EPOCH))


def test_a_missing_vhost_says_to_import_the_definitions(site_b: LocalSite) -> None:
    prepare(site_b, [])
    site_b.rabbit.api("DELETE", f"vhosts/{VPN}")
    insert(site_b, many(["q1"], 1))

    with pytest.raises(MaterialiseError, match="vhost 'orders'.*imported"):
        run(site_b)


@pytest.fixture(scope="module")
def tls_rabbit(sites: LocalSites, pki: Pki) -> Iterator[RabbitNode]:
    """A third RabbitMQ node that also accepts AMQPS, with a certificate the
    test CA signed for 127.0.0.1 (in the harness's directory, so an orphan is
    swept like the sites' nodes)."""
    node = RabbitNode(f"vpnrepl-mat-{os.getpid()}", sites.base / "mat-tls" / "rabbit", pki.tls("a"))
    node.start()
    try:
        yield node
    finally:
        node.kill()


def test_materialises_over_amqps_verified_against_the_ca(
    site_b: LocalSite, tls_rabbit: RabbitNode, pki: Pki
) -> None:
    tls_rabbit.reset()
    prepare(site_b, ["q1"], rabbit=tls_rabbit)
    rows = many(["q1"], 20)
    insert(site_b, rows)
    url = tls_rabbit.amqps_url()

    with pytest.raises(MaterialiseError, match="TLS"):  # the system's CAs lack the test CA
        asyncio.run(materialise(site_b.pg.dsn(), url, VPN, EPOCH))

    context = ssl.create_default_context(cafile=str(pki.dir / "ca.crt"))
    result = asyncio.run(materialise(site_b.pg.dsn(), url, VPN, EPOCH, ssl_context=context))
    assert result.messages == 20
    with RawConsumer(tls_rabbit.amqp_port, VPN) as amqp:
        assert amqp.drain("q1") == expected(rows, "q1")


def test_a_queue_someone_else_published_to_is_emptied_and_filled_again(
    site_b: LocalSite, caplog: pytest.LogCaptureFixture
) -> None:
    prepare(site_b, ["q1"])
    rows = many(["q1"], 800)
    insert(site_b, rows)
    intruded = []

    def intrude(done: int, total: int) -> None:
        if done and not intruded:  # after the purge, while the queue fills
            with RawConsumer(site_b.rabbit.amqp_port, VPN) as amqp:
                amqp.publish("q1", b"stray")
            intruded.append(done)

    result = run(site_b, window=100, progress=intrude)

    assert intruded and result.messages == 800 and result.purged == 0
    assert broker_contents(site_b, ["q1"]) == {"q1": expected(rows, "q1")}
    assert "holds 801 messages after 800 were published" in caplog.text


def test_a_connection_the_broker_closes_midway_fails_the_run_and_a_rerun_completes(
    site_b: LocalSite,
) -> None:
    prepare(site_b, ["q1"])
    rows = many(["q1"], 800)
    insert(site_b, rows)

    def close_connections(done: int, total: int) -> None:
        if done:
            site_b.rabbit.ctl("close_all_connections", "-p", VPN, "operator says no")

    with pytest.raises(MaterialiseError, match="'q1'.*320 CONNECTION_FORCED") as err:
        run(site_b, window=100, progress=close_connections)
    assert err.value.queue == "q1"
    assert promotion_state(site_b)[2] == [("q1", EPOCH, 800, False)]

    result = run(site_b)

    assert result.messages == 800 and result.purged > 0
    assert broker_contents(site_b, ["q1"]) == {"q1": expected(rows, "q1")}
