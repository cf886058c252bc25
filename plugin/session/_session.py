"""One client connection through the listener, as a sans-IO state machine.

``Session`` is fed the bytes each side sent and returns what to send on and
the replication events it saw (an :class:`~plugin.session._actions.Output`);
``plugin.listener`` drives it. It splits both byte streams into frames,
relays them, keeps its channels' open and close handshakes and hands every
other channel method to that :class:`~plugin.session._channel.Channel`; the
connection's own methods are
:class:`~plugin.session._connection.ConnectionMethods`.

Invariants: the client's channel numbering is never disturbed — the session
injects no frame that would move confirm sequence numbers or delivery tags,
only replies in place of a held frame or a refusing close; and frames reach
each side in the order they came, ours behind every frame read before
(:meth:`Session._relay`), never inside one (``FrameSplitter.pass_over``;
docs/behaviour.md, "Frames reach the client in the order the broker sent them").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from pamqp import commands

from bridge import ConfirmKey, IdSource, ReplicationId, amqp
from bridge.amqp import AMQPError, FrameSpan, FrameSplitter, Method
from plugin.topology import VpnDirectory
from txn import MarkerKey

from ._actions import Output
from ._channel import Channel, ChannelContext
from ._checks import FrameChecks
from ._connection import ConnectionMethods
from ._fused import DECLINED, PUBLISH_IDS, Declined, FusedCheck, FusedPublish
from ._lifecycle import (
    BROKER_READS,
    CLIENT_READS,
    CLOSING,
    WE_CLOSED,
    BrokerReads,
    ClientReads,
    Lifecycle,
    Trigger,
)
from ._refusal import HANDSHAKE_FRAME_MAX
from ._topology_changes import OK_METHODS, REQUEST_METHODS, TopologyRequests

__all__ = ["Output", "Session"]

log = logging.getLogger(__name__)

# the reading modes, as module constants (compared once per read)
_HEADER, _CHECKED = ClientReads.HEADER, ClientReads.CHECKED
_SCAN, _CLIENT_NOTHING = ClientReads.SCAN, ClientReads.NOTHING
_RAW, _BROKER_NOTHING = BrokerReads.RAW, BrokerReads.NOTHING

_Handler = Callable[["Session", int, bytes, FrameSpan], bytes | None]
_OnChannel = Callable[[Channel, bytes, FrameSpan], bytes | None]
#: a whole-publish step of :meth:`Session._relay` (see ``plugin.session._fused``)
_Fused = Callable[[bytes, FrameSpan, FrameSpan, FrameSpan], "bytes | None | Declined"]


class Session(ConnectionMethods):
    """The AMQP 0-9-1 state of one proxied client connection."""

    _ids_counter = 0

    def __init__(
        self,
        directory: VpnDirectory,
        ids: IdSource,
        peers: Callable[[], Iterable[Session]] | None = None,
        marker_key: MarkerKey | None = None,
    ) -> None:
        """``peers``: every session of the listener (this one included), for
        the deliveries a purge leaves in its queue; without it, only this
        session's are known. ``marker_key``: the site's, which tags the
        commit markers (without it, a key of this session alone)."""
        Session._ids_counter += 1
        self.connection_id = Session._ids_counter
        self._directory = directory
        self._peers = peers
        self._state = Lifecycle.AWAITING_HEADER
        self._client = FrameSplitter(HANDSHAKE_FRAME_MAX)
        #: the broker's frame_max (its connection.tune): the client's bound
        self._broker_frame_max = 0
        self._broker = FrameSplitter(0)
        #: our frames for the client while passthrough has relayed only the
        #: start of a broker frame to it: they go once that frame is whole
        self._behind_raw_frame: list[bytes] = []
        self._ctx = ChannelContext(
            ids, self.connection_id, self._channel_closed, marker_key or MarkerKey.new()
        )
        self._channels: dict[int, Channel] = {}
        self.vhost: str | None = None
        #: the broker user the client logs in as (from its start-ok)
        self.user: str | None = None
        #: reply code of the fault that made us close the client, if any
        self.fault_code: int | None = None
        self._client_header_buf = b""
        #: the end of the last read while desynced (a close-ok may span reads)
        self._scan_tail = b""
        self._checks = FrameChecks(self._client_closed_in_passthrough)
        self._fused_check = FusedCheck(self._checks.content)
        #: set at connection.open on a replicated vhost
        self._fused: FusedPublish | None = None
        self._topology = TopologyRequests(self._ctx, self._unsettled, self._release_held)

    # ------------------------------------------------------------ feeding

    def client_data(self, data: bytes) -> Output:
        """Bytes from the client; returns what to forward and what happened."""
        out = self._begin()
        reads = CLIENT_READS[self._state]
        if reads is _CLIENT_NOTHING:
            return out
        if reads is _SCAN:
            self._find_close_ok(data)
            return out
        try:
            if reads is _HEADER:
                data = self._protocol_header(data)
                if not data:
                    return out
            buf, frames, fault = self._client.feed(data)
            self._from_client(buf, frames)
            if fault is not None and self._state not in WE_CLOSED:
                self._fail(fault, Trigger.FRAMING_FAULT)
        except AMQPError as e:
            self._fail(e)
        return out

    def broker_data(self, data: bytes) -> Output:
        """Bytes from the broker; returns what to forward and what happened."""
        out = self._begin()
        reads = BROKER_READS[self._state]
        broker = self._broker
        if reads is _RAW:
            if broker.pending:  # a frame begun before open-ok, not relayed yet
                data = broker.take_tail() + data
            broker.pass_over(data)  # where frames end, for when passthrough ends
            out.to_client.append(data)
            return out
        if reads is _BROKER_NOTHING:
            return out
        if broker.in_frame:
            data = self._finish_raw_frame(data)
            if not data:
                return out
        buf, frames, fault = broker.feed(data)
        self._from_broker(buf, frames)
        if fault is not None and self._state not in WE_CLOSED:
            self._broker_fault(fault)
        return out

    def replicated_done(self, done: list[tuple[ConfirmKey, bool]]) -> Output:
        """The sink's verdicts ``((channel, seq), ok)`` on replicated publishes."""
        out = self._begin()
        if self._state in CLOSING:
            return out
        touched: dict[int, list[int]] = {}
        channels = self._channels
        for (channel, seq), ok in done:
            ch = channels.get(channel)
            confirms = ch.confirms if ch is not None else None
            if confirms is not None and confirms.sink_answered(seq, ok):
                touched.setdefault(channel, []).append(seq)
        for channel, seqs in touched.items():
            confirms = channels[channel].confirms
            assert confirms is not None  # noqa: S101 - touched above
            confirms.release(seqs, out.to_client, out.events)
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
        out = self._begin()
        ch = self._channels.get(channel)
        answered = ch.prepared() if ch is not None else None
        if ch is None or answered is None:
            return out
        txn, held = answered
        if refused is not None:
            text = f"transaction not committed: {refused}"
            self._close_channel(ch, amqp.PreconditionFailed.reply_code, text)
            return out
        if ch.closing or self._state in CLOSING:
            out.abort.append(txn)  # the client is gone: the broker rolls back
            return out
        out.to_broker.append(ch.commit(txn, held))
        return out

    def transaction_committed(self, channel: int) -> Output:
        """The sink committed the transaction: release ``tx.commit-ok``."""
        out = self._begin()
        if channel in self._channels and self._state not in CLOSING:
            out.to_client.append(amqp.marshal_method(commands.Tx.CommitOk(), channel))
        return out

    def xa_channel(self, channel: int) -> Channel | None:
        """Channel ``channel`` if it is open (an XA branch's work is on it)."""
        ch = self._channels.get(channel)
        if ch is None or ch.closing or self._state in CLOSING:
            return None
        return ch

    def refuse_channel(self, ch: Channel, code: int, text: str) -> Output:
        """Close ``ch`` on both sides with ``code`` and ``text``."""
        out = self._begin()
        if not ch.closing:
            self._close_channel(ch, code, text)
        return out

    def owns_queue(self, queue: str) -> bool:
        """``queue`` is an exclusive queue this connection declared (where
        the node may send it XA answers)."""
        return queue in self._topology.exclusive_queues

    def connection_lost(self, broker_died: bool = False) -> Output:
        """Either side went away: exclusive queues of this connection are
        gone; a transaction whose tx.commit reached the broker without its
        commit-ok coming back is left to the marker (``unresolved``), one
        still being prepared is aborted. ``broker_died``: the broker's side
        ended without a close: replicated publishes it had not confirmed
        are ``uncertain``."""
        out = self._begin()
        self._topology.connection_lost()
        for ch in self._channels.values():
            if broker_died and ch.confirms is not None:
                out.uncertain.extend(ch.confirms.unanswered())
            ch.gone()
        self._channels.clear()
        self._advance(Trigger.LOST)
        return out

    # ------------------------------------------------------------ relaying

    def _from_client(self, buf: bytes, frames: list[FrameSpan]) -> None:
        if CLIENT_READS[self._state] is _CHECKED:
            handle: Callable[[bytes, FrameSpan], bytes | None] = self._checks.check
        else:
            handle = self._client_frame
        fused = self._fused.whole if self._fused is not None else self._fused_check.whole
        self._relay(
            buf, frames, self._out.to_broker, handle, self._closing_from_client, self._fail, fused
        )

    def _from_broker(self, buf: bytes, frames: list[FrameSpan]) -> None:
        self._relay(
            buf,
            frames,
            self._out.to_client,
            self._broker_frame,
            self._closing_from_broker,
            self._broker_fault,
        )

    def _relay(
        self,
        buf: bytes,
        frames: list[FrameSpan],
        out: list[bytes],
        handle: Callable[[bytes, FrameSpan], bytes | None],
        closing: Callable[[bytes, FrameSpan], None],
        fail: Callable[[AMQPError], None],
        fused: _Fused | None = None,
    ) -> None:
        """Relay ``frames`` of ``buf`` into ``out``: untouched runs as slices of
        the original bytes, a frame ``handle`` replaced by what it returned
        (b"" drops it). Frames before a fault are still relayed; once we have
        closed the connection, frames only go to ``closing``.

        Order is kept: what a handler itself adds to ``out`` (a released
        confirm, our close) goes after every frame that came before the one
        it handled, never ahead of them.

        With ``fused`` (client frames), a ``basic.publish`` whose header and
        single body frame follow in the same read is handled in one step; it
        declines anything unusual, and those frames then go one by one
        through ``handle``, which reports faults at the exact frame. Only a
        handler can close the connection (the fused step never does), so
        the state is looked at again only after one ran.
        """
        run = 0  # start of the untouched run of frames to relay
        i, n = 0, len(frames)
        we_closed = self._state in WE_CLOSED
        while i < n:
            f = frames[i]
            i += 1
            if we_closed:
                closing(buf, f)
                continue
            replacement: bytes | None | Declined = DECLINED
            if fused is not None and i + 1 < n and buf[f.start + 7 : f.start + 11] == PUBLISH_IDS:
                replacement = fused(buf, f, frames[i], frames[i + 1])
                if replacement is not DECLINED:
                    f = frames[i]  # the header frame is the one replaced
                    i += 2
            if replacement is DECLINED:
                mark = len(out)
                try:
                    replacement = handle(buf, f)
                except AMQPError as e:
                    run = _behind_frame(out, mark, buf, run, f, b"")  # f is not relayed
                    fail(e)
                    we_closed = self._state in WE_CLOSED
                    continue
                we_closed = self._state in WE_CLOSED
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
        if frames and not we_closed:
            _relay_rest(buf, run, frames[-1].end, out)

    def _reopen(self, held: bytes) -> None:
        """Relay client frames held back, now, as if they came now: those on
        a channel number the client reused before the broker closed the old
        channel (``reopening``), or those that waited for the broker's answer
        to a nowait request made synchronous (:meth:`_release_held`)."""
        buf, frames, _ = FrameSplitter(0).feed(held)  # whole frames: no fault
        self._from_client(buf, frames)

    def _release_held(self, ch: Channel) -> None:
        """The broker answered the request the client's frames waited for
        (or is closing the channel): relay them now, as if they came now."""
        held = ch.release_held()
        if held:
            self._reopen(held)

    # ------------------------------------------------------------ channels

    def _channel(self, channel: int) -> Channel:
        ch = self._channels.get(channel)
        if ch is None:
            ch = self._channels[channel] = Channel(channel, self._ctx)
        return ch

    def _c_channel_open(self, channel: int, buf: bytes, f: FrameSpan) -> bytes | None:
        self._channels[channel] = Channel(channel, self._ctx)
        return None

    def _c_channel_close(self, channel: int, buf: bytes, f: FrameSpan) -> bytes | None:
        # The channel's unacked deliveries return to their queues: no event.
        self._channel(channel).closing = True
        return None

    def _b_channel_close(self, channel: int, buf: bytes, f: FrameSpan) -> bytes | None:
        # Unacked deliveries return to their queues, buffered tx events are
        # void, unconfirmed publishes will never be confirmed: forget them all
        # once the client has answered close-ok.
        ch = self._channel(channel)
        ch.closing = True
        # a refusal of the request the client's frames wait for: the broker
        # gets them as it would have (and discards them, the channel closing)
        self._release_held(ch)
        return None

    def _close_channel(self, ch: Channel, code: int, text: str) -> None:
        """Close ``ch`` on both sides (a channel exception of ours); both
        close-oks are swallowed when they come."""
        log.warning(
            "connection %d: closing channel %d: %d %s", self.connection_id, ch.number, code, text
        )
        ch.close_both_sides(code, text)
        self._release_held(ch)  # into the close handshake, as if they came now

    def _channel_closed(self, ch: Channel, reopening: bytes) -> None:
        """``ch``'s close handshake is over: its number is free, and what the
        client sent on it meanwhile (a reopening) goes now."""
        del self._channels[ch.number]
        if reopening:
            self._reopen(reopening)

    def _client_frame(self, buf: bytes, f: FrameSpan) -> bytes | None:  # noqa: C901 - one call per frame
        """Handle one client frame: None relays it, bytes replace it (b"" drops)."""
        ch = self._channels.get(f.channel)
        if ch is not None and ch.held is not None:
            ch.held.append(buf[f.start : f.end])
            return b""
        if ch is not None and ch.closing:
            # The broker discards what a closing channel still carries.
            return ch.on_closing_frame(buf, f, client=True)
        if f.type == amqp.FRAME_METHOD:
            if ch is not None and ch.publish is not None:
                raise amqp.FrameOutOfOrder(
                    f"method frame on channel {f.channel} while content was expected"
                )
            ids = amqp.method_id(buf, f)
            on_channel = _CHANNEL_METHODS.get(ids)
            if on_channel is not None:
                if ch is None:
                    if ids in _CONSUMING and not self._ctx.replicating:
                        return None  # nothing to track on this vhost
                    ch = self._channel(f.channel)
                return on_channel(ch, buf, f)
            handler = _CLIENT_METHODS.get(ids)
            return handler(self, f.channel, buf, f) if handler is not None else None
        if f.type == amqp.FRAME_BODY:
            if ch is None:
                raise amqp.FrameOutOfOrder(f"content body on channel {f.channel} without a header")
            return ch.on_body(buf, f)
        if f.type == amqp.FRAME_HEADER:
            if ch is None:
                raise amqp.FrameOutOfOrder(
                    f"content header on channel {f.channel} without a publish"
                )
            return ch.on_content_header(buf, f)
        if f.channel != 0:
            raise amqp.FrameError(f"heartbeat frame on channel {f.channel}")
        return None

    def _broker_frame(self, buf: bytes, f: FrameSpan) -> bytes | None:
        ch = self._channels.get(f.channel)
        if ch is not None and ch.closing:
            return ch.on_closing_frame(buf, f, client=False)
        if f.type == amqp.FRAME_METHOD:
            ids = amqp.method_id(buf, f)
            on_channel = _BROKER_CHANNEL_METHODS.get(ids)
            if on_channel is not None:
                if ch is None:
                    # deliveries name a channel the client opened: remember it
                    if ids not in _DELIVERIES or not self._ctx.replicating:
                        return None
                    ch = self._channel(f.channel)
                return on_channel(ch, buf, f)
            handler = _BROKER_METHODS.get(ids)
            return handler(self, f.channel, buf, f) if handler is not None else None
        if f.type == amqp.FRAME_HEADER and ch is not None and ch.incoming is not None:
            return ch.on_delivered_header(buf, f)
        return None

    # topology: applied when the broker says -ok (or at once with nowait)

    def _c_topology(self, channel: int, buf: bytes, f: FrameSpan) -> bytes | None:
        if not self._ctx.replicating:
            return None
        return self._topology.request(self._channel(channel), buf, f)

    def _b_topology_ok(self, channel: int, buf: bytes, f: FrameSpan) -> bytes | None:
        ch = self._channels.get(channel)
        return self._topology.answered(ch, buf, f) if ch is not None else None

    def _unsettled(self, vpn: str, queue: str) -> tuple[ReplicationId, ...]:
        """Ids of ``queue``'s messages delivered on this listener's
        connections to ``vpn`` and not settled yet (acks inside an open
        transaction included: the broker holds those until the commit)."""
        found: set[ReplicationId] = set()
        for session in self._peers() if self._peers is not None else (self,):
            if session.vpn is None or session.vpn.name != vpn:
                continue
            for ch in session._channels.values():
                found.update(ch.unsettled(queue))
        return tuple(sorted(found, key=lambda r: r.value))


def _behind_frame(
    out: list[bytes], mark: int, buf: bytes, run: int, f: FrameSpan, replacement: bytes | None
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


#: the connection's own methods, and a channel's open and close
_CLIENT_METHODS: dict[tuple[int, int], _Handler] = {
    Method.CONNECTION_START_OK: Session._c_start_ok,
    Method.CONNECTION_TUNE_OK: Session._c_tune_ok,
    Method.CONNECTION_OPEN: Session._c_open,
    Method.CONNECTION_CLOSE: Session._c_close,
    Method.CONNECTION_CLOSE_OK: Session._c_close_ok,
    Method.CHANNEL_OPEN: Session._c_channel_open,
    Method.CHANNEL_CLOSE: Session._c_channel_close,
    **dict.fromkeys(REQUEST_METHODS, Session._c_topology),
}

#: a client's methods on a channel, handled by it (made if need be); a
#: basic.cancel is not among them: the consumer is forgotten on cancel-ok,
#: and its deliveries may still be acked
_CHANNEL_METHODS: dict[tuple[int, int], _OnChannel] = {
    Method.BASIC_PUBLISH: Channel.on_publish,
    Method.BASIC_ACK: Channel.on_ack,
    Method.BASIC_NACK: Channel.on_ack,
    Method.BASIC_REJECT: Channel.on_ack,
    Method.BASIC_CONSUME: Channel.on_consume,
    Method.BASIC_GET: Channel.on_get,
    Method.BASIC_RECOVER: Channel.on_recover,
    Method.BASIC_RECOVER_ASYNC: Channel.on_recover,
    Method.CONFIRM_SELECT: Channel.on_confirm_select,
    Method.TX_SELECT: Channel.on_tx_select,
    Method.TX_COMMIT: Channel.on_tx_commit,
    Method.TX_ROLLBACK: Channel.on_tx_rollback,
}

_BROKER_METHODS: dict[tuple[int, int], _Handler] = {
    Method.CONNECTION_TUNE: Session._b_tune,
    Method.CONNECTION_OPEN_OK: Session._b_open_ok,
    Method.CONNECTION_CLOSE: Session._b_close,
    Method.CONNECTION_CLOSE_OK: Session._b_close_ok,
    Method.CHANNEL_CLOSE: Session._b_channel_close,
    **dict.fromkeys(OK_METHODS, Session._b_topology_ok),
}

#: the broker's methods on a channel the client opened, handled by it
_BROKER_CHANNEL_METHODS: dict[tuple[int, int], _OnChannel] = {
    Method.BASIC_DELIVER: Channel.on_deliver,
    Method.BASIC_GET_OK: Channel.on_get_ok,
    Method.BASIC_GET_EMPTY: Channel.on_get_empty,
    Method.BASIC_CONSUME_OK: Channel.on_consume_ok,
    Method.BASIC_CANCEL: Channel.on_cancel,
    Method.BASIC_CANCEL_OK: Channel.on_cancel,
    Method.BASIC_ACK: Channel.on_confirm,
    Method.BASIC_NACK: Channel.on_confirm,
    Method.BASIC_RETURN: Channel.on_return,
    Method.TX_COMMIT_OK: Channel.on_tx_commit_ok,
    Method.TX_ROLLBACK_OK: Channel.on_tx_rollback_ok,
}
#: requests for messages, tracked only on a replicated vhost
_CONSUMING = frozenset({Method.BASIC_CONSUME, Method.BASIC_GET})
#: messages for the client, whose content header carries our id to cut
_DELIVERIES = frozenset({Method.BASIC_DELIVER, Method.BASIC_GET_OK, Method.BASIC_RETURN})
