"""One client connection through the listener, as a sans-IO state machine.

``Session`` is fed the bytes each side sent and returns what to send on, plus
the replication events it saw. It never opens a socket; ``_listener`` drives it.

Invariants, and why the code keeps them:

* **The client's channel numbering is never disturbed.** The session only
  relays, splices or holds the client's own frames; it never injects a frame
  that would move publisher-confirm sequence numbers or delivery tags. Frames
  it sends of its own accord are replies in place of a held frame (a confirm,
  ``tx.commit-ok``) or the closing of a connection it has to refuse.
* **A held confirm is released once, and ``multiple`` never spans a held
  tag.** On a replicated connection every publish of a confirm channel gets a
  ``_Confirm`` entry keyed by its sequence number. An entry is *ready* when the
  broker has answered and, for a replicated publish, the sink has reported it
  durable. Ready entries at the front are released as ``multiple`` runs (all
  lower tags are already released by construction); ready entries behind a
  held one are released one by one. A released entry is deleted.
* **A consumption event always follows its publish.** Events reach the sink
  in the order frames arrive, and a delivery can only be acked after it was
  delivered, which is after it was published.
* **Requeues and closes produce no event.** An unacked delivery that returns
  to its queue (nack/reject with requeue, ``basic.recover``, channel or
  connection close) just forgets its mapping.
* **Transactions are all-or-nothing towards the sink.** Events of a
  transactional channel are buffered; ``tx.commit`` is held until the sink has
  prepared them, ``tx.commit-ok`` until the sink has committed them;
  ``tx.rollback`` and a close discard them (acks rolled back are restored, as
  the deliveries stay unacked at the broker).
"""

from __future__ import annotations

import copy
import enum
import logging
import struct
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pamqp import base, commands, frame, header
from pamqp.body import ContentBody

from bridge import (
    MARKER_QUEUE,
    REPLICATION_HEADER,
    ConfirmKey,
    Consumed,
    DeadLettered,
    Event,
    IdSource,
    LocalTransaction,
    Published,
    Purged,
    ReplicationId,
    id_in_header,
)

from . import _amqp as amqp
from ._amqp import AMQPError, Frame, FrameSplitter
from ._directory import VpnDirectory, VpnView

__all__ = ["BrokerUnavailable", "Output", "Session", "commit_marker"]

log = logging.getLogger(__name__)

#: frame-max before tune-ok: RabbitMQ's own ceiling for handshake frames.
HANDSHAKE_FRAME_MAX = 131072


@dataclass(slots=True)
class Output:
    """What the driver must do after feeding the session."""

    to_broker: list[bytes] = field(default_factory=list)
    to_client: list[bytes] = field(default_factory=list)
    #: (event, confirm key or None): hand to ``ReplicationSink.append``.
    events: list[tuple[Event, ConfirmKey | None]] = field(default_factory=list)
    #: transactions to prepare (sink.prepare, then ``transaction_prepared``).
    prepare: list[LocalTransaction] = field(default_factory=list)
    #: transactions to commit (sink.commit, then ``transaction_committed``).
    commit: list[LocalTransaction] = field(default_factory=list)
    #: prepared transactions whose broker commit will never be sent (sink.abort).
    abort: list[LocalTransaction] = field(default_factory=list)
    #: transactions whose tx.commit went to the broker but whose commit-ok
    #: will never be seen: the outcome is the marker's (sink.resolve).
    unresolved: list[LocalTransaction] = field(default_factory=list)
    #: the upstream connection is to be dropped without an AMQP close.
    drop_broker: bool = False


@dataclass(slots=True)
class _Confirm:
    replicated: bool = False
    broker: bool | None = None  # True ack, False nack, None not yet
    durable: bool | None = None  # sink outcome for replicated publishes
    #: the replicated publish, kept until the broker has answered: a broker
    #: nack (e.g. a full queue with reject-publish) must take it back out
    event: Published | None = None

    @property
    def ready(self) -> bool:
        if self.broker is None:
            return False
        return not self.replicated or self.durable is not None

    @property
    def ok(self) -> bool:
        return bool(self.broker) and (not self.replicated or bool(self.durable))


@dataclass(slots=True)
class _Publish:
    """A publish whose content is on its way from the client."""

    exchange: str
    routing_key: str
    seq: int | None
    body_size: int = -1  # -1 until the content header arrived
    received: int = 0
    #: set when the publish is replicated
    repl_id: ReplicationId | None = None
    properties: bytes = b""
    queues: tuple[str, ...] = ()
    chunks: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class _Incoming:
    """A delivery or get-ok whose content header is on its way from the broker."""

    queue: str | None
    delivery_tag: int
    no_ack: bool
    is_return: bool = False
    #: the delivery's routing key, kept when its queue dead-letters rejects
    #: without a routing key of its own
    routing_key: str | None = None


@dataclass(slots=True)
class _Channel:
    #: the queue the channel declared last (an empty queue name means it)
    last_queue: str = ""
    closing: bool = False  # channel.close sent by either side, close-ok pending
    #: we closed the channel on both sides: close-oks still due (client, broker)
    closed_by_us: int = 0
    #: the client's close-ok came; what it sends on the channel number before the
    #: broker's (a reopening) waits here, to go once the broker is done with it
    reopening: list[bytes] | None = None
    publish: _Publish | None = None
    incoming: _Incoming | None = None
    confirm: bool = False
    next_seq: int = 1
    pending: dict[int, _Confirm] = field(default_factory=dict)
    #: sequence numbers in publish order; released ones are skipped lazily
    order: deque[int] = field(default_factory=deque)
    tx: bool = False
    tx_events: list[Event] = field(default_factory=list)
    tx_acked: dict[int, tuple[ReplicationId, str]] = field(default_factory=dict)
    tx_sequence: int = 0
    tx_prepared: LocalTransaction | None = None
    tx_committing: LocalTransaction | None = None
    held_commit: bytes = b""
    consumers: dict[str, tuple[str, bool]] = field(default_factory=dict)
    consumes: deque[tuple[str, bool]] = field(default_factory=deque)
    gets: deque[tuple[str, bool]] = field(default_factory=deque)
    deliveries: dict[int, tuple[ReplicationId, str]] = field(default_factory=dict)
    #: delivery tag -> routing key, for deliveries from dead-lettering queues
    routing_keys: dict[int, str] = field(default_factory=dict)
    #: the topology change of each request awaiting its -ok, and whether that
    #: -ok is ours to swallow (a nowait request we made synchronous)
    topology_ops: deque[tuple[Callable[[Any], None] | None, bool]] = field(default_factory=deque)
    #: the client's frames after a nowait request we made synchronous: they
    #: wait for the broker's verdict on it (see Session._topology)
    held: list[bytes] | None = None


_Handler = Callable[["Session", int, bytes, Frame], bytes | None]


class _Declined(enum.Enum):
    """:meth:`Session._publish_whole` leaves the frames to the slow path."""

    DECLINED = 0


#: class and method id of basic.publish as they appear in a method frame
_PUBLISH_IDS = bytes((0, 60, 0, 40))
#: the layout of a persistent publish without headers (for routing only)
_PERSISTENT = amqp.PropertyLayout(0x1000, 14, 14, 2, 0)
#: distinct (exchange, routing key) pairs remembered per connection
_ROUTES_LIMIT = 1024
#: distinct content-header property byte strings remembered per connection
_TEMPLATES_LIMIT = 256
#: class 60 (basic), weight 0: the first four bytes of a valid content header
_BASIC_NO_WEIGHT = bytes((0, 60, 0, 0))
#: stands for the id while a header template is made (an int64, like an id)
_ID_PLACEHOLDER = amqp.long_field(0)
_ID_SIZE = 8  # the placeholder's data, replaced per message
#: our entry's name as it stands in a headers table (length octet and name)
_ID_ENTRY_PREFIX = 1 + len(REPLICATION_HEADER)
_WIRE = struct.Struct(">q")
_BODY_SIZE = struct.Struct(">Q")
_HEADER_FRAME_HEAD = struct.Struct(">BHI")


class _HeaderTemplate(NamedTuple):
    """A checked content header's layout and its property bytes with our id
    header spliced in: ``before_id + id (int64) + after_id``; ``alone``: the
    headers table is ours alone (the id's value says so, see
    :data:`REPLICATION_HEADER`)."""

    layout: amqp.PropertyLayout
    before_id: bytes
    after_id: bytes
    alone: bool


class Session:
    """The AMQP 0-9-1 state of one proxied client connection."""

    _ids_counter = 0

    def __init__(
        self,
        directory: VpnDirectory,
        ids: IdSource,
        peers: Callable[[], Iterable[Session]] | None = None,
    ) -> None:
        """``peers``: every session of the listener (this one included), for
        the deliveries a purge leaves in its queue; without it, only this
        session's are known."""
        Session._ids_counter += 1
        self.connection_id = Session._ids_counter
        self._directory = directory
        self._ids = ids
        self._peers = peers
        self._client = FrameSplitter(HANDSHAKE_FRAME_MAX)
        self._broker = FrameSplitter(0)
        self._got_protocol_header = False
        self._channels: dict[int, _Channel] = {}
        self._out = Output()
        self.vhost: str | None = None
        self.vpn: VpnView | None = None
        self.open = False  # connection.open-ok seen
        #: open on a vhost that is not replicated: check frames, track nothing
        self.passthrough = False
        self._content: dict[int, int] = {}  # channel -> declared body size (-1: header due)
        self._received: dict[int, int] = {}  # channel -> body bytes received so far
        #: ``replicated``, fixed at connection.open (settings apply to new connections)
        self._replicating = False
        #: the VPN shows consumers our id header (``vpn enable --expose-id``)
        self._expose_id = False
        self.closing = False  # a connection.close is on its way
        self.client_done = False  # nothing more will come from / go to the client
        self.broker_done = False
        self._closed_by_us = False
        #: the client's connection.close went to the broker: its close-ok is
        #: due, and no close of ours may follow (RabbitMQ answers each close
        #: with a close-ok; one meeting the socket we closed at the first is
        #: logged as a client that vanished)
        self._client_close_upstream = False
        #: reply code of the fault that made us close the client, if any
        self.fault_code: int | None = None
        self._exclusive_queues: list[str] = []
        self._client_header_buf = b""
        #: the client's stream lost its framing (we closed for a frame fault)
        self._desynced = False
        self._scan_tail = b""
        #: _route_whole's memo, valid for one topology generation
        self._routes: dict[bytes, tuple[str, str, tuple[str, ...]]] = {}
        self._routes_generation = -1
        #: _header_template's memo
        self._templates: dict[bytes, _HeaderTemplate] = {}

    # ------------------------------------------------------------ feeding

    @property
    def replicated(self) -> bool:
        return self._replicating

    def client_data(self, data: bytes) -> Output:
        """Bytes from the client; returns what to forward and what happened."""
        self._out = out = Output()
        if self.client_done:
            return out
        if self._desynced:
            self._find_close_ok(data)
            return out
        try:
            if not self._got_protocol_header:
                data = self._protocol_header(data)
                if not data:
                    return out
            buf, frames, fault = self._client.feed(data)
            self._from_client(buf, frames)
            if fault is not None and not self._closed_by_us:
                self._desynced = True
                raise fault
        except AMQPError as e:
            self._fail(e)
        return out

    def broker_data(self, data: bytes) -> Output:
        """Bytes from the broker; returns what to forward and what happened."""
        self._out = out = Output()
        if self.passthrough and not self._closed_by_us:
            out.to_client.append(self._broker.take_tail() + data if self._broker.pending else data)
            return out
        if self.broker_done:
            return out
        buf, frames, fault = self._broker.feed(data)
        self._from_broker(buf, frames)
        if fault is not None and not self._closed_by_us:
            self._broker_fault(fault)
        return out

    def replicated_done(self, done: list[tuple[ConfirmKey, bool]]) -> Output:
        """The sink's verdicts ``((channel, seq), ok)`` on replicated publishes."""
        self._out = out = Output()
        if self.closing:
            return out
        touched: dict[int, list[int]] = {}
        for (channel, seq), ok in done:
            ch = self._channels.get(channel)
            entry = ch.pending.get(seq) if ch is not None else None
            if entry is None:
                continue
            entry.durable = ok
            if entry.broker is not None:  # else nothing can be released yet
                touched.setdefault(channel, []).append(seq)
        for channel, seqs in touched.items():
            self._release_confirms(channel, self._channels[channel], seqs)
        return out

    def transaction_prepared(self, channel: int, refused: str | None = None) -> Output:
        """The sink prepared (``refused`` None) or refused the held commit.

        Prepared: the held ``tx.commit`` goes to the broker behind the commit
        marker, a persistent publish of the transaction id to the VPN's
        marker queue inside the same broker transaction (a transactional
        channel has no confirm numbering, so the client's numbering is
        undisturbed), which is how recovery learns whether the broker
        committed. Refused: the channel is closed on both sides with 406 and
        the reason; the broker rolls the transaction back, nothing is applied.
        """
        self._out = out = Output()
        ch = self._channels.get(channel)
        if ch is None or ch.tx_prepared is None:
            return out
        txn, ch.tx_prepared = ch.tx_prepared, None
        held, ch.held_commit = ch.held_commit, b""
        if refused is not None:
            self._close_channel(
                channel, ch, amqp.PRECONDITION_FAILED, f"transaction not committed: {refused}"
            )
            return out
        if ch.closing or self.closing:
            out.abort.append(txn)  # the client is gone: the broker rolls back
            return out
        ch.tx_committing = txn
        out.to_broker.append(commit_marker(channel, txn.txid) + held)
        return out

    def transaction_committed(self, channel: int) -> Output:
        """The sink committed the transaction: release ``tx.commit-ok``."""
        self._out = out = Output()
        ch = self._channels.get(channel)
        if ch is not None and not self.closing:
            out.to_client.append(amqp.marshal_method(commands.Tx.CommitOk(), channel))
        return out

    def shutdown(self, reason: str) -> Output:
        """The listener is stopping: close both sides with AMQP, as RabbitMQ
        itself does on shutdown (320), so nothing is dropped mid-frame."""
        self._out = out = Output()
        if not self.client_done and not self._closed_by_us:
            self._fail(amqp.ConnectionForced(reason))
            self.fault_code = None  # not a protocol fault of the client
        return out

    def connection_lost(self) -> Output:
        """Either side went away: exclusive queues of this connection are
        gone; a transaction whose tx.commit reached the broker without its
        commit-ok coming back is left to the marker (``unresolved``), one
        still being prepared is aborted."""
        self._out = out = Output()
        if self.vpn is not None:
            for queue in self._exclusive_queues:
                self.vpn.topology.delete_queue(queue)
                self._emptied(queue, deleted=True)
        self._exclusive_queues.clear()
        for ch in self._channels.values():
            self._channel_gone(ch)
        self._channels.clear()
        return out

    def _channel_gone(self, ch: _Channel) -> None:
        if ch.tx_committing is not None:
            self._out.unresolved.append(ch.tx_committing)
            ch.tx_committing = None
        if ch.tx_prepared is not None:
            self._out.abort.append(ch.tx_prepared)
            ch.tx_prepared = None

    def _close_channel(self, channel: int, ch: _Channel, code: int, text: str) -> None:
        """Close ``channel`` on both sides (a channel exception of ours); both
        close-oks are swallowed when they come."""
        log.warning(
            "connection %d: closing channel %d: %d %s", self.connection_id, channel, code, text
        )
        self._out.to_client.append(
            amqp.marshal_method(
                commands.Channel.Close(reply_code=code, reply_text=text, class_id=90, method_id=20),
                channel,
            )
        )
        self._out.to_broker.append(
            amqp.marshal_method(
                commands.Channel.Close(
                    reply_code=200, reply_text="channel closed by vpnrepl", class_id=0, method_id=0
                ),
                channel,
            )
        )
        ch.closing = True
        ch.closed_by_us = 2
        self._channel_gone(ch)
        self._release_held(ch)  # into the close handshake, as if they came now

    def _closing_frame(
        self, channel: int, ch: _Channel, buf: bytes, f: Frame, client: bool
    ) -> bytes | None:
        """A frame on a closing channel: only the close handshake matters."""
        ids = amqp.method_id(buf, f) if f.type == amqp.FRAME_METHOD else None
        if ids == amqp.TX_COMMIT_OK and not client and ch.tx_committing is not None:
            # the broker committed before the close: the transaction stands
            self._out.commit.append(ch.tx_committing)
            ch.tx_committing = None
        if not ch.closed_by_us:
            if ids == amqp.CHANNEL_CLOSE_OK:
                self._channel_gone(ch)
                del self._channels[channel]
            return None
        if client and ch.reopening is not None:
            # the client is done with the old channel and may reuse its number
            # (pika does at once); the broker is not done yet: hold it
            ch.reopening.append(buf[f.start : f.end])
        elif ids == amqp.CHANNEL_CLOSE and client:  # the client closed too: answer it
            self._out.to_client.append(amqp.marshal_method(commands.Channel.CloseOk(), channel))
        elif ids == amqp.CHANNEL_CLOSE_OK:
            ch.closed_by_us -= 1
            if client:
                ch.reopening = []
            if not ch.closed_by_us:
                del self._channels[channel]
                if ch.reopening:
                    self._reopen(b"".join(ch.reopening))
        return b""  # nothing of ours reaches the other side any more

    def _reopen(self, held: bytes) -> None:
        """Relay client frames held back, now, as if they came now: those on
        a channel number the client reused before the broker closed the old
        channel (``reopening``), or those that waited for the broker's answer
        to a nowait request made synchronous (:meth:`_release_held`)."""
        buf, frames, _ = FrameSplitter(0).feed(held)  # whole frames: no fault
        self._from_client(buf, frames)

    # ------------------------------------------------------------ client side

    def _protocol_header(self, data: bytes) -> bytes:
        need = 8 - len(self._client_header_buf)
        self._client_header_buf += data[:need]
        rest = data[need:]
        if len(self._client_header_buf) < 8:
            return b""
        self._got_protocol_header = True
        if self._client_header_buf != amqp.PROTOCOL_HEADER:
            # AMQP 0-9-1 section 4.2.2: answer with the header we speak, then close.
            self._out.to_client.append(amqp.PROTOCOL_HEADER)
            self._out.drop_broker = True
            self.client_done = self.broker_done = True
            return b""
        self._out.to_broker.append(amqp.PROTOCOL_HEADER)
        return rest

    def _from_client(self, buf: bytes, frames: list[Frame]) -> None:
        check = self._check_frame if self.passthrough else self._client_frame
        self._relay(
            buf,
            frames,
            self._out.to_broker,
            check,
            self._closing_from_client,
            self._fail,
            fused=self._publish_whole if self._replicating else self._publish_checked,
        )

    def _relay(
        self,
        buf: bytes,
        frames: list[Frame],
        out: list[bytes],
        handle: Callable[[bytes, Frame], bytes | None],
        closing: Callable[[bytes, Frame], None],
        fail: Callable[[AMQPError], None],
        fused: _Fused | None = None,
    ) -> None:
        """Relay ``frames`` of ``buf`` into ``out``: untouched runs as slices of
        the original bytes, a frame ``handle`` replaced by what it returned
        (b"" drops it). Frames before a fault are still relayed; after we have
        closed the connection, frames only go to ``closing``.

        Order is kept: what a handler itself adds to ``out`` (a released
        confirm, our close) goes after every frame that came before the one
        it handled, never ahead of them.

        With ``fused`` (client frames: :meth:`_publish_whole` on a replicated
        connection, :meth:`_publish_checked` on another), a ``basic.publish``
        whose header and single body frame follow in the same read is handled
        in one step; it declines anything unusual, and those frames then go
        one by one through ``handle``, which reports faults at the exact frame.
        """
        run = 0  # start of the untouched run of frames to relay
        i, n = 0, len(frames)
        while i < n:
            f = frames[i]
            i += 1
            if self._closed_by_us:
                closing(buf, f)
                continue
            replacement: bytes | None | _Declined = _Declined.DECLINED
            if fused is not None and i + 1 < n and buf[f.start + 7 : f.start + 11] == _PUBLISH_IDS:
                replacement = fused(buf, f, frames[i], frames[i + 1])
                if replacement is not _Declined.DECLINED:
                    f = frames[i]  # the header frame is the one replaced
                    i += 2
            if replacement is _Declined.DECLINED:
                mark = len(out)
                try:
                    replacement = handle(buf, f)
                except AMQPError as e:
                    run = _behind_frame(out, mark, buf, run, f, b"")  # f is not relayed
                    fail(e)
                    continue
                if len(out) > mark:
                    run = _behind_frame(out, mark, buf, run, f, replacement)
                    continue
            if replacement is None:
                continue
            if f.start > run:
                out.append(buf[run : f.start])
            if replacement:
                out.append(replacement)
            run = f.end
        if frames and not self._closed_by_us:
            _relay_rest(buf, run, frames[-1].end, out)

    def _publish_checked(self, buf: bytes, f: Frame, h: Frame, b: Frame) -> None | _Declined:
        """:meth:`_check_frame` for a whole publish at once: method ``f``
        (its ids are ``basic.publish``), header ``h``, body ``b``. None when
        the three pass every check the frame-by-frame path makes and leave
        its state as it was (a complete publish with one body frame on a
        channel not inside content); else ``DECLINED``, and the frames go one
        by one through :meth:`_check_frame`, which reports the fault."""
        channel = f.channel
        if (
            f.type == amqp.FRAME_METHOD
            and f.end - f.start >= 12
            and channel not in self._content
            and h.type == amqp.FRAME_HEADER
            and h.channel == channel
            and h.end - h.start >= 22
            and b.type == amqp.FRAME_BODY
            and b.channel == channel
            and b.end - b.start > 8
            and _BODY_SIZE.unpack_from(buf, h.start + 11)[0] == b.end - b.start - 8
        ):
            return None
        return _Declined.DECLINED

    def _check_frame(self, buf: bytes, f: Frame) -> None:
        """Frame checks only, for a connection on an unreplicated vhost.

        RabbitMQ 3.10 drops the TCP connection without a ``connection.close``
        on an unknown method, and silently accepts a body longer than its
        header declared; the listener answers both with the right reply code,
        so a client sees the same behaviour on every vhost.
        """
        ftype, channel = f.type, f.channel
        expect = self._content
        if ftype == amqp.FRAME_METHOD:
            self._check_method(amqp.method_id(buf, f), channel)
        elif ftype == amqp.FRAME_BODY:
            due = expect.get(channel, -1)
            if due < 0:
                raise amqp.UnexpectedFrame(f"content body on channel {channel} without a header")
            got = self._received.get(channel, 0) + f.end - f.start - 8
            if got > due:
                raise amqp.FrameError(
                    f"content body of {got} bytes exceeds the declared size {due}"
                )
            if got < due:
                self._received[channel] = got
            else:
                del expect[channel]
                self._received.pop(channel, None)
        elif ftype == amqp.FRAME_HEADER:
            if expect.get(channel) != -1:
                raise amqp.UnexpectedFrame(f"content header on channel {channel} without a publish")
            size = amqp.content_body_size(buf, f)
            if size:
                expect[channel] = size
            else:
                del expect[channel]
        elif channel != 0:
            raise amqp.FrameError(f"heartbeat frame on channel {channel}")
        return None

    def _check_method(self, ids: tuple[int, int], channel: int) -> None:
        if channel in self._content:
            raise amqp.UnexpectedFrame(
                f"method frame on channel {channel} while content was expected"
            )
        if ids == amqp.BASIC_PUBLISH:
            self._content[channel] = -1
        elif ids == amqp.CONNECTION_CLOSE and channel == 0:
            self._client_close_upstream = True

    def _client_frame(self, buf: bytes, f: Frame) -> bytes | None:
        """Handle one client frame: None relays it, bytes replace it (b"" drops)."""
        ch = self._channels.get(f.channel)
        if ch is not None and ch.held is not None:
            ch.held.append(buf[f.start : f.end])
            return b""
        if ch is not None and ch.closing:
            # The broker discards what a closing channel still carries.
            return self._closing_frame(f.channel, ch, buf, f, client=True)
        if f.type == amqp.FRAME_METHOD:
            if ch is not None and ch.publish is not None:
                raise amqp.UnexpectedFrame(
                    f"method frame on channel {f.channel} while content was expected"
                )
            ids = amqp.method_id(buf, f)
            handler = _CLIENT_METHODS.get(ids)
            return handler(self, f.channel, buf, f) if handler is not None else None
        if f.type == amqp.FRAME_BODY:
            return self._client_body(ch, buf, f)
        if f.type == amqp.FRAME_HEADER:
            return self._client_content_header(ch, buf, f)
        if f.channel != 0:
            raise amqp.FrameError(f"heartbeat frame on channel {f.channel}")
        return None

    def _client_content_header(self, ch: _Channel | None, buf: bytes, f: Frame) -> bytes | None:
        p = ch.publish if ch is not None else None
        if p is None or p.body_size >= 0:
            raise amqp.UnexpectedFrame(f"content header on channel {f.channel} without a publish")
        p.body_size = amqp.content_body_size(buf, f)
        replacement = None
        if self._replicating:
            replacement = self._intercept(p, buf[f.start + 7 : f.end - 1], f.channel)
        if p.body_size == 0:
            self._publish_complete(f.channel)
        return replacement

    def _intercept(self, p: _Publish, payload: bytes, channel: int) -> bytes | None:
        """Decide whether a publish is replicated; splice its id if so."""
        template = self._header_template(payload)
        queues = self._replicated_queues(p.exchange, p.routing_key, payload, template.layout)
        if not queues:
            return None
        p.repl_id, wire = self._ids.next_with_wire(template.alone)
        p.queues = queues
        p.properties, header = _with_id(template, payload, channel, wire)
        return header

    def _replicated_queues(
        self, exchange: str, routing_key: str, payload: bytes, layout: amqp.PropertyLayout
    ) -> tuple[str, ...]:
        """The in-scope queues a publish reaches if it is persistent, sorted
        (empty: the publish is not replicated)."""
        if layout.delivery_mode != 2:
            return ()
        vpn = self.vpn
        assert vpn is not None  # noqa: S101 - only called when replicated
        headers = amqp.decode_headers(payload, layout) if layout.flags & 0x2000 else None
        routed = vpn.topology.route(exchange, routing_key, headers)
        if not routed:
            return ()
        queues = vpn.scope.in_scope(exchange, routing_key, routed)
        if len(queues) == 1:
            return tuple(queues)
        return tuple(sorted(queues))

    def _publish_whole(self, buf: bytes, f: Frame, h: Frame, b: Frame) -> bytes | None | _Declined:
        """A whole publish at once: method ``f``, header ``h``, body ``b``.

        Returns the replacement of the header frame (None: relay all three
        as they are), or ``DECLINED`` — leaving every state untouched — when
        the frames are not one well-formed publish with a single body frame
        on an open channel; the frame-by-frame path then takes them and
        reports any fault exactly where it is. Everything that can fail is
        checked before anything changes.
        """
        channel = f.channel
        ch = self._channels.get(channel)
        if (
            f.type != amqp.FRAME_METHOD
            or ch is None
            or ch.closing
            or ch.held is not None
            or ch.publish is not None
            or h.type != amqp.FRAME_HEADER
            or b.type != amqp.FRAME_BODY
            or h.channel != channel
            or b.channel != channel
            or b.end - b.start == 8  # an empty body frame: a zero size has none
        ):
            return _Declined.DECLINED
        try:
            payload = buf[h.start + 7 : h.end - 1]
            template = self._header_template(payload)
            if _BODY_SIZE.unpack_from(payload, 4)[0] != b.end - b.start - 8:
                return _Declined.DECLINED
            exchange, routing_key, queues = self._route_whole(buf, f)
            if template.layout.delivery_mode != 2:
                queues = ()
            elif template.layout.flags & 0x2000:  # headers may change the route (CC, BCC, x-match)
                queues = self._replicated_queues(exchange, routing_key, payload, template.layout)
        except AMQPError:
            return _Declined.DECLINED
        seq = None
        if ch.confirm:
            seq = ch.next_seq
            ch.next_seq += 1
            ch.pending[seq] = _Confirm()
            ch.order.append(seq)
        if not queues:
            return None
        assert self.vpn is not None  # noqa: S101 - queues are only found when replicated
        repl_id, wire = self._ids.next_with_wire(template.alone)
        properties, header = _with_id(template, payload, channel, wire)
        # tuple.__new__: Published's own __new__ is a Python function (hot path)
        event: Published = _new_tuple(
            Published,
            (
                self.vpn.name,
                repl_id,
                exchange,
                routing_key,
                properties,
                buf[b.start + 7 : b.end - 1],
                queues,
            ),
        )
        self._record_published(ch, channel, seq, event)
        return header

    def _header_template(self, payload: bytes) -> _HeaderTemplate:
        """The checked layout of a content header, and its properties with
        our id spliced in, split around the id: memoised by the property
        bytes (a publisher sends the same properties again and again)."""
        if payload[:4] == _BASIC_NO_WEIGHT:
            hit = self._templates.get(payload[12:])
            if hit is not None:
                return hit
        layout = amqp.property_layout(payload)
        if layout.flags & 0x2000:
            # checked for every publish, persistent or not: RabbitMQ 3.10
            # crashes the channel on a headers table it cannot parse
            amqp.decode_headers(payload, layout)
        spliced = amqp.splice_header(payload, layout, REPLICATION_HEADER, _ID_PLACEHOLDER)
        # our entry ends the headers table; what follows the table is unchanged
        end = len(spliced) - (len(payload) - layout.headers_end)
        at = end - _ID_SIZE
        alone = not layout.flags & 0x2000 and not self._expose_id
        template = _HeaderTemplate(layout, spliced[12:at], spliced[end:], alone)
        if len(self._templates) >= _TEMPLATES_LIMIT:
            self._templates.clear()
        self._templates[payload[12:]] = template
        return template

    def _route_whole(self, buf: bytes, f: Frame) -> tuple[str, str, tuple[str, ...]]:
        """Exchange, routing key and in-scope queues (for a persistent publish
        without headers) of the basic.publish ``f``, memoised by the raw bytes
        of its exchange and routing key while the topology is unchanged."""
        start = f.start + 13  # frame head, ids, reserved-1
        try:
            end = start + 1 + buf[start]
            end += 1 + buf[end]
        except IndexError as e:
            raise amqp.SyntaxError_("malformed basic.publish", amqp.BASIC_PUBLISH) from e
        raw = buf[start:end]
        vpn = self.vpn
        assert vpn is not None  # noqa: S101 - only called when replicated
        generation = vpn.topology.generation
        if generation != self._routes_generation:
            self._routes.clear()
            self._routes_generation = generation
        hit = self._routes.get(raw)
        if hit is None:
            exchange, routing_key, _ = amqp.decode_publish(buf, f)
            queues = self._replicated_queues(exchange, routing_key, b"", _PERSISTENT)
            hit = (exchange, routing_key, queues)
            if len(self._routes) >= _ROUTES_LIMIT:
                self._routes.clear()
            self._routes[raw] = hit
        elif end >= f.end - 1:  # the mandatory/immediate octet is missing
            raise amqp.SyntaxError_("malformed basic.publish", amqp.BASIC_PUBLISH)
        return hit

    def _record_published(
        self, ch: _Channel, channel: int, seq: int | None, event: Published
    ) -> None:
        if ch.tx:
            ch.tx_events.append(event)
        elif seq is not None:
            entry = ch.pending[seq]
            entry.replicated, entry.event = True, event
            self._out.events.append((event, (channel, seq)))
        else:
            self._out.events.append((event, None))

    def _client_body(self, ch: _Channel | None, buf: bytes, f: Frame) -> bytes | None:
        p = ch.publish if ch is not None else None
        if p is None or p.body_size < 0:
            raise amqp.UnexpectedFrame(f"content body on channel {f.channel} without a header")
        p.received += f.end - f.start - 8
        if p.received > p.body_size:
            raise amqp.FrameError(
                f"content body of {p.received} bytes exceeds the declared size {p.body_size}"
            )
        if p.repl_id is not None:
            p.chunks.append(buf[f.start + 7 : f.end - 1])
        if p.received == p.body_size:
            self._publish_complete(f.channel)
        return None

    def _publish_complete(self, channel: int) -> None:
        ch = self._channels[channel]
        p = ch.publish
        assert p is not None  # noqa: S101 - caller checked
        ch.publish = None
        if p.repl_id is None or self.vpn is None:
            return
        event = Published(
            vpn=self.vpn.name,
            repl_id=p.repl_id,
            exchange=p.exchange,
            routing_key=p.routing_key,
            properties=p.properties,
            body=b"".join(p.chunks),
            queues=p.queues,
        )
        self._record_published(ch, channel, p.seq, event)

    def _channel(self, channel: int) -> _Channel:
        ch = self._channels.get(channel)
        if ch is None:
            ch = self._channels[channel] = _Channel()
        return ch

    # client methods ------------------------------------------------------

    def _c_start_ok(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        """EXTERNAL authentication is refused: the client's certificate ends
        at the listener, which terminates TLS, and the broker would judge
        the listener's own connection instead of the client."""
        m = amqp.decode_method(buf, f)
        assert isinstance(m, commands.Connection.StartOk)  # noqa: S101
        if m.mechanism == "EXTERNAL":
            raise amqp.AccessRefused(
                "EXTERNAL authentication (a client certificate) cannot pass through the "
                "vpnrepl listener; log in with a user name and password (PLAIN or AMQPLAIN)",
                amqp.CONNECTION_START_OK,
            )
        return None

    def _c_tune_ok(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        m = amqp.decode_method(buf, f)
        assert isinstance(m, commands.Connection.TuneOk)  # noqa: S101
        self._client.frame_max = m.frame_max
        return None

    def _c_open(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        m = amqp.decode_method(buf, f)
        assert isinstance(m, commands.Connection.Open)  # noqa: S101
        self.vhost = m.virtual_host
        self.vpn = self._directory.lookup(m.virtual_host)
        self._replicating = self.vpn is not None and self.vpn.replicated
        self._expose_id = self.vpn is not None and self.vpn.expose_id
        if self.vpn is not None and self.vpn.refusal is not None:
            raise amqp.NotAllowed(self.vpn.refusal, amqp.CONNECTION_OPEN)
        if self.vpn is not None and not self.vpn.replicated:
            raise amqp.NotAllowed(
                f"vhost '{m.virtual_host}' is a replication standby; connect to the active site",
                amqp.CONNECTION_OPEN,
            )
        return None

    def _close_started(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        """Either side sent connection.close: relay it, stop releasing confirms."""
        self.closing = True
        return None

    def _c_close(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        if channel == 0:
            self._client_close_upstream = True
        return self._close_started(channel, buf, f)

    def _c_close_ok(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        self.client_done = True
        return None

    def _c_channel_open(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        self._channels[channel] = _Channel()
        return None

    def _c_channel_close(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        # The channel's unacked deliveries return to their queues: no event.
        self._channel(channel).closing = True
        return None

    def _c_publish(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        ch = self._channel(channel)
        exchange, key, _ = amqp.decode_publish(buf, f)
        seq = None
        if ch.confirm:
            seq = ch.next_seq
            ch.next_seq += 1
            if self.replicated:
                ch.pending[seq] = _Confirm()
                ch.order.append(seq)
        ch.publish = _Publish(exchange, key, seq)
        return None

    def _c_ack(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        ch = self._channel(channel)
        if not ch.deliveries:
            return None
        tag, multiple, requeue = amqp.decode_ack(buf, f)
        rejected = buf[f.payload_start + 3] != 80  # basic.reject or basic.nack
        if multiple:
            tags = [t for t in ch.deliveries if tag == 0 or t <= tag]
        else:
            tags = [tag] if tag in ch.deliveries else []
        for t in tags:
            repl_id, queue = ch.deliveries.pop(t)
            routing_key = ""
            if ch.routing_keys:
                # a transaction's acks keep theirs: a rollback makes them unacked again
                routing_key = ch.routing_keys.get(t, "") if ch.tx else ch.routing_keys.pop(t, "")
            if requeue:
                continue  # back to the queue: nothing consumed
            event: Event = Consumed(self.vpn.name if self.vpn else "", repl_id, queue)
            if rejected and self.vpn is not None:
                to = self._dead_letter_route(queue, routing_key)
                if to is not None:
                    event = DeadLettered(self.vpn.name, repl_id, queue, to)
            if ch.tx:
                ch.tx_events.append(event)
                ch.tx_acked[t] = (repl_id, queue)
            else:
                self._out.events.append((event, None))
        return None

    def _dead_letter_route(self, queue: str, routing_key: str) -> tuple[str, ...] | None:
        """The in-scope queues a message rejected from ``queue`` goes to
        (None: the queue does not dead-letter). Routed as RabbitMQ routes a
        dead-lettered message, with the queue's dead-letter routing key or
        the message's own; without its headers (a headers exchange as the
        dead-letter exchange, or CC headers, are not followed)."""
        vpn = self.vpn
        assert vpn is not None  # noqa: S101 - caller checked
        target = vpn.topology.dead_letter(queue)
        if target is None:
            return None
        exchange, key = target
        key = routing_key if key is None else key
        routed = vpn.topology.route(exchange, key, None)
        return tuple(sorted(vpn.scope.in_scope(exchange, key, routed)))

    def _routing_key_kept(self, queue: str, buf: bytes, f: Frame) -> str | None:
        """A delivery's routing key, if its queue dead-letters rejects with
        the message's own key (decoded only then)."""
        vpn = self.vpn
        if vpn is None:
            return None
        target = vpn.topology.dead_letter(queue)
        if target is None or target[1] is not None:
            return None
        m = amqp.decode_method(buf, f)
        return str(getattr(m, "routing_key", ""))

    def _c_consume(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        if not self.replicated:
            return None
        m = amqp.decode_method(buf, f)
        assert isinstance(m, commands.Basic.Consume)  # noqa: S101
        ch = self._channel(channel)
        if m.nowait:
            ch.consumers[m.consumer_tag] = (m.queue, m.no_ack)
        else:
            ch.consumes.append((m.queue, m.no_ack))
        return None

    def _c_cancel(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        return None  # the consumer is forgotten on cancel-ok; its deliveries stay acked-able

    def _c_get(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        if not self.replicated:
            return None
        m = amqp.decode_method(buf, f)
        assert isinstance(m, commands.Basic.Get)  # noqa: S101
        self._channel(channel).gets.append((m.queue, m.no_ack))
        return None

    def _c_recover(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        ch = self._channel(channel)
        ch.deliveries.clear()  # redelivered under new tags
        ch.routing_keys.clear()
        return None

    def _c_confirm_select(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        self._channel(channel).confirm = True
        return None

    def _c_tx_select(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        self._channel(channel).tx = True
        return None

    def _c_tx_commit(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        ch = self._channel(channel)
        if not ch.tx_events or self.vpn is None:
            _forget_tx_acks(ch)
            return None
        ch.tx_sequence += 1
        txn = LocalTransaction(
            vpn=self.vpn.name,
            connection=self.connection_id,
            channel=channel,
            sequence=ch.tx_sequence,
            events=tuple(ch.tx_events),
            incarnation=self._ids.incarnation,
        )
        ch.tx_events.clear()
        _forget_tx_acks(ch)
        ch.tx_prepared = txn
        ch.held_commit = buf[f.start : f.end]
        self._out.prepare.append(txn)
        return b""  # held until the sink has prepared

    def _c_tx_rollback(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        ch = self._channel(channel)
        ch.tx_events.clear()
        ch.deliveries.update(ch.tx_acked)  # rolled-back acks: still unacked
        ch.tx_acked.clear()
        return None

    # topology: applied when the broker says -ok (or at once with nowait)

    def _topology(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        """A topology request. Its change applies at the broker's -ok; a
        nowait one's at once, except a queue.delete, queue.purge or
        exchange.delete: the broker may refuse those (if-unused, if-empty,
        another connection's exclusive queue, access), and the change is
        destructive on the standby (its Purged event drops the queue's
        messages there while the active keeps them). Such a request goes to
        the broker synchronous instead; its -ok, which the client did not
        ask for, is swallowed, and the client's later frames on the channel
        wait for it (:meth:`_release_held`), so the change takes its place
        among the channel's events exactly where the broker made it."""
        if not self.replicated:
            return None
        m = amqp.decode_method(buf, f)
        op = _topology_op(m)
        ch = self._channel(channel)
        if op is not None and isinstance(m, _NAMES_A_QUEUE) and not m.queue:
            op = self._on_last_queue(ch, m)
        if not getattr(m, "nowait", False):
            # one entry per request, so each -ok pops its own request
            ch.topology_ops.append((op, False))
        elif isinstance(m, _REFUSABLE) and channel != 0:
            ch.topology_ops.append((op, True))
            ch.held = []
            m.nowait = False
            return amqp.marshal_method(m, channel)
        elif op is not None:
            self._apply_topology(op, None)
        return None

    def _release_held(self, ch: _Channel) -> None:
        """The broker answered the request the client's frames waited for
        (or is closing the channel): relay them now, as if they came now."""
        held, ch.held = ch.held, None
        if held:
            self._reopen(b"".join(held))

    @staticmethod
    def _on_last_queue(ch: _Channel, m: Any) -> Callable[[Any], None]:
        """The topology change of ``m``, whose empty queue name means the
        channel's last declared queue: resolved when it applies, after every
        earlier declare-ok of the channel."""

        def apply(a: Any) -> None:
            if ch.last_queue:
                named = copy.copy(m)
                named.queue = ch.last_queue
                op = _topology_op(named)
                if op is not None:
                    op(a)

        return apply

    def _emptied(self, queue: str, *, deleted: bool) -> None:
        """``queue`` was purged (or deleted): a :class:`Purged` event, on a
        replicated VPN, sparing what a purge leaves in the queue."""
        vpn = self.vpn
        if vpn is None or not self._replicating:
            return
        spared = () if deleted else self._unsettled(vpn.name, queue)
        self._out.events.append((Purged(vpn.name, queue, spared, deleted), None))

    def _unsettled(self, vpn: str, queue: str) -> tuple[ReplicationId, ...]:
        """Ids of ``queue``'s messages delivered on this listener's
        connections to ``vpn`` and not settled yet (acks inside an open
        transaction included: the broker holds those until the commit)."""
        found: set[ReplicationId] = set()
        for session in self._peers() if self._peers is not None else (self,):
            if session.vpn is None or session.vpn.name != vpn:
                continue
            for ch in session._channels.values():
                for held in (ch.deliveries, ch.tx_acked):
                    found.update(rid for rid, q in held.values() if q == queue)
        return tuple(sorted(found, key=lambda r: r.value))

    def _apply_topology(self, op: Callable[[Any], None], ok: Any) -> None:
        vpn = self.vpn
        if vpn is None:
            return
        try:
            op((vpn, ok, self))
        except Exception:  # a topology mismatch must never break the relay
            log.exception("connection %d: topology update failed", self.connection_id)

    def _find_close_ok(self, data: bytes) -> None:
        """After a framing fault the frame boundaries are lost, but the
        client's close-ok is still a fixed 12-byte frame: look for it, so a
        well-behaved client is released at once, not by the close timer."""
        window = self._scan_tail + data
        if _CLOSE_OK_FRAME in window:
            self.client_done = True
        self._scan_tail = window[-(len(_CLOSE_OK_FRAME) - 1) :]

    def _closing_from_client(self, buf: bytes, f: Frame) -> None:
        """After our connection.close: wait for the client's close-ok."""
        if f.type != amqp.FRAME_METHOD or f.channel != 0:
            return
        ids = amqp.method_id(buf, f)
        if ids == amqp.CONNECTION_CLOSE:  # both sides closed at once
            self._out.to_client.append(amqp.marshal_method(commands.Connection.CloseOk(), 0))
            self.client_done = True
        elif ids == amqp.CONNECTION_CLOSE_OK:
            self.client_done = True

    # ------------------------------------------------------------ broker side

    def _from_broker(self, buf: bytes, frames: list[Frame]) -> None:
        self._relay(
            buf,
            frames,
            self._out.to_client,
            self._broker_frame,
            self._closing_from_broker,
            self._broker_fault,
        )

    def _broker_fault(self, e: AMQPError) -> None:
        log.warning("connection %d: broker sent a bad frame: %s", self.connection_id, e)
        self._fail(amqp.AMQPError(f"broker protocol fault: {e.args[0]}"))

    def _broker_frame(self, buf: bytes, f: Frame) -> bytes | None:
        ch = self._channels.get(f.channel)
        if ch is not None and ch.closing:
            return self._closing_frame(f.channel, ch, buf, f, client=False)
        if f.type == amqp.FRAME_METHOD:
            ids = amqp.method_id(buf, f)
            handler = _BROKER_METHODS.get(ids)
            return handler(self, f.channel, buf, f) if handler is not None else None
        if f.type == amqp.FRAME_HEADER and ch is not None and ch.incoming is not None:
            return self._broker_content_header(ch, buf, f)
        return None

    def _broker_content_header(self, ch: _Channel, buf: bytes, f: Frame) -> bytes | None:
        """The content header of a message on its way to the client (deliver,
        get-ok, return): the delivery is mapped to its replication id, and
        our id header is cut out of it (unless the VPN exposes it), so the
        consumer sees the properties exactly as the publisher encoded them.
        The entry's bytes are spliced out; nothing else is re-encoded."""
        inc, ch.incoming = ch.incoming, None
        assert inc is not None  # noqa: S101 - caller checked
        payload = buf[f.payload_start : f.payload_end]
        try:
            layout = amqp.property_layout(payload)
        except AMQPError:
            return None  # not a header we made: the broker's to deliver as it is
        at = amqp.header_entry(payload, layout, REPLICATION_HEADER)
        if at is None:
            return None
        start, end = at
        found = id_in_header(payload[start + _ID_ENTRY_PREFIX : end])
        if found is None:
            return None  # a header of that name that is not one of ours
        repl_id, alone = found
        vpn = self.vpn
        if vpn is not None and inc.queue is not None and not inc.is_return:
            if inc.no_ack:
                self._out.events.append((Consumed(vpn.name, repl_id, inc.queue), None))
            else:
                ch.deliveries[inc.delivery_tag] = (repl_id, inc.queue)
                if inc.routing_key is not None:
                    ch.routing_keys[inc.delivery_tag] = inc.routing_key
        if not self._expose_id:
            payload = amqp.without_entry(payload, layout, start, end, drop_empty=alone)
        elif alone:  # published before the VPN exposed ids: show the plain id
            payload = payload[: end - _ID_SIZE] + _WIRE.pack(repl_id.wire) + payload[end:]
        else:
            return None
        return _header_frame(f.channel, payload)

    def _b_open_ok(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        self.open = True
        # Nothing on an unreplicated vhost concerns replication (settings apply
        # to connections opened after a change): from here on, frames are only
        # checked, and broker bytes are relayed without parsing.
        self.passthrough = not self.replicated
        return None

    def _b_close_ok(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        self.broker_done = True
        return None

    def _b_channel_close(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        # Unacked deliveries return to their queues, buffered tx events are
        # void, unconfirmed publishes will never be confirmed: forget them all
        # once the client has answered close-ok.
        ch = self._channel(channel)
        ch.closing = True
        # a refusal of the request the client's frames wait for: the broker
        # gets them as it would have (and discards them, the channel closing)
        self._release_held(ch)
        return None

    def _b_deliver(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        if not self.replicated:
            return None
        ch = self._channel(channel)
        consumer_tag, delivery_tag = amqp.decode_deliver(buf, f)
        consumer = ch.consumers.get(consumer_tag)
        if consumer is not None:
            queue, no_ack = consumer
            key = None if no_ack else self._routing_key_kept(queue, buf, f)
            ch.incoming = _Incoming(queue, delivery_tag, no_ack, routing_key=key)
        else:  # a consumer we do not know: its header is still ours to cut
            ch.incoming = _Incoming(None, delivery_tag, True)
        return None

    def _b_get_ok(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        if not self.replicated:
            return None
        ch = self._channel(channel)
        if ch.gets:
            queue, no_ack = ch.gets.popleft()
            key = None if no_ack else self._routing_key_kept(queue, buf, f)
            ch.incoming = _Incoming(queue, amqp.decode_get_ok(buf, f), no_ack, routing_key=key)
        else:
            ch.incoming = _Incoming(None, 0, True)
        return None

    def _b_get_empty(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        ch = self._channels.get(channel)
        if ch is not None and ch.gets:
            ch.gets.popleft()
        return None

    def _b_consume_ok(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        ch = self._channels.get(channel)
        if ch is not None and ch.consumes:
            m = amqp.decode_method(buf, f)
            assert isinstance(m, commands.Basic.ConsumeOk)  # noqa: S101
            ch.consumers[m.consumer_tag or ""] = ch.consumes.popleft()
        return None

    def _b_cancel(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        ch = self._channels.get(channel)
        if ch is not None and ch.consumers:
            m = amqp.decode_method(buf, f)
            ch.consumers.pop(getattr(m, "consumer_tag", ""), None)
        return None

    def _b_confirm(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        ch = self._channels.get(channel)
        if ch is None or not ch.pending:
            return None  # nothing replicated is waiting: relay as is
        tag, multiple, _ = amqp.decode_ack(buf, f)
        ok = buf[f.payload_start + 3] == 80
        pending = ch.pending
        changed: list[int] = []
        if multiple:
            for seq in ch.order:
                if seq > tag:
                    break
                entry = pending.get(seq)
                if entry is not None and entry.broker is None:
                    entry.broker = ok
                    changed.append(seq)
        elif tag in pending:
            pending[tag].broker = ok
            changed.append(tag)
        self._release_confirms(channel, ch, changed)
        return b""

    def _release_confirms(self, channel: int, ch: _Channel, changed: list[int]) -> None:
        """Send the client the confirms that became ready; see the invariants.

        ``changed`` are the sequence numbers whose state just changed. Ready
        entries at the front are released as runs of ``multiple`` frames
        (every lower tag is released already); a changed entry that is ready
        behind a held one is released alone.
        """
        out = self._out.to_client
        pending, order = ch.pending, ch.order
        run_seq, run_ok, run_len = 0, True, 0
        while order:
            seq = order[0]
            entry = pending.get(seq)
            if entry is None:  # released earlier, behind a held one
                order.popleft()
                continue
            if not entry.ready:
                break
            ok = entry.ok
            if entry.broker is False and entry.event is not None:
                self._take_back(entry.event)
            if run_len and ok != run_ok:
                out.append(_confirm_frame(channel, run_seq, run_ok, multiple=run_len > 1))
                run_len = 0
            run_seq, run_ok, run_len = seq, ok, run_len + 1
            del pending[seq]
            order.popleft()
        if run_len:
            out.append(_confirm_frame(channel, run_seq, run_ok, multiple=run_len > 1))
        for seq in changed:
            entry = pending.get(seq)
            if entry is not None and entry.ready:
                if entry.broker is False and entry.event is not None:
                    self._take_back(entry.event)
                out.append(_confirm_frame(channel, seq, entry.ok, multiple=False))
                del pending[seq]

    def _take_back(self, event: Published) -> None:
        """The broker refused a publish the sink already has: replicate its
        removal, so both sites hold what the broker holds."""
        for queue in event.queues:
            self._out.events.append((Consumed(event.vpn, event.repl_id, queue), None))

    def _b_tx_commit_ok(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        ch = self._channels.get(channel)
        if ch is None or ch.tx_committing is None:
            return None
        txn, ch.tx_committing = ch.tx_committing, None
        self._out.commit.append(txn)
        return b""  # held until the sink has committed

    def _b_topology_ok(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        ch = self._channels.get(channel)
        if ch is None or not ch.topology_ops:
            return None
        op, ours = ch.topology_ops.popleft()
        ok = None
        if amqp.method_id(buf, f) == amqp.QUEUE_DECLARE_OK:
            ok = amqp.decode_method(buf, f)
            ch.last_queue = getattr(ok, "queue", "")  # passive declares count too
        if op is not None:
            self._apply_topology(op, ok)
        if not ours:
            return None
        self._release_held(ch)
        return b""  # the client sent it nowait: it expects no answer

    def _b_deliver_return(self, channel: int, buf: bytes, f: Frame) -> bytes | None:
        if self.replicated:
            ch = self._channel(channel)
            ch.incoming = _Incoming(None, 0, True, is_return=True)
        return None

    def _closing_from_broker(self, buf: bytes, f: Frame) -> None:
        """After our connection.close: wait for the broker's close-ok."""
        if f.type != amqp.FRAME_METHOD or f.channel != 0:
            return
        ids = amqp.method_id(buf, f)
        if ids == amqp.CONNECTION_CLOSE:
            self._out.to_broker.append(amqp.marshal_method(commands.Connection.CloseOk(), 0))
            self.broker_done = True
        elif ids == amqp.CONNECTION_CLOSE_OK:
            self.broker_done = True

    # ------------------------------------------------------------ failure

    def _fail(self, error: AMQPError) -> None:
        """Close the client connection with ``error``'s reply code and text;
        close the upstream connection cleanly (or drop it mid-handshake)."""
        if self.closing and self._closed_by_us:
            return
        log.warning(
            "connection %d: closing client connection: %d %s",
            self.connection_id,
            error.reply_code,
            error.reply_text,
        )
        self._out.to_client.append(
            amqp.marshal_method(
                commands.Connection.Close(
                    reply_code=error.reply_code,
                    reply_text=error.reply_text,
                    class_id=error.method[0],
                    method_id=error.method[1],
                ),
                0,
            )
        )
        self.closing = True
        self._closed_by_us = True
        self.fault_code = error.reply_code
        if not self.open:
            self._out.drop_broker = True
            self.broker_done = True
        elif not self._client_close_upstream:  # else its close-ok ends the upstream
            self._out.to_broker.append(
                amqp.marshal_method(
                    commands.Connection.Close(
                        reply_code=200,
                        reply_text="client connection closed by vpnrepl",
                        class_id=0,
                        method_id=0,
                    ),
                    0,
                )
            )


_CLOSE_OK_FRAME = amqp.frame_bytes(amqp.FRAME_METHOD, 0, b"\x00\x0a\x00\x33")


_new_tuple = tuple.__new__

#: a whole-publish step of :meth:`Session._relay`: the header frame's
#: replacement (None: relay the three frames as they are) or ``DECLINED``
_Fused = Callable[[bytes, Frame, Frame, Frame], "bytes | None | _Declined"]


def _with_id(
    template: _HeaderTemplate, payload: bytes, channel: int, wire: bytes
) -> tuple[bytes, bytes]:
    """The properties with an id in our header (``wire``: its int64 header
    value, 8 bytes), and the content header frame carrying them (class,
    weight and body size as the client sent)."""
    properties = template.before_id + wire + template.after_id
    header = b"".join(
        (
            _HEADER_FRAME_HEAD.pack(amqp.FRAME_HEADER, channel, 12 + len(properties)),
            payload[:12],
            properties,
            b"\xce",
        )
    )
    return properties, header


def _header_frame(channel: int, payload: bytes) -> bytes:
    """A content header frame around ``payload`` (class, weight, body size
    and properties)."""
    return b"".join(
        (_HEADER_FRAME_HEAD.pack(amqp.FRAME_HEADER, channel, len(payload)), payload, b"\xce")
    )


def _forget_tx_acks(ch: _Channel) -> None:
    """The transaction's acks are committed: their deliveries are settled."""
    for tag in ch.tx_acked:
        ch.routing_keys.pop(tag, None)
    ch.tx_acked.clear()


#: the queue, in every replicated vhost, that holds commit markers


def commit_marker(channel: int, txid: str) -> bytes:
    """A persistent publish of ``txid`` to :data:`MARKER_QUEUE`: method,
    content header and body frames."""
    body = txid.encode()
    return b"".join(
        (
            amqp.marshal_method(
                commands.Basic.Publish(exchange="", routing_key=MARKER_QUEUE), channel
            ),
            frame.marshal(
                header.ContentHeader(
                    body_size=len(body),
                    properties=commands.Basic.Properties(delivery_mode=2),
                ),
                channel,
            ),
            frame.marshal(ContentBody(body), channel),
        )
    )


def _behind_frame(
    out: list[bytes], mark: int, buf: bytes, run: int, f: Frame, replacement: bytes | None
) -> int:
    """A handler of frame ``f`` added frames of its own to ``out`` (from
    ``mark`` on: confirms it released), or failed: put them behind ``f`` (or
    its replacement; b"" drops it), and so behind every untouched frame
    before it, which ``_relay`` had not written yet. Returns where the next
    untouched run starts."""
    made = out[mark:]
    del out[mark:]
    if f.start > run:
        out.append(buf[run : f.start])
    if replacement is None:
        out.append(buf[f.start : f.end])
    elif replacement:
        out.append(replacement)
    out.extend(made)
    return f.end


def _relay_rest(buf: bytes, run: int, end: int, out: list[bytes]) -> None:
    """Relay ``buf[run:end]``, the untouched frames after the last handled one."""
    if run == 0 and end == len(buf):
        out.append(buf)
    elif end > run:
        out.append(buf[run:end])


def _confirm_frame(channel: int, tag: int, ok: bool, multiple: bool) -> bytes:
    if ok:
        return amqp.encode_ack(channel, tag, multiple)
    return amqp.encode_nack(channel, tag, multiple)


# topology operations: each takes (vpn, ok-method or None, session)


def _topology_op(m: base.Frame) -> Callable[[Any], None] | None:
    if isinstance(m, commands.Exchange.Declare):
        if m.passive:
            return None
        return lambda a: a[0].topology.declare_exchange(
            m.exchange,
            m.exchange_type,
            dict(m.arguments or {}),
            internal=m.internal,
            auto_delete=m.auto_delete,
        )
    if isinstance(m, commands.Exchange.Delete):
        return lambda a: a[0].topology.delete_exchange(m.exchange)
    if isinstance(m, commands.Exchange.Bind):
        return lambda a: a[0].topology.bind_exchange(
            m.destination, m.source, m.routing_key, dict(m.arguments or {})
        )
    if isinstance(m, commands.Exchange.Unbind):
        return lambda a: a[0].topology.unbind_exchange(
            m.destination, m.source, m.routing_key, dict(m.arguments or {})
        )
    if isinstance(m, commands.Queue.Declare):
        if m.passive:
            return None
        return lambda a: _declare_queue(a, m)
    if isinstance(m, commands.Queue.Delete):
        return lambda a: _delete_queue(a, m.queue)
    if isinstance(m, commands.Queue.Purge):
        return lambda a: a[2]._emptied(m.queue, deleted=False)
    if isinstance(m, commands.Queue.Bind):
        return lambda a: a[0].topology.bind_queue(
            m.queue, m.exchange, m.routing_key, dict(m.arguments or {})
        )
    if isinstance(m, commands.Queue.Unbind):
        return lambda a: a[0].topology.unbind_queue(
            m.queue, m.exchange, m.routing_key, dict(m.arguments or {})
        )
    return None


def _declare_queue(a: tuple[VpnView, Any, Session], m: commands.Queue.Declare) -> None:
    """With ``ok`` None (nowait) the broker's answer is unknown: an exclusive
    declare of a queue that exists and is not this connection's own is
    refused (405), so such a queue is not counted as the connection's (its
    end would delete a live queue, on both sites)."""
    vpn, ok, session = a
    name = ok.queue if ok is not None else m.queue
    refused = ok is None and name in vpn.topology.queues
    vpn.topology.declare_queue(name, dict(m.arguments or {}))
    if m.exclusive and not refused and name not in session._exclusive_queues:
        session._exclusive_queues.append(name)


#: nowait requests the broker may refuse, with a change the standby cannot undo
_REFUSABLE = (commands.Queue.Delete, commands.Queue.Purge, commands.Exchange.Delete)

#: methods whose empty queue name means the channel's last declared queue
_NAMES_A_QUEUE = (
    commands.Queue.Bind,
    commands.Queue.Unbind,
    commands.Queue.Purge,
    commands.Queue.Delete,
)


def _delete_queue(a: tuple[VpnView, Any, Session], name: str) -> None:
    vpn, _, session = a
    vpn.topology.delete_queue(name)
    session._emptied(name, deleted=True)


_CLIENT_METHODS: dict[tuple[int, int], _Handler] = {
    amqp.CONNECTION_START_OK: Session._c_start_ok,
    amqp.CONNECTION_TUNE_OK: Session._c_tune_ok,
    amqp.CONNECTION_OPEN: Session._c_open,
    amqp.CONNECTION_CLOSE: Session._c_close,
    amqp.CONNECTION_CLOSE_OK: Session._c_close_ok,
    amqp.CHANNEL_OPEN: Session._c_channel_open,
    amqp.CHANNEL_CLOSE: Session._c_channel_close,
    amqp.BASIC_PUBLISH: Session._c_publish,
    amqp.BASIC_ACK: Session._c_ack,
    amqp.BASIC_NACK: Session._c_ack,
    amqp.BASIC_REJECT: Session._c_ack,
    amqp.BASIC_CONSUME: Session._c_consume,
    amqp.BASIC_CANCEL: Session._c_cancel,
    amqp.BASIC_GET: Session._c_get,
    amqp.BASIC_RECOVER: Session._c_recover,
    amqp.BASIC_RECOVER_ASYNC: Session._c_recover,
    amqp.CONFIRM_SELECT: Session._c_confirm_select,
    amqp.TX_SELECT: Session._c_tx_select,
    amqp.TX_COMMIT: Session._c_tx_commit,
    amqp.TX_ROLLBACK: Session._c_tx_rollback,
    amqp.EXCHANGE_DECLARE: Session._topology,
    amqp.EXCHANGE_DELETE: Session._topology,
    amqp.EXCHANGE_BIND: Session._topology,
    amqp.EXCHANGE_UNBIND: Session._topology,
    amqp.QUEUE_DECLARE: Session._topology,
    amqp.QUEUE_DELETE: Session._topology,
    amqp.QUEUE_PURGE: Session._topology,
    amqp.QUEUE_BIND: Session._topology,
    amqp.QUEUE_UNBIND: Session._topology,
}

_BROKER_METHODS: dict[tuple[int, int], _Handler] = {
    amqp.CONNECTION_OPEN_OK: Session._b_open_ok,
    amqp.CONNECTION_CLOSE: Session._close_started,
    amqp.CONNECTION_CLOSE_OK: Session._b_close_ok,
    amqp.CHANNEL_CLOSE: Session._b_channel_close,
    amqp.BASIC_DELIVER: Session._b_deliver,
    amqp.BASIC_GET_OK: Session._b_get_ok,
    amqp.BASIC_GET_EMPTY: Session._b_get_empty,
    amqp.BASIC_CONSUME_OK: Session._b_consume_ok,
    amqp.BASIC_CANCEL: Session._b_cancel,
    amqp.BASIC_CANCEL_OK: Session._b_cancel,
    amqp.BASIC_ACK: Session._b_confirm,
    amqp.BASIC_NACK: Session._b_confirm,
    amqp.BASIC_RETURN: Session._b_deliver_return,
    amqp.TX_COMMIT_OK: Session._b_tx_commit_ok,
    amqp.EXCHANGE_DECLARE_OK: Session._b_topology_ok,
    amqp.EXCHANGE_DELETE_OK: Session._b_topology_ok,
    amqp.EXCHANGE_BIND_OK: Session._b_topology_ok,
    amqp.EXCHANGE_UNBIND_OK: Session._b_topology_ok,
    amqp.QUEUE_DECLARE_OK: Session._b_topology_ok,
    amqp.QUEUE_DELETE_OK: Session._b_topology_ok,
    amqp.QUEUE_PURGE_OK: Session._b_topology_ok,
    amqp.QUEUE_BIND_OK: Session._b_topology_ok,
    amqp.QUEUE_UNBIND_OK: Session._b_topology_ok,
}


class BrokerUnavailable:
    """Refuse a client cleanly when the broker cannot be reached.

    A client expects ``connection.start`` after its protocol header; closing
    the socket instead looks like a network fault, and some clients retry at
    once. So the listener plays the server's first step, and answers the
    client's ``start-ok`` with ``connection.close`` 320 naming the reason.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self._header = b""
        self._splitter = FrameSplitter(HANDSHAKE_FRAME_MAX)
        self.done = False

    def client_data(self, data: bytes) -> list[bytes]:
        out: list[bytes] = []
        if self.done:
            return out
        if len(self._header) < 8:
            need = 8 - len(self._header)
            self._header += data[:need]
            data = data[need:]
            if len(self._header) < 8:
                return out
            if self._header != amqp.PROTOCOL_HEADER:
                self.done = True
                return [amqp.PROTOCOL_HEADER]
            start = commands.Connection.Start(
                server_properties={"product": "vpnrepl"},
                mechanisms="PLAIN AMQPLAIN",
                locales="en_US",
            )
            out.append(amqp.marshal_method(start, 0))
        buf, frames, fault = self._splitter.feed(data)
        if fault is not None:
            self.done = True
            return out
        for f in frames:
            if f.type == amqp.FRAME_METHOD and f.channel == 0:
                try:
                    ids = amqp.method_id(buf, f)
                except AMQPError:
                    ids = (0, 0)
                if ids == amqp.CONNECTION_CLOSE_OK:
                    self.done = True
                elif ids in ((10, 11), amqp.CONNECTION_CLOSE):  # start-ok, or the client gives up
                    error = amqp.ConnectionForced(f"broker unavailable: {self.reason}")
                    close = commands.Connection.Close(
                        reply_code=error.reply_code,
                        reply_text=error.reply_text,
                        class_id=0,
                        method_id=0,
                    )
                    out.append(amqp.marshal_method(close, 0))
        return out
