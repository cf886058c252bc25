"""The client connection's own methods and lifecycle, a part of the session.

:class:`ConnectionMethods` handles the protocol header and the
``connection`` methods of either side, moves the lifecycle
(``plugin.session._lifecycle``) and makes our close at a fault or a
shutdown; the attributes declared below are the session's, made in
``Session.__init__``. Invariants: the client is closed once, with the
fault's reply code (every close of ours goes through
:meth:`ConnectionMethods._fail`, a no-op once we closed, and behind any
broker frame left half relayed); the client's frame_max is clamped to the
broker's (a client's 0, "no limit", would make the listener buffer any
frame); and no login the listener cannot pass on (EXTERNAL) reaches the broker.
"""

from __future__ import annotations

import logging

from pamqp import commands

from bridge import amqp
from bridge.amqp import AMQPError, FrameSpan, FrameSplitter, Method
from plugin.topology import VpnDirectory, VpnView

from ._actions import Output
from ._channel import Channel, ChannelContext
from ._fused import FusedPublish
from ._lifecycle import (
    BROKER_DONE,
    CLIENT_DONE,
    CLIENT_READS,
    CLOSING,
    UPSTREAM_ON_FAULT,
    WE_CLOSED,
    ClientReads,
    Lifecycle,
    Trigger,
    Upstream,
    advance,
)
from ._publish import HeaderTemplates
from ._refusal import HANDSHAKE_FRAME_MAX

__all__ = ["ConnectionMethods"]

log = logging.getLogger(__name__)

_CLOSE_OK_FRAME = amqp.frame_bytes(amqp.FRAME_METHOD, 0, b"\x00\x0a\x00\x33")
_CHECKED = ClientReads.CHECKED


class ConnectionMethods:
    """The connection-level part of a :class:`~plugin.session._session.Session`."""

    # the session's state this part reads and changes (made in Session.__init__)
    connection_id: int
    vhost: str | None
    user: str | None
    fault_code: int | None
    _state: Lifecycle
    _directory: VpnDirectory
    _ctx: ChannelContext
    _channels: dict[int, Channel]
    _client: FrameSplitter
    _broker: FrameSplitter
    _broker_frame_max: int
    _behind_raw_frame: list[bytes]
    _client_header_buf: bytes
    _scan_tail: bytes
    _fused: FusedPublish | None

    # ------------------------------------------------------------ state

    @property
    def state(self) -> Lifecycle:
        return self._state

    @property
    def vpn(self) -> VpnView | None:
        """The replicated VPN the client opened (None: not one of ours)."""
        return self._ctx.vpn

    @vpn.setter
    def vpn(self, vpn: VpnView | None) -> None:
        self._ctx.vpn = vpn

    @property
    def replicated(self) -> bool:
        """The VPN was active when the client opened the connection."""
        return self._ctx.replicating

    @property
    def passthrough(self) -> bool:
        """Open on a vhost that is not replicated: frames checked, not tracked."""
        return CLIENT_READS[self._state] is _CHECKED

    @property
    def closing(self) -> bool:
        """A connection.close is on its way: nothing held is released any more."""
        return self._state in CLOSING

    @property
    def client_done(self) -> bool:
        """Nothing more will come from, or go to, the client."""
        return self._state in CLIENT_DONE

    @property
    def broker_done(self) -> bool:
        """Nothing more will come from the broker."""
        return self._state in BROKER_DONE

    @property
    def _out(self) -> Output:
        return self._ctx.out

    def _advance(self, trigger: Trigger) -> None:
        self._state = advance(self._state, trigger)

    def _begin(self) -> Output:
        """A new output for one call of the driver's; the channels fill it too."""
        self._ctx.out = out = Output()
        return out

    # ------------------------------------------------------------ the connection

    def shutdown(self, reason: str) -> Output:
        """The listener is stopping: close both sides with AMQP, as RabbitMQ
        itself does on shutdown (320), so nothing is dropped mid-frame."""
        out = self._begin()
        if self._state not in CLIENT_DONE and self._state not in WE_CLOSED:
            self._fail(amqp.ConnectionForced(reason))
            self.fault_code = None  # not a protocol fault of the client
        return out

    def _protocol_header(self, data: bytes) -> bytes:
        need = 8 - len(self._client_header_buf)
        self._client_header_buf += data[:need]
        rest = data[need:]
        if len(self._client_header_buf) < 8:
            return b""
        if self._client_header_buf != amqp.PROTOCOL_HEADER:
            # AMQP 0-9-1 section 4.2.2: answer with the header we speak, then close.
            self._out.to_client.append(amqp.PROTOCOL_HEADER)
            self._out.drop_broker = True
            self._advance(Trigger.BAD_HEADER)
            return b""
        if self._state is Lifecycle.AWAITING_HEADER:  # else upstream is gone already
            self._out.to_broker.append(amqp.PROTOCOL_HEADER)
        self._advance(Trigger.HEADER)
        return rest

    def _c_start_ok(self, channel: int, buf: bytes, f: FrameSpan) -> bytes | None:
        """EXTERNAL authentication is refused: the client's certificate ends
        at the listener, which terminates TLS, and the broker would judge
        the listener's own connection instead of the client."""
        m = amqp.decode_method(buf, f)
        assert isinstance(m, commands.Connection.StartOk)  # noqa: S101
        if m.mechanism == "EXTERNAL":
            raise amqp.AccessRefused(
                "EXTERNAL authentication (a client certificate) cannot pass through the "
                "vpnrepl listener; log in with a user name and password (PLAIN or AMQPLAIN)",
                Method.CONNECTION_START_OK,
            )
        # the broker judges the login; its user owns the XA branches it starts
        self.user = amqp.login_user(m.mechanism, m.response)
        return None

    def _c_tune_ok(self, channel: int, buf: bytes, f: FrameSpan) -> bytes | None:
        """The client's frame_max, clamped to the broker's (a client's 0,
        "no limit", would let it make the listener buffer any frame)."""
        m = amqp.decode_method(buf, f)
        assert isinstance(m, commands.Connection.TuneOk)  # noqa: S101
        limit = self._broker_frame_max or HANDSHAKE_FRAME_MAX
        self._client.frame_max = min(m.frame_max, limit) if m.frame_max else limit
        return None

    def _c_open(self, channel: int, buf: bytes, f: FrameSpan) -> bytes | None:
        m = amqp.decode_method(buf, f)
        assert isinstance(m, commands.Connection.Open)  # noqa: S101
        self.vhost = m.virtual_host
        ctx = self._ctx
        vpn = ctx.vpn = self._directory.lookup(m.virtual_host)
        ctx.replicating = vpn is not None and vpn.replicated
        ctx.expose_id = vpn is not None and vpn.expose_id
        ctx.templates = HeaderTemplates(ctx.expose_id)
        self._fused = FusedPublish(ctx, self._channels) if ctx.replicating else None
        if vpn is not None and vpn.refusal is not None:
            raise amqp.NotAllowed(vpn.refusal, Method.CONNECTION_OPEN)
        if vpn is not None and not vpn.replicated:
            raise amqp.NotAllowed(
                f"vhost '{m.virtual_host}' is a replication standby; connect to the active site",
                Method.CONNECTION_OPEN,
            )
        return None

    def _c_close(self, channel: int, buf: bytes, f: FrameSpan) -> bytes | None:
        """The client's connection.close: relayed; nothing held is released
        any more."""
        self._advance(Trigger.CLIENT_CLOSE if channel == 0 else Trigger.CLIENT_CLOSE_ASTRAY)
        return None

    def _client_closed_in_passthrough(self) -> None:
        self._advance(Trigger.CLIENT_CLOSE)

    def _c_close_ok(self, channel: int, buf: bytes, f: FrameSpan) -> bytes | None:
        self._advance(Trigger.CLIENT_CLOSE_OK)
        return None

    def _b_tune(self, channel: int, buf: bytes, f: FrameSpan) -> bytes | None:
        m = amqp.decode_method(buf, f)
        assert isinstance(m, commands.Connection.Tune)  # noqa: S101
        self._broker_frame_max = m.frame_max
        return None

    def _b_open_ok(self, channel: int, buf: bytes, f: FrameSpan) -> bytes | None:
        # Nothing on an unreplicated vhost concerns replication (settings apply
        # to connections opened after a change): from here on, frames are only
        # checked, and broker bytes are relayed without parsing.
        self._advance(Trigger.OPENED if self._ctx.replicating else Trigger.OPENED_PASSTHROUGH)
        return None

    def _b_close(self, channel: int, buf: bytes, f: FrameSpan) -> bytes | None:
        """The broker's connection.close: relayed; nothing held is released
        any more."""
        self._advance(Trigger.BROKER_CLOSE)
        return None

    def _b_close_ok(self, channel: int, buf: bytes, f: FrameSpan) -> bytes | None:
        self._advance(Trigger.BROKER_CLOSE_OK)
        return None

    def _closing_from_client(self, buf: bytes, f: FrameSpan) -> None:
        """After our connection.close: wait for the client's close-ok."""
        if f.type != amqp.FRAME_METHOD or f.channel != 0:
            return
        ids = amqp.method_id(buf, f)
        if ids == Method.CONNECTION_CLOSE:  # both sides closed at once
            self._to_client(amqp.marshal_method(commands.Connection.CloseOk(), 0))
            self._advance(Trigger.CLIENT_CLOSE)
        elif ids == Method.CONNECTION_CLOSE_OK:
            self._advance(Trigger.CLIENT_CLOSE_OK)

    def _closing_from_broker(self, buf: bytes, f: FrameSpan) -> None:
        """After our connection.close: wait for the broker's close-ok."""
        if f.type != amqp.FRAME_METHOD or f.channel != 0:
            return
        ids = amqp.method_id(buf, f)
        if ids == Method.CONNECTION_CLOSE:
            self._out.to_broker.append(amqp.marshal_method(commands.Connection.CloseOk(), 0))
            self._advance(Trigger.BROKER_CLOSE)
        elif ids == Method.CONNECTION_CLOSE_OK:
            self._advance(Trigger.BROKER_CLOSE_OK)

    def _finish_raw_frame(self, data: bytes) -> bytes:
        """Passthrough ended (we closed the connection) inside a broker frame
        whose start was relayed raw: the rest of it goes to the client, then
        the frames of ours held behind it (:meth:`_to_client`). Returns the
        bytes after that frame, which the splitter takes from a boundary
        (so the broker's close-ok is seen)."""
        end = self._broker.pass_over(data, one_frame=True)
        if end:
            self._out.to_client.append(data[:end])
        if self._broker.in_frame:
            return b""
        self._out.to_client.extend(self._behind_raw_frame)
        self._behind_raw_frame.clear()
        return data[end:]

    def _to_client(self, frame: bytes) -> None:
        """A frame of ours for the client (our close, a close-ok answer),
        behind the broker frame passthrough left half relayed, if any: the
        client must never find it in the middle of a frame."""
        if self._broker.in_frame:
            self._behind_raw_frame.append(frame)
        else:
            self._out.to_client.append(frame)

    def _find_close_ok(self, data: bytes) -> None:
        """After a framing fault the frame boundaries are lost, but the
        client's close-ok is still a fixed 12-byte frame: look for it, so a
        well-behaved client is released at once, not by the close timer."""
        window = self._scan_tail + data
        if _CLOSE_OK_FRAME in window:
            self._advance(Trigger.CLIENT_CLOSE_OK)
        self._scan_tail = window[-(len(_CLOSE_OK_FRAME) - 1) :]

    def _broker_fault(self, e: AMQPError) -> None:
        log.warning("connection %d: broker sent a bad frame: %s", self.connection_id, e)
        self._fail(amqp.BrokerProtocolError(f"broker protocol fault: {e.args[0]}"))

    def _fail(self, error: AMQPError, trigger: Trigger = Trigger.FAULT) -> None:
        """Close the client connection with ``error``'s reply code and text;
        close the upstream connection cleanly (or drop it mid-handshake)."""
        state = self._state
        if state in WE_CLOSED:
            return
        log.warning(
            "connection %d: closing client connection: %d %s",
            self.connection_id,
            error.reply_code,
            error.reply_text,
        )
        self._to_client(
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
        self.fault_code = error.reply_code
        self._advance(trigger)
        upstream = UPSTREAM_ON_FAULT[state]
        if upstream is Upstream.DROP:
            self._out.drop_broker = True
        elif upstream is Upstream.CLOSE:
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
