"""Real AMQP 0-9-1 clients we did not write, run against ``amqp_endpoint``.

Each scenario asserts what a user of that client relies on: which messages
arrived, in which order, with which properties, and what was confirmed,
returned, redelivered or refused. The scenarios know nothing about what serves
the endpoint (see ``tests/fix_endpoints.py``): against the broker itself they
pin down RabbitMQ 3.10's behaviour, and the listener must pass them unchanged.

Clients: pika (BlockingConnection and SelectConnection), aio-pika, and the
RabbitMQ Java client from Debian (``tests/interop/java/ClientScenario.java``).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.patterns
import pika
import pika.exceptions
import pytest
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection
from pika.spec import Basic, BasicProperties

from tests.fix_endpoints import Endpoint

Connect = Callable[..., BlockingConnection]


def _kib(i: int) -> bytes:
    """A 1 KiB body that starts with its index, so order is visible in a diff."""
    return f"{i:08d}".encode().ljust(1024, b".")


def _persistent(**kw: Any) -> BasicProperties:
    return BasicProperties(delivery_mode=2, **kw)


@pytest.fixture
def queue(request: pytest.FixtureRequest) -> str:
    """A queue name no other test (or earlier run) has used."""
    test = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name).strip("-")
    return f"clients.{test}.{uuid.uuid4().hex[:8]}"


@pytest.fixture
def connect(amqp_endpoint: Endpoint) -> Iterator[Connect]:
    """Open pika blocking connections to the endpoint; all are closed after the test.

    Keyword arguments set connection parameters (``heartbeat=1``, ``credentials=...``,
    ``virtual_host=...``).
    """
    opened: list[BlockingConnection] = []

    def open_connection(**params: Any) -> BlockingConnection:
        parameters = pika.URLParameters(amqp_endpoint.url())
        for name, value in params.items():
            setattr(parameters, name, value)
        conn = BlockingConnection(parameters)
        opened.append(conn)
        return conn

    yield open_connection
    for conn in opened:
        if conn.is_open:
            conn.close()


def _depth(conn: BlockingConnection, queue: str) -> int:
    """Ready messages in ``queue``, asked on a channel of its own."""
    ch = conn.channel()
    try:
        return int(ch.queue_declare(queue, passive=True).method.message_count)
    finally:
        ch.close()


def _consume(ch: BlockingChannel, queue: str, count: int) -> list[tuple[Basic.Deliver, Any, bytes]]:
    """``count`` deliveries from ``queue`` with manual ack (acked at the end, multiple)."""
    got: list[tuple[Basic.Deliver, Any, bytes]] = []
    for method, props, body in ch.consume(queue, inactivity_timeout=10):
        if method is None:
            break
        got.append((method, props, body))
        if len(got) == count:
            break
    if got:
        ch.basic_ack(got[-1][0].delivery_tag, multiple=True)
    assert ch.cancel() == 0, "deliveries beyond the expected ones were pending"
    return got


# --- pika BlockingConnection ------------------------------------------------


def test_pika_confirmed_publishes_arrive_in_order_with_properties(
    connect: Connect, queue: str
) -> None:
    conn = connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(queue, durable=True)
    bodies = [_kib(i) for i in range(200)]
    for i, body in enumerate(bodies):
        # In confirm mode basic_publish returns only after the broker's basic.ack
        # for this message; a nack raises NackError, a basic.return UnroutableError.
        ch.basic_publish("", queue, body, _persistent(message_id=f"m{i}"), mandatory=True)

    assert _depth(conn, queue) == 200
    got = _consume(conn.channel(), queue, 200)
    assert [body for _, _, body in got] == bodies
    assert [props.message_id for _, props, _ in got] == [f"m{i}" for i in range(200)]
    assert {props.delivery_mode for _, props, _ in got} == {2}
    assert not any(method.redelivered for method, _, _ in got)
    assert [method.delivery_tag for method, _, _ in got] == list(range(1, 201))


def test_pika_multi_frame_and_empty_bodies(connect: Connect, queue: str) -> None:
    conn = connect()
    big = bytes(range(256)) * 1200  # 300 KiB: three body frames at frame_max 128 KiB
    assert conn._impl.params.frame_max < len(big)  # private: negotiated frame_max
    # An empty body is a content header with body_size 0 and no body frame.
    bodies = [big, b"", b"after"]
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(queue, durable=True)
    for body in bodies:
        ch.basic_publish("", queue, body, _persistent(), mandatory=True)
    got = _consume(ch, queue, 3)
    assert [b for _, _, b in got] == bodies


def test_pika_ack_multiple_nack_reject_and_requeue(connect: Connect, queue: str) -> None:
    conn = connect()
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    for i in range(6):
        ch.basic_publish("", queue, f"m{i}".encode(), _persistent())
    ch.basic_qos(prefetch_count=10)
    deliveries = ch.consume(queue, inactivity_timeout=10)

    first = [next(deliveries) for _ in range(6)]
    assert [body for _, _, body in first] == [b"m0", b"m1", b"m2", b"m3", b"m4", b"m5"]
    assert not any(method.redelivered for method, _, _ in first)
    tags = [method.delivery_tag for method, _, _ in first]
    ch.basic_ack(tags[1], multiple=True)  # m0 and m1
    ch.basic_nack(tags[2], requeue=False)  # m2 is dropped
    ch.basic_reject(tags[3], requeue=False)  # m3 is dropped
    ch.basic_nack(tags[4], requeue=True)  # m4 comes back

    method, _, body = next(deliveries)
    assert (body, method.redelivered) == (b"m4", True)
    assert method.delivery_tag not in tags
    ch.basic_ack(method.delivery_tag)
    ch.basic_ack(tags[5])
    assert ch.cancel() == 0
    ch.close()  # anything still unacked would be requeued now

    assert _depth(conn, queue) == 0
    assert conn.channel().basic_get(queue, auto_ack=True) == (None, None, None)


def test_pika_basic_get_properties_counts_and_get_empty(connect: Connect, queue: str) -> None:
    conn = connect()
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    sent = BasicProperties(
        content_type="application/json",
        content_encoding="utf-8",
        headers={"tenant": "acme", "attempt": 3, "flags": {"vip": True}},
        delivery_mode=2,
        priority=5,
        correlation_id="corr-1",
        reply_to="replies",
        expiration="600000",
        message_id="id-1",
        timestamp=1_700_000_000,
        type="order.created",
        user_id="guest",
        app_id="shop",
    )
    ch.basic_publish("", queue, b'{"n": 0}', sent)
    ch.basic_publish("", queue, b'{"n": 1}', _persistent())

    method, props, body = ch.basic_get(queue)
    assert isinstance(method, Basic.GetOk)
    assert (body, method.message_count, method.redelivered) == (b'{"n": 0}', 1, False)
    # Headers a client set must arrive as set; an endpoint may add its own.
    assert {k: props.headers.get(k) for k in sent.headers} == sent.headers
    for name in (
        "content_type",
        "content_encoding",
        "delivery_mode",
        "priority",
        "correlation_id",
        "reply_to",
        "expiration",
        "message_id",
        "timestamp",
        "type",
        "user_id",
        "app_id",
    ):
        assert getattr(props, name) == getattr(sent, name), name
    ch.basic_ack(method.delivery_tag)

    method, _, body = ch.basic_get(queue, auto_ack=True)
    assert (body, method.message_count) == (b'{"n": 1}', 0)
    assert ch.basic_get(queue) == (None, None, None)  # basic.get-empty
    assert _depth(conn, queue) == 0


def test_pika_tx_commit_makes_publish_and_ack_visible(connect: Connect, queue: str) -> None:
    conn = connect()
    plain = conn.channel()
    plain.queue_declare(queue, durable=True)
    plain.basic_publish("", queue, b"old", _persistent())
    tx = conn.channel()
    tx.tx_select()

    method, _, body = tx.basic_get(queue)
    assert body == b"old"
    tx.basic_publish("", queue, b"new", _persistent())
    tx.basic_ack(method.delivery_tag)
    assert _depth(conn, queue) == 0, "a publish became visible before tx.commit"
    tx.tx_commit()

    assert _depth(conn, queue) == 1
    tx.close()  # "old" was acked by the commit, so nothing is requeued
    method, _, body = plain.basic_get(queue, auto_ack=True)
    assert (body, method.redelivered) == (b"new", False)
    assert plain.basic_get(queue) == (None, None, None)


def test_pika_tx_rollback_discards_publish_and_undoes_ack(connect: Connect, queue: str) -> None:
    conn = connect()
    plain = conn.channel()
    plain.queue_declare(queue, durable=True)
    plain.basic_publish("", queue, b"held", _persistent())
    tx = conn.channel()
    tx.tx_select()

    method, _, body = tx.basic_get(queue)
    assert body == b"held"
    tx.basic_publish("", queue, b"discarded", _persistent())
    tx.basic_ack(method.delivery_tag)
    tx.tx_rollback()

    assert _depth(conn, queue) == 0, "the rolled-back publish was enqueued"
    tx.close()  # the ack was undone, so "held" is still unacked and comes back
    method, _, body = plain.basic_get(queue, auto_ack=True)
    assert (body, method.redelivered) == (b"held", True)
    assert plain.basic_get(queue) == (None, None, None)


def test_pika_consumer_sees_no_table_where_none_was_sent(connect: Connect, queue: str) -> None:
    conn = connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(queue, durable=True)
    for headers in (None, {}, {"k": 1}):
        ch.basic_publish("", queue, b"m", _persistent(headers=headers))
    got = [props.headers for _, props, _ in _consume(conn.channel(), queue, 3)]
    assert got == [None, {}, {"k": 1}]


@dataclass
class _Returned:
    method: Basic.Return
    properties: BasicProperties
    body: bytes


def test_pika_mandatory_unroutable_publish_is_returned(connect: Connect, queue: str) -> None:
    conn = connect()
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    ch.queue_bind(queue, "amq.direct", routing_key=queue)
    returned: list[_Returned] = []
    ch.add_on_return_callback(lambda _ch, m, p, b: returned.append(_Returned(m, p, b)))
    nowhere = f"nowhere.{uuid.uuid4().hex}"

    ch.basic_publish("amq.direct", queue, b"routed", _persistent(), mandatory=True)
    ch.basic_publish(
        "amq.direct", nowhere, b"lost", _persistent(message_id="lost-1"), mandatory=True
    )
    deadline = time.monotonic() + 10
    while not returned and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.1)

    # The broker handles the two publishes in order, so once the second is
    # back the first would have been returned already if it were.
    assert len(returned) == 1
    ret = returned[0]
    assert (ret.method.reply_code, ret.method.reply_text) == (312, "NO_ROUTE")
    assert (ret.method.exchange, ret.method.routing_key) == ("amq.direct", nowhere)
    assert (ret.body, ret.properties.message_id) == (b"lost", "lost-1")
    method, _, body = ch.basic_get(queue, auto_ack=True)
    assert (body, method.message_count) == (b"routed", 0)


def test_pika_unroutable_publish_with_confirms_raises_unroutable(
    connect: Connect, queue: str
) -> None:
    # pika raises UnroutableError only if the basic.return arrives before the
    # basic.ack for the same message: an endpoint must keep that order.
    conn = connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(queue, durable=True)
    nowhere = f"nowhere.{uuid.uuid4().hex}"
    with pytest.raises(pika.exceptions.UnroutableError) as err:
        ch.basic_publish("", nowhere, b"lost", _persistent(message_id="lost-2"), mandatory=True)
    [msg] = err.value.messages
    assert (msg.method.reply_code, msg.method.routing_key) == (312, nowhere)
    assert (msg.body, msg.properties.message_id) == (b"lost", "lost-2")

    ch.basic_publish("", queue, b"kept", _persistent(), mandatory=True)
    assert ch.basic_get(queue, auto_ack=True)[2] == b"kept"


def test_pika_exclusive_queue_is_locked_for_other_connections(connect: Connect, queue: str) -> None:
    owner = connect()
    owner.channel().queue_declare(queue, exclusive=True)
    other = connect()

    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        other.channel().basic_consume(queue, lambda *_: None)
    assert err.value.reply_code == 405
    assert err.value.reply_text.startswith("RESOURCE_LOCKED")
    assert other.is_open  # a channel error, not a connection error

    owner.close()  # the exclusive queue goes with its connection
    deadline = time.monotonic() + 10
    while True:
        try:
            other.channel().queue_declare(queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker as e:
            assert e.reply_code == 404
            break
        assert time.monotonic() < deadline, "exclusive queue outlived its connection"
        time.sleep(0.1)


def test_pika_idle_connection_with_1s_heartbeat_stays_open(connect: Connect, queue: str) -> None:
    conn = connect(heartbeat=1)
    assert conn._impl.params.heartbeat == 1  # private: the negotiated value
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    checker = conn._impl._heartbeat_checker  # private: counts heartbeat frames
    before = checker._heartbeat_frames_received
    conn.sleep(4)  # idle for four intervals; only heartbeats cross the wire
    # The broker drops a client silent for two intervals, but pika checks its
    # inbound side only every heartbeat + 5 s: count the broker's heartbeats.
    assert conn.is_open
    assert checker._heartbeat_frames_received - before >= 3
    ch.basic_publish("", queue, b"still here", _persistent())
    assert ch.basic_get(queue, auto_ack=True)[2] == b"still here"


def test_pika_consumer_is_told_when_its_queue_is_deleted(connect: Connect, queue: str) -> None:
    # The broker sends basic.cancel only to clients whose client-properties
    # advertise consumer_cancel_notify: an endpoint must forward them intact.
    conn = connect()
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    cancelled: list[str] = []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    tag = ch.basic_consume(queue, lambda *_: None)
    conn.channel().queue_delete(queue)
    deadline = time.monotonic() + 10
    while not cancelled and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.1)
    assert cancelled == [tag]
    assert ch.is_open


def test_pika_refused_login_and_unknown_vhost_are_reported(
    connect: Connect, amqp_endpoint: Endpoint
) -> None:
    with pytest.raises(pika.exceptions.ProbableAuthenticationError) as auth:
        connect(credentials=pika.PlainCredentials("guest", "wrong"))
    # pika wraps the broker's connection.close: "(403) 'ACCESS_REFUSED - Login was refused..."
    assert "(403) 'ACCESS_REFUSED" in str(auth.value)

    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as denied:
        connect(virtual_host=f"no-such-vhost-{uuid.uuid4().hex[:6]}")
    assert "(530) 'NOT_ALLOWED" in str(denied.value)


# --- pika SelectConnection --------------------------------------------------


@dataclass
class _ChannelRun:
    queue: str
    channel: Any = None
    unconfirmed: set[int] = field(default_factory=set)
    acked: int = 0
    nacked: int = 0
    received: list[tuple[bytes, bool]] = field(default_factory=list)


class _SelectDriver:
    """Callback-style pika on its own ioloop: on each of several channels at once,
    publish ``count`` messages in confirm mode, wait for every confirm, then
    consume them back with manual acks; stop the ioloop when all is done."""

    def __init__(self, endpoint: Endpoint, queues: list[str], count: int) -> None:
        self.count = count
        self.runs = [_ChannelRun(q) for q in queues]
        self.error: str | None = None
        self.conn = pika.SelectConnection(
            pika.URLParameters(endpoint.url()),
            on_open_callback=self._on_open,
            on_open_error_callback=self._on_open_error,
            on_close_callback=self._on_closed,
        )

    def run(self, timeout: float) -> None:
        self.conn.ioloop.call_later(timeout, self._on_timeout)
        try:
            self.conn.ioloop.start()
        finally:
            if not self.conn.is_closed:
                if not self.conn.is_closing:
                    self.conn.close()
                self.conn.ioloop.start()  # until _on_closed stops it
            self.conn.ioloop.close()  # its wake-up socket pair

    def _fail(self, why: str) -> None:
        self.error = self.error or why
        if self.conn.is_open:
            self.conn.close()

    def _on_timeout(self) -> None:
        self._fail("timed out")

    def _on_open_error(self, _conn: Any, err: BaseException) -> None:
        self.error = f"could not connect: {err!r}"
        self.conn.ioloop.stop()

    def _on_closed(self, _conn: Any, _reason: BaseException) -> None:
        self.conn.ioloop.stop()

    def _on_open(self, conn: Any) -> None:
        for run in self.runs:
            conn.channel(on_open_callback=lambda ch, run=run: self._on_channel(run, ch))

    def _on_channel(self, run: _ChannelRun, ch: Any) -> None:
        run.channel = ch
        ch.add_on_close_callback(lambda _ch, reason: self._on_channel_closed(reason))
        ch.confirm_delivery(
            ack_nack_callback=lambda frame: self._on_confirm(run, frame.method),
            callback=lambda _frame: ch.queue_declare(
                run.queue, durable=True, callback=lambda _f: self._publish(run)
            ),
        )

    def _on_channel_closed(self, reason: BaseException) -> None:
        if not self.conn.is_closing:  # channels close with the connection at the end
            self._fail(f"channel closed: {reason!r}")

    def _publish(self, run: _ChannelRun) -> None:
        for i in range(self.count):
            run.unconfirmed.add(i + 1)  # confirm sequence numbers start at 1
            run.channel.basic_publish("", run.queue, _kib(i), _persistent())

    def _on_confirm(self, run: _ChannelRun, method: Basic.Ack | Basic.Nack) -> None:
        tags = (
            {t for t in run.unconfirmed if t <= method.delivery_tag}
            if method.multiple
            else {method.delivery_tag} & run.unconfirmed
        )
        if not tags:
            self._fail(f"confirm for unknown or settled tag {method.delivery_tag}")
        run.unconfirmed -= tags
        if isinstance(method, Basic.Ack):
            run.acked += len(tags)
        else:
            run.nacked += len(tags)
        if not run.unconfirmed:
            run.channel.basic_qos(
                prefetch_count=50,
                callback=lambda _f: run.channel.basic_consume(
                    run.queue, lambda ch, m, p, b: self._on_message(run, ch, m, b)
                ),
            )

    def _on_message(self, run: _ChannelRun, ch: Any, method: Basic.Deliver, body: bytes) -> None:
        run.received.append((body, method.redelivered))
        ch.basic_ack(method.delivery_tag)
        if all(len(r.received) == self.count for r in self.runs):
            self.conn.close()


def test_pika_select_connection_confirms_and_acks_on_two_channels(
    amqp_endpoint: Endpoint, queue: str
) -> None:
    driver = _SelectDriver(amqp_endpoint, [f"{queue}.a", f"{queue}.b"], count=100)
    driver.run(timeout=30)
    assert driver.error is None
    for run in driver.runs:
        assert (run.acked, run.nacked, run.unconfirmed) == (100, 0, set())
        assert run.received == [(_kib(i), False) for i in range(100)]


# --- aio-pika ---------------------------------------------------------------


async def _aio_pika_scenario(url: str, queue: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    connection = await aio_pika.connect_robust(url)
    async with connection:
        channel = await connection.channel()  # publisher confirms are on by default
        q = await channel.declare_queue(queue, durable=True)
        confirms = await asyncio.gather(
            *(
                channel.default_exchange.publish(
                    aio_pika.Message(
                        _kib(i),
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                        message_id=f"m{i}",
                        headers={"n": i},
                    ),
                    routing_key=queue,
                )
                for i in range(100)
            )
        )
        seen["confirms"] = {type(c).__name__ for c in confirms}

        received: list[tuple[str | None, Any, bytes, bool | None]] = []
        async with q.iterator() as messages:
            async for message in messages:
                received.append(
                    (
                        message.message_id,
                        message.headers.get("n"),
                        message.body,
                        message.redelivered,
                    )
                )
                await message.ack()
                if len(received) == 100:
                    break
        seen["received"] = received
        seen["left"] = await _aio_depth(q)

        tx_channel = await connection.channel(publisher_confirms=False)
        tx = tx_channel.transaction()
        await tx.select()
        await tx_channel.default_exchange.publish(aio_pika.Message(b"t1"), routing_key=queue)
        seen["before_commit"] = await _aio_depth(q)
        await tx.commit()
        seen["after_commit"] = await _aio_depth(q)
        await tx_channel.default_exchange.publish(aio_pika.Message(b"t2"), routing_key=queue)
        await tx.rollback()
        seen["after_rollback"] = await _aio_depth(q)
        got = await q.get(no_ack=True, fail=False)
        seen["got"] = None if got is None else got.body
        seen["then"] = await q.get(no_ack=True, fail=False)
    return seen


async def _aio_depth(q: aio_pika.abc.AbstractQueue) -> int:
    # Re-declare rather than declare_queue(passive=True): a robust channel
    # answers that from its cache without asking the broker.
    count = (await q.declare()).message_count
    assert count is not None
    return count


def test_aio_pika_confirms_consume_and_transaction(amqp_endpoint: Endpoint, queue: str) -> None:
    seen = asyncio.run(_aio_pika_scenario(amqp_endpoint.url(), queue))
    assert seen["confirms"] == {"Ack"}
    assert seen["received"] == [(f"m{i}", i, _kib(i), False) for i in range(100)]
    assert seen["left"] == 0
    assert (seen["before_commit"], seen["after_commit"], seen["after_rollback"]) == (0, 1, 1)
    assert (seen["got"], seen["then"]) == (b"t1", None)


async def _aio_pika_returns(url: str, queue: str) -> dict[str, Any]:
    """aiormq settles a confirm-mode publish on the broker's basic.ack and
    drops a basic.return that comes after it: an endpoint that lets the ack
    overtake the return turns an unroutable publish into a silent success."""
    seen: dict[str, Any] = {}
    connection = await aio_pika.connect(url)
    async with connection:
        # publisher confirms on; a returned publish raises instead of being handed
        # to the return callbacks
        channel = await connection.channel(on_return_raises=True)
        await channel.declare_queue(queue, durable=True)
        nowhere = f"{queue}.nowhere"
        try:
            await channel.default_exchange.publish(
                aio_pika.Message(b"lost", delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=nowhere,
                mandatory=True,
                timeout=10,
            )
            seen["unroutable"] = "confirmed"
        except aio_pika.exceptions.DeliveryError as e:  # aio-pika 10: its PublishError
            seen["unroutable"] = ("returned", e.message.routing_key)
        # an RPC call to a queue nobody declared: the request comes back at once
        rpc = await aio_pika.patterns.RPC.create(channel)
        try:
            await asyncio.wait_for(rpc.call(f"{queue}.no-such-method", kwargs={}), 10)
            seen["rpc"] = "answered"
        except (aio_pika.exceptions.DeliveryError, aio_pika.exceptions.MessageProcessError):
            seen["rpc"] = "returned"
        except TimeoutError:
            seen["rpc"] = "hung"
        finally:
            await rpc.close()
        # routed publishes still confirm, after the returned one
        await channel.default_exchange.publish(
            aio_pika.Message(b"kept", delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=queue,
            mandatory=True,
        )
        q = await channel.declare_queue(queue, durable=True)
        got = await q.get(no_ack=True, fail=False)
        seen["kept"] = None if got is None else got.body
    return seen


def test_aio_pika_unroutable_mandatory_publish_raises_delivery_error(
    amqp_endpoint: Endpoint, queue: str
) -> None:
    seen = asyncio.run(_aio_pika_returns(amqp_endpoint.url(), queue))
    assert seen["unroutable"] == ("returned", f"{queue}.nowhere")
    assert seen["rpc"] == "returned"
    assert seen["kept"] == b"kept"


#: headers of every AMQP field type a client commonly sends, as aio-pika
#: encodes them; None is a message without a headers table at all
_HEADER_CASES: list[dict[str, Any] | None] = [
    None,
    {},
    {"n": 7},
    {"big": 2**40, "neg": -3, "small": 1, "f": 1.5, "yes": True, "no": False},
    {"s": "text", "nested": {"a": 1, "b": ["x", 2]}, "list": [1, "2"]},
    {"x-vpnrepl-like": "not ours", "": "empty key"},
]


async def _aio_pika_headers(url: str, queue: str) -> list[Any]:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        q = await channel.declare_queue(queue, durable=True)
        for i, headers in enumerate(_HEADER_CASES):
            message = aio_pika.Message(
                b"h%d" % i, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, message_id=str(i)
            )
            message.headers = headers  # type: ignore[assignment] - None: no table at all
            await channel.default_exchange.publish(message, routing_key=queue)
        got = []
        for _ in _HEADER_CASES:
            incoming = await q.get(timeout=10)
            got.append((incoming.message_id, incoming.properties.headers))
            await incoming.ack()
        # a message redelivered after a requeue is cut the same way
        await channel.default_exchange.publish(
            aio_pika.Message(b"again", delivery_mode=2, headers={"k": "v"}), routing_key=queue
        )
        first = await q.get(timeout=10)
        await first.reject(requeue=True)
        second = await q.get(timeout=10)
        got.append(("again", first.properties.headers, second.properties.headers))
        await second.ack()
    return got


def test_aio_pika_consumer_sees_the_publishers_headers(amqp_endpoint: Endpoint, queue: str) -> None:
    got = asyncio.run(_aio_pika_headers(amqp_endpoint.url(), queue))
    # aio-pika shows a message without a headers table as {} (pika: None,
    # checked in test_pika_consumer_sees_no_table_where_none_was_sent)
    expected: list[Any] = [(str(i), h or {}) for i, h in enumerate(_HEADER_CASES)]
    expected.append(("again", {"k": "v"}, {"k": "v"}))
    assert got == expected


# --- RabbitMQ Java client ---------------------------------------------------

_JAVA_SOURCE = Path(__file__).with_name("java") / "ClientScenario.java"
# jar -> the Debian package that ships it
_JARS = {
    "/usr/share/java/amqp-client.jar": "librabbitmq-client-java",
    "/usr/share/java/slf4j-api.jar": "libslf4j-java",
    "/usr/share/java/slf4j-nop.jar": "libslf4j-java",  # keeps SLF4J quiet on stderr
}


class JavaClient:
    """``ClientScenario.java`` compiled once per session into a temporary directory."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._classpath: str | None = None
        self._java = "java"

    def classpath(self) -> str:
        if self._classpath is None:
            missing = sorted({pkg for jar, pkg in _JARS.items() if not Path(jar).is_file()})
            if missing:
                pytest.fail(
                    f"RabbitMQ Java client jars missing: apt-get install {' '.join(missing)}"
                )
            javac, java = shutil.which("javac"), shutil.which("java")
            if javac is None or java is None:
                pytest.fail("javac/java not found: apt-get install openjdk-17-jdk-headless")
            jars = ":".join(_JARS)
            build = subprocess.run(
                [javac, "-Xlint:all", "-Werror", "-cp", jars, "-d", str(self.workdir)]
                + [str(_JAVA_SOURCE)],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert build.returncode == 0, f"javac failed:\n{build.stdout}{build.stderr}"
            self._classpath, self._java = f"{self.workdir}:{jars}", java
        return self._classpath

    def run(self, endpoint: Endpoint, queue_prefix: str) -> dict[str, str]:
        result = subprocess.run(
            [self._java, "-cp", self.classpath(), "ClientScenario"]
            + [endpoint.host, str(endpoint.port), endpoint.vhost, queue_prefix],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, f"ClientScenario failed:\n{result.stdout}{result.stderr}"
        return dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)


@pytest.fixture(scope="session")
def java_client(tmp_path_factory: pytest.TempPathFactory) -> JavaClient:
    return JavaClient(tmp_path_factory.mktemp("java-client"))


def test_java_client_confirms_acks_get_and_transactions(
    java_client: JavaClient, amqp_endpoint: Endpoint, queue: str
) -> None:
    seen = java_client.run(amqp_endpoint, queue)
    assert seen.pop("client.version").startswith("5.")
    assert seen == {
        "confirm.published": "100",
        "confirm.acked": "100",
        "confirm.nacked": "0",
        "confirm.outstanding": "0",
        "confirm.depth": "100",
        "confirm.in_order": "true",
        "confirm.persistent_1k": "true",
        "consume.order": "m0,m1,m2,m3,m4,m5",
        "consume.redelivered": "m4:true",
        "consume.extra": "none",
        "consume.left": "0",
        "get.first": "g0",
        "get.remaining": "1",
        "get.content_type": "text/plain",
        "get.correlation_id": "corr-1",
        "get.header.k": "v",
        "get.second": "g1",
        "get.second_remaining": "0",
        "get.empty": "true",
        "tx.depth_before_commit": "0",
        "tx.depth_after_commit": "1",
        "tx.got_after_commit": "new",
        "tx.depth_after_rollback": "0",
        "tx.after_close": "new:true",
        "tx.then_empty": "true",
        "done": "true",
    }
