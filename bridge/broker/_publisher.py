"""The bridge's own AMQP client: one connection, one confirm channel,
publishing stored messages byte for byte.

pika and aio-pika encode properties again, which changes field types
(:func:`bridge.amqp.encode_message`); this client writes the stored bytes
verbatim. Publishes are not ``mandatory`` (a mandatory message costs
RabbitMQ 3.10 about 3 µs more, ``bench/RESULTS.md``): a caller that must know
every message found its queue checks the queue's depth after, as the
materialiser does. A message counts as confirmed only once the broker acked
it (:class:`~bridge.amqp.BrokerConfirms`); a nack, a return, a close, a lost
or silent connection raises :class:`~bridge.amqp.AMQPError` in its waiter,
never passes silently. Foreign errors are translated here, ``raise ...
from``. Each ack that opens the window writes the next messages from the
receive callback, with no task switch; writes stop above the transport's
high-water mark, so memory stays bounded by the window and the batch.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import struct
from collections.abc import Sequence
from typing import Any, TypeVar, cast

from pamqp import base, commands, frame
from pamqp.exceptions import PAMQPException

from bridge.amqp import (
    FRAME_METHOD,
    HEARTBEAT_FRAME,
    PROTOCOL_HEADER,
    AmqpEndpoint,
    AMQPError,
    BrokerConfirms,
    BrokerProtocolError,
    BrokerUnreachable,
    FrameSpan,
    FrameSplitter,
    PublishRejected,
    broker_frames,
    encode_message,
    refusal,
)

__all__ = ["BrokerPublisher"]

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound=base.Frame)

#: a whole basic.ack / basic.nack frame: head, class, method, tag, bits, end
_CONFIRM_FRAME_SIZE = 7 + 13 + 1
_CONFIRM = struct.Struct(">HHQB")
#: bytes joined into one transport write at most (then the next chunk)
_WRITE_CHUNK = 1 << 20


class BrokerPublisher(asyncio.Protocol):
    """One AMQP connection with one channel in confirm mode.

    Use :meth:`connect` (or ``async with await BrokerPublisher.connect(...)``),
    then :meth:`declare_passive`, :meth:`purge`, :meth:`publish` and
    :meth:`wait_confirmed`; :meth:`close` at the end. A channel the broker
    closed (a passive declare of a missing queue) is opened again by the
    next call; a refused publish (:class:`PublishRejected`) or a connection
    error leaves the publisher unusable: close it.
    """

    CHANNEL = 1

    def __init__(
        self, vhost: str, heartbeat: int, connection_name: str, transactional: bool = False
    ) -> None:
        self.vhost = vhost
        #: the channel is in transaction mode (:meth:`commit`), not confirm mode
        self.transactional = transactional
        self.connection_name = connection_name
        self.frame_max = 131072
        self.heartbeat = heartbeat
        self._tracker = BrokerConfirms()
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._splitter = FrameSplitter(self.frame_max)
        self._error: AMQPError | None = None  # the connection's, final
        self._channel_error: AMQPError | None = None  # until the channel is reopened
        self._channel_open = False
        self._closing = False
        self._paused = False
        self._lost: asyncio.Future[None] = self._loop.create_future()
        self._rpc: asyncio.Future[base.Frame] | None = None
        self._written: asyncio.Future[None] | None = None
        self._all_confirmed: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_read = self._last_write = self._loop.time()
        # the batch being published
        self._batch: Sequence[tuple[bytes, bytes]] | None = None
        self._batch_pos = 0
        self._window = 1
        self._routing_key: str | None = None
        self._publish_frame = b""

    # ------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(
        cls,
        endpoint: AmqpEndpoint | Sequence[AmqpEndpoint],
        vhost: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout: float = 30.0,
        heartbeat: int = 30,
        connection_name: str = "vpnrepl",
        transactional: bool = False,
    ) -> BrokerPublisher:
        """Connect, log in, open ``vhost`` and a confirm channel (with
        ``transactional``, a channel in transaction mode instead: what is
        published waits for :meth:`commit`).

        ``endpoint`` may be a cluster's nodes: they are tried in order, the
        next when one cannot be reached; a refusal by one that answered
        (login, vhost) is the cluster's and final. ``ssl_context`` is used
        for ``amqps``; without one, the system's trusted CAs and hostname
        checking (TLS 1.2 or later)."""
        nodes = [endpoint] if isinstance(endpoint, AmqpEndpoint) else list(endpoint)
        unreachable: list[str] = []
        for node in nodes:
            try:
                return await cls._connect_one(
                    node,
                    vhost,
                    ssl_context=ssl_context,
                    connect_timeout=connect_timeout,
                    heartbeat=heartbeat,
                    connection_name=connection_name,
                    transactional=transactional,
                )
            except BrokerUnreachable as e:
                unreachable.append(str(e))
        raise BrokerUnreachable("; ".join(unreachable) or "no broker node to connect to")

    @classmethod
    async def _connect_one(
        cls,
        endpoint: AmqpEndpoint,
        vhost: str,
        *,
        ssl_context: ssl.SSLContext | None,
        connect_timeout: float,
        heartbeat: int,
        connection_name: str,
        transactional: bool,
    ) -> BrokerPublisher:
        loop = asyncio.get_running_loop()
        context = ssl_context
        if endpoint.tls and context is None:
            context = ssl.create_default_context()
            context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            async with asyncio.timeout(connect_timeout):
                _, proto = await loop.create_connection(
                    lambda: cls(vhost, heartbeat, connection_name, transactional),
                    endpoint.host,
                    endpoint.port,
                    ssl=context if endpoint.tls else None,
                    server_hostname=endpoint.host if endpoint.tls else None,
                )
        except ssl.SSLError as e:
            raise BrokerUnreachable(f"TLS with {endpoint} failed: {e.reason or e}") from e
        except TimeoutError as e:
            raise BrokerUnreachable(
                f"cannot connect to {endpoint}: no answer in {connect_timeout} s"
            ) from e
        except OSError as e:
            raise BrokerUnreachable(f"cannot connect to {endpoint}: {e.strerror or e}") from e
        try:
            await proto._handshake(endpoint, connect_timeout)
        except BaseException:
            proto.abort()
            raise
        return proto

    async def __aenter__(self) -> BrokerPublisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """``connection.close`` (when the connection is still sound), then
        wait for the socket to close."""
        if self._transport is None:
            return
        if not self._closing:
            self._closing = True
            if self._error is None:
                close = commands.Connection.Close(200, "bye", 0, 0)
                try:
                    await self._call(close, commands.Connection.CloseOk, 0, 5.0)
                except AMQPError as e:
                    log.debug("closing the broker connection: %s", e)
            self._transport.close()
        try:
            await asyncio.wait_for(asyncio.shield(self._lost), 5)
        except TimeoutError:
            self.abort()

    def abort(self) -> None:
        """Drop the connection at once (unconfirmed messages stay unconfirmed)."""
        self._closing = True
        if self._transport is not None:
            self._transport.abort()

    # ------------------------------------------------------------ requests

    async def declare_passive(self, queue: str) -> int:
        """The queue's ready-message count; :class:`~bridge.amqp.NotFound`
        when it does not exist (the broker closes the channel; the next call
        opens it again)."""
        await self._ensure_channel()
        ok = await self._call(
            commands.Queue.Declare(queue=queue, passive=True), commands.Queue.DeclareOk
        )
        return ok.message_count or 0

    async def purge(self, queue: str) -> int:
        """Empty the queue of its ready messages; returns how many there were."""
        await self._ensure_channel()
        ok = await self._call(commands.Queue.Purge(queue=queue), commands.Queue.PurgeOk)
        return ok.message_count or 0

    async def publish(
        self, routing_key: str, messages: Sequence[tuple[bytes, bytes]], window: int
    ) -> None:
        """Publish ``(properties, body)`` pairs to the default exchange with
        ``routing_key``, in order, keeping at most ``window`` unconfirmed;
        returns once the last one is written (not yet confirmed: see
        :meth:`wait_confirmed`). ``properties`` go out verbatim."""
        if window < 1:
            raise ValueError(f"the confirm window must be at least 1, got {window}")
        if self._batch is not None:
            raise RuntimeError("publish() is already running on this connection")
        await self._ensure_channel()
        if not messages:
            return
        if routing_key != self._routing_key:
            self._routing_key = routing_key
            method = commands.Basic.Publish(exchange="", routing_key=routing_key)
            self._publish_frame = frame.marshal(method, self.CHANNEL)
        self._window = window
        self._batch, self._batch_pos = messages, 0
        self._written = self._loop.create_future()
        try:
            self._pump()
            await self._written
        finally:
            self._batch, self._written = None, None

    async def commit(self) -> None:
        """Commit what was published on a transactional channel, all or none."""
        if not self.transactional:
            raise RuntimeError("commit() needs a publisher connected with transactional=True")
        await self._call(commands.Tx.Commit(), commands.Tx.CommitOk)
        self._tracker = BrokerConfirms()  # nothing is confirmed on such a channel

    async def wait_confirmed(self) -> None:
        """Return once the broker confirmed everything published so far."""
        self._check(self.CHANNEL)
        if self._tracker.unconfirmed == 0:
            return
        self._all_confirmed = self._loop.create_future()
        try:
            await self._all_confirmed
        finally:
            self._all_confirmed = None

    @property
    def confirmed(self) -> int:
        """Messages confirmed on the current channel."""
        return self._tracker.confirmed

    @property
    def unconfirmed(self) -> int:
        """Messages published on the current channel and not confirmed yet."""
        return self._tracker.unconfirmed

    # ------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._closing:
            self._fail(BrokerUnreachable("the connection to the broker is closed"))
        else:
            reason = f": {exc}" if exc else " (closed by the broker)"
            self._fail(BrokerUnreachable(f"the connection to the broker was lost{reason}"))
        if not self._lost.done():
            self._lost.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._pump()

    def data_received(self, data: bytes) -> None:
        self._last_read = self._loop.time()
        acked = 0
        try:
            buf, frames = broker_frames(self._splitter, data)
            for f in frames:
                if f.type == FRAME_METHOD:
                    acked += self._on_method(buf, f)
                # a heartbeat only shows the broker alive (_last_read); content
                # frames only follow a basic.return, which failed the publisher
        except AMQPError as e:
            self._fail(e)
            self.abort()
            return
        if acked:
            self._pump()
            if self._tracker.unconfirmed == 0:
                _resolve(self._all_confirmed)

    # ------------------------------------------------------------ frames in

    def _on_method(self, buf: bytes, f: FrameSpan) -> int:
        """Handle method frame ``f`` of ``buf``; returns how many publishes it
        confirmed."""
        if f.end - f.start == _CONFIRM_FRAME_SIZE and f.channel == self.CHANNEL:
            class_id, method_id, tag, bits = _CONFIRM.unpack_from(buf, f.start + 7)
            if class_id == 60 and method_id == 80:
                return self._tracker.ack(tag, bool(bits & 1))
            if class_id == 60 and method_id == 120:
                raise PublishRejected(f"the broker nacked delivery tag {tag}")
        try:
            _, _, method = frame.unmarshal(buf[f.start : f.end])
        except PAMQPException as e:
            raise BrokerProtocolError(f"undecodable method frame: {e}") from e
        if not isinstance(method, base.Frame):
            raise BrokerProtocolError(f"expected a method frame, got {type(method).__name__}")
        self._on_control(method, f.channel)
        return 0

    def _on_control(self, method: base.Frame, channel: int) -> None:
        if isinstance(method, commands.Connection.Close):
            self._write(frame.marshal(commands.Connection.CloseOk(), 0))
            where = (method.class_id or 0, method.method_id or 0)
            self._fail(refusal("connection", method.reply_code or 0, method.reply_text, where))
            self._closing = True
            if self._transport is not None:
                self._transport.close()
        elif isinstance(method, commands.Channel.Close):
            self._write(frame.marshal(commands.Channel.CloseOk(), channel))
            where = (method.class_id or 0, method.method_id or 0)
            self._fail_channel(refusal("channel", method.reply_code or 0, method.reply_text, where))
        elif isinstance(method, commands.Basic.Return):
            raise PublishRejected(
                f"the broker returned a message published to {method.routing_key!r}: "
                f"{method.reply_code} {method.reply_text}"
            )
        elif isinstance(method, commands.Connection.Blocked):
            log.warning("the broker blocks publishing (%s): waiting", method.reason)
        elif isinstance(method, commands.Connection.Unblocked):
            log.info("the broker publishes again")
        elif self._rpc is not None and not self._rpc.done():
            self._rpc.set_result(method)
        else:
            log.debug("ignored an unsolicited %s on channel %d", method.name, channel)

    # ------------------------------------------------------------ frames out

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)
            self._last_write = self._loop.time()

    def _pump(self) -> None:
        """Write the batch's next messages while the window and the
        transport have room; resolve :attr:`_written` when it is all out."""
        batch = self._batch
        if batch is None or self._error is not None or self._channel_error is not None:
            return
        tracker, publish, channel, frame_max = (
            self._tracker,
            self._publish_frame,
            self.CHANNEL,
            self.frame_max,
        )
        pos, end = self._batch_pos, len(batch)
        while not self._paused and pos < end:
            room = self._window - tracker.unconfirmed
            if room <= 0:
                break
            stop = min(end, pos + room)
            out: list[bytes] = []
            size = 0
            start = pos
            while pos < stop and size < _WRITE_CHUNK:
                properties, body = batch[pos]
                encode_message(out, publish, channel, properties, body, frame_max)
                size += len(body)
                pos += 1
            tracker.sent(pos - start)
            self._batch_pos = pos
            self._write(b"".join(out))
        if pos == end:
            self._batch = None
            _resolve(self._written)

    # ------------------------------------------------------------ control

    def _check(self, channel: int) -> None:
        if self._error is not None:
            raise self._error
        if channel and self._channel_error is not None:
            raise self._channel_error

    async def _call(
        self,
        method: base.Frame | None,
        reply: type[_M],
        channel: int = CHANNEL,
        reply_within: float = 30.0,
    ) -> _M:
        """Send ``method`` (None: only wait) and return the broker's ``reply``."""
        self._check(channel)
        fut: asyncio.Future[base.Frame] = self._loop.create_future()
        self._rpc = fut
        if method is not None:
            self._write(frame.marshal(method, channel))
        what = method.name if method is not None else reply.name
        try:
            async with asyncio.timeout(reply_within):
                got = await fut
        except TimeoutError as e:
            raise BrokerUnreachable(
                f"the broker did not answer {what} within {reply_within} s"
            ) from e
        finally:
            self._rpc = None
        if not isinstance(got, reply):
            raise BrokerProtocolError(f"expected {reply.name} in answer to {what}, got {got.name}")
        return got

    async def _handshake(self, endpoint: AmqpEndpoint, reply_within: float) -> None:
        self._write(PROTOCOL_HEADER)
        start = await self._call(None, commands.Connection.Start, 0, reply_within)
        if "PLAIN" not in str(start.mechanisms).split():
            raise BrokerProtocolError(f"the broker offers no PLAIN login ({start.mechanisms})")
        start_ok = commands.Connection.StartOk(
            client_properties={
                "product": "vpnrepl",
                "connection_name": self.connection_name,
                "capabilities": {
                    "publisher_confirms": True,
                    "connection.blocked": True,
                    "authentication_failure_close": True,
                },
            },
            mechanism="PLAIN",
            response=f"\0{endpoint.username}\0{endpoint.password}",
        )
        tune = await self._call(start_ok, commands.Connection.Tune, 0, reply_within)
        self.frame_max = tune.frame_max or 131072
        self._splitter.frame_max = self.frame_max
        if tune.heartbeat and self.heartbeat:
            self.heartbeat = min(tune.heartbeat, self.heartbeat)
        else:
            self.heartbeat = max(tune.heartbeat or 0, self.heartbeat)
        self._write(
            frame.marshal(
                commands.Connection.TuneOk(tune.channel_max, self.frame_max, self.heartbeat), 0
            )
        )
        await self._call(
            commands.Connection.Open(virtual_host=self.vhost),
            commands.Connection.OpenOk,
            0,
            reply_within,
        )
        if self.heartbeat:
            self._timer = self._loop.call_later(self.heartbeat / 2, self._tick)
        await self._ensure_channel()

    async def _ensure_channel(self) -> None:
        """(Re)open the channel in confirm mode if the broker closed it."""
        self._check(0)
        if self._channel_open:
            self._check(self.CHANNEL)
            return
        self._channel_error = None
        await self._call(commands.Channel.Open(), commands.Channel.OpenOk)
        self._channel_open = True
        self._tracker = BrokerConfirms()
        if self.transactional:
            await self._call(commands.Tx.Select(), commands.Tx.SelectOk)
        else:
            await self._call(commands.Confirm.Select(), commands.Confirm.SelectOk)

    def _tick(self) -> None:
        """Heartbeats: send one when we wrote nothing for half the interval;
        give up on a broker silent for two intervals."""
        now = self._loop.time()
        if now - self._last_read > 2 * self.heartbeat:
            self._fail(BrokerUnreachable(f"the broker sent nothing for {2 * self.heartbeat} s"))
            self.abort()
            return
        if now - self._last_write >= self.heartbeat / 2:
            self._write(HEARTBEAT_FRAME)
        self._timer = self._loop.call_later(self.heartbeat / 2, self._tick)

    def _fail(self, err: AMQPError) -> None:
        """A connection-level error: final; everyone waiting gets it."""
        if self._error is None:
            self._error = err
        self._wake(self._error)

    def _fail_channel(self, err: AMQPError) -> None:
        self._channel_open = False
        self._channel_error = err
        self._wake(err)

    def _wake(self, err: AMQPError) -> None:
        for fut in (self._rpc, self._written, self._all_confirmed):
            if fut is not None and not fut.done():
                fut.set_exception(err)


def _resolve(fut: asyncio.Future[Any] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)
