"""Malformed AMQP from one client: that client is closed with a reply code, its
upstream connection is closed cleanly, and the listener and every other client
carry on.

Every case runs a real handshake through the listener with a blocking raw
socket (:class:`RawAMQP`), then sends the bad bytes and reads until the
``connection.close``.

On a replicated vhost the listener splits the client's stream on frame
headers and refuses framing faults (501), unknown methods (503), content out
of sequence (505) and, where replication decodes them, truncated arguments
(502) itself, with a reply text naming the fault. On an unreplicated vhost it
only checks framing, method ids and content sequence after ``open-ok`` (RabbitMQ
3.10.8 drops the TCP connection on an unknown method and accepts a body longer
than declared) and relays the rest, so faults it does not decode there, such
as truncated arguments, get RabbitMQ's own code; :data:`CASES` records what
RabbitMQ answers. Who produced a close is read from the listener's own log
line, never guessed, and each producer's close must be exactly its own.

Fuzzed inputs end in one of three ways, and only these pass:

* ``closed``: a ``connection.close`` with a hard-error reply code; one the
  listener sent has a 501/502/503/505 code and a text naming the fault, and
  the listener closes the socket as soon as it has our ``close-ok``;
* ``usable``: the input happened to be valid AMQP (or was refused by the
  broker at channel level); a fresh channel still opens and the connection
  closes cleanly on request;
* ``client-closed``: the input itself carried a ``connection.close``, which
  the broker answered with ``close-ok``.

A partial frame at the end of an input is completed (the peer is right to
wait for the rest), so a silent connection is always a failure, never a
timeout we tolerate. ``VPNREPL_FUZZ_EXAMPLES`` raises the example count of
the hypothesis tests for a longer campaign.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pika
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st
from pamqp import commands as C, frame, header
from pamqp.body import ContentBody

from bridge import REPLICATION_HEADER, Consumed, Published
from plugin.devtools import LocalSite
from plugin.listener import CLOSE_TIMEOUT, MemorySink
from tests.fix_listener import ListenerThread, enable_vpn

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_MAX = 131072
PROBE_CHANNEL = 2000
REPLICATED, UNREPLICATED = "orders", "plain"  # the vhosts of the ``vhosts`` fixture
STEADY = "steady"  # the queue of the well-behaved client; no fuzzed frame names it
TIMEOUT = 10.0  # any single read: a hang fails the test instead of blocking it
PROBE_WAIT = 3.0  # before assuming the probe was swallowed by a partial frame
FAST_CLOSE = 2.0  # a close handshake, not the listener's close timer

CONNECTION_CLOSE = (10, 50)
CONNECTION_CLOSE_OK = (10, 51)
CHANNEL_OPEN_OK = (20, 11)

#: codes the listener uses for a client's protocol fault
LISTENER_CODES = {501, 502, 503, 505}
#: connection-level (hard) error codes RabbitMQ may answer a bad client with;
#: 541 when a channel crashes on properties it cannot decode (relayed as is on
#: an unreplicated vhost, see test_properties_only_the_replicated_path_decodes)
BROKER_CODES = {501, 502, 503, 504, 505, 530, 540, 541}

#: every reply text the listener sends for a client fault: each names the fault
LISTENER_TEXTS = [
    re.compile(p)
    for p in (
        r"FRAME_ERROR - unknown frame type \d+",
        r"FRAME_ERROR - protocol header received inside an open connection",
        r"FRAME_ERROR - frame of \d+ bytes exceeds frame-max \d+",
        r"FRAME_ERROR - frame-end octet is 0x[0-9a-f]{2}, expected 0xce",
        r"FRAME_ERROR - heartbeat frame on channel \d+",
        r"FRAME_ERROR - method frame too short for a class and method id",
        r"FRAME_ERROR - content body of \d+ bytes exceeds the declared size \d+",
        r"COMMAND_INVALID - unknown class \d+ method \d+",
        r"SYNTAX_ERROR - malformed arguments of method \d+\.\d+",
        r"SYNTAX_ERROR - malformed basic\.publish",
        r"SYNTAX_ERROR - content header frame too short",
        r"SYNTAX_ERROR - content header property flags continue past one word",
        r"SYNTAX_ERROR - malformed content header properties",
        r"SYNTAX_ERROR - malformed headers table in content header",
        r"UNEXPECTED_FRAME - method frame on channel \d+ while content was expected",
        r"UNEXPECTED_FRAME - content header on channel \d+ without a publish",
        r"UNEXPECTED_FRAME - content body on channel \d+ without a header",
        r"UNEXPECTED_FRAME - content header for class \d+, expected 60 \(basic\)",
        r"SYNTAX_ERROR - content header weight \d+, expected 0",
        r"SYNTAX_ERROR - content header sets an undefined property flag",
        r"SYNTAX_ERROR - content header properties overrun the frame \(\d+ bytes\)",
    )
]

FUZZ_SETTINGS = settings(
    deadline=None,
    max_examples=int(os.environ.get("VPNREPL_FUZZ_EXAMPLES", "100")),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# ---------------------------------------------------------------- frames


def raw_frame(ftype: int, channel: int, payload: bytes, end: bytes = b"\xce") -> bytes:
    return struct.pack(">BHI", ftype, channel, len(payload)) + payload + end


def method(m: object, channel: int = 1) -> bytes:
    return frame.marshal(m, channel)  # type: ignore[arg-type]


def payload_of(m: object) -> bytes:
    """The method payload (class id, method id, arguments) without the frame."""
    return method(m)[7:-1]


def content_header(body_size: int, channel: int = 1, **props: Any) -> bytes:
    hdr = header.ContentHeader(body_size=body_size, properties=C.Basic.Properties(**props))
    return frame.marshal(hdr, channel)


def body(data: bytes, channel: int = 1) -> bytes:
    return frame.marshal(ContentBody(data), channel)


def publish(data: bytes, channel: int = 1, queue: str = "q", **props: Any) -> bytes:
    out = method(C.Basic.Publish(exchange="", routing_key=queue), channel)
    out += content_header(len(data), channel, **props)
    return out + (body(data, channel) if data else b"")


def completion(data: bytes, relayed: bool = False) -> bytes | None:
    """Bytes that end ``data`` on a frame boundary, as the stream is split.

    None when the splitter must find a framing fault in ``data``; a partial
    frame is completed with zeros and a frame-end octet. The listener refuses
    an unknown frame type or a frame over frame-max as soon as it has the
    7-octet header. A ``relayed`` stream (an unreplicated vhost after
    ``open-ok``) is split by RabbitMQ 3.10, which reads the whole frame before
    it checks the type and allows 8 octets over frame-max.
    """
    frame_max = FRAME_MAX + 8 if relayed else FRAME_MAX
    pad = b""
    while True:
        buf = data + pad
        pos = 0
        while len(buf) - pos >= 7:
            ftype, _, size = struct.unpack_from(">BHI", buf, pos)
            known = ftype in (1, 2, 3, 8)
            if size + 8 > frame_max or not (known or relayed):
                return None
            end = pos + size + 8
            if end > len(buf):
                break
            if buf[end - 1] != 0xCE or not known:
                return None
            pos = end
        if pos == len(buf):
            return pad
        missing_head = 7 - (len(buf) - pos)
        if missing_head > 0:
            pad += bytes(missing_head)
            continue
        size = struct.unpack_from(">I", buf, pos + 3)[0]
        pad += bytes(pos + size + 7 - len(buf)) + b"\xce"


# ---------------------------------------------------------------- the raw client


@dataclass(frozen=True)
class Outcome:
    kind: str  # "closed", "usable", "client-closed", "eof"
    code: int = 0
    text: str = ""
    close_seconds: float = 0.0  # our close-ok (or close) sent → EOF

    def __str__(self) -> str:
        return f"{self.kind} {self.code} {self.text!r} ({self.close_seconds:.2f} s)"


def _close_reply(payload: bytes) -> tuple[int, str]:
    """(reply-code, reply-text) of a connection.close payload, decoded by
    hand: RabbitMQ quotes the octets of a bad frame in its reply text
    ("FRAME_ERROR - type 8, all octets = <<...>>"), which need not be UTF-8
    and which pamqp then refuses to decode."""
    code, n = struct.unpack_from(">HB", payload, 4)
    return code, payload[7 : 7 + n].decode(errors="replace")


class _ProbeSwallowed(Exception):
    """No answer to the probe: it completed a partial frame we did not foresee."""


class RawAMQP:
    """A blocking AMQP 0-9-1 client that can send anything after a real handshake."""

    def __init__(self, port: int, relayed: bool = False) -> None:
        #: after open-ok the listener relays this connection's bytes untouched
        self.relayed = relayed
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()

    def __enter__(self) -> RawAMQP:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    # bytes ---------------------------------------------------------------

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the listener has closed; what it sent before is still readable

    def _fill(self, n: int) -> bool:
        while len(self._buf) < n:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return False
            self._buf += chunk
        return True

    def read_raw(self, n: int) -> bytes:
        """Exactly ``n`` bytes, or fewer when the peer closed."""
        self._fill(n)
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def read_frame(self) -> tuple[int, int, bytes] | None:
        """(type, channel, payload) of the next frame; None at EOF."""
        if not self._fill(7):
            assert not self._buf, f"EOF inside a frame header: {bytes(self._buf)!r}"
            return None
        ftype, channel, size = struct.unpack_from(">BHI", self._buf)
        assert self._fill(size + 8), "EOF inside a frame from the listener"
        assert self._buf[size + 7] == 0xCE, "the listener sent a frame without a frame-end"
        payload = bytes(self._buf[7 : size + 7])
        del self._buf[: size + 8]
        return ftype, channel, payload

    def read_decoded(self) -> tuple[int, object]:
        """The next frame other than a heartbeat, decoded by pamqp."""
        while True:
            f = self.read_frame()
            assert f is not None, "the listener closed the connection"
            ftype, channel, payload = f
            if ftype == 8:
                continue
            _, _, value = frame.unmarshal(raw_frame(ftype, channel, payload))
            return channel, value

    def expect(self, kind: type, channel: int = 0) -> object:
        got_channel, value = self.read_decoded()
        assert (got_channel, type(value)) == (channel, kind), (got_channel, value)
        return value

    # a real handshake ------------------------------------------------------

    def handshake(self, vhost: str) -> None:
        self.send(PROTOCOL_HEADER)
        self.expect(C.Connection.Start)
        self.send(
            method(
                C.Connection.StartOk(
                    client_properties={"product": "vpnrepl fuzz"},
                    mechanism="PLAIN",
                    response="\0guest\0guest",
                ),
                0,
            )
        )
        tune = self.expect(C.Connection.Tune)
        assert isinstance(tune, C.Connection.Tune)
        self.send(
            method(C.Connection.TuneOk(channel_max=tune.channel_max, frame_max=FRAME_MAX), 0)
            + method(C.Connection.Open(virtual_host=vhost), 0)
        )
        self.expect(C.Connection.OpenOk)
        self.send(method(C.Channel.Open(), 1))
        self.expect(C.Channel.OpenOk, 1)

    def get_one(self, queue: str = "held") -> int:
        """Publish a persistent message to ``queue`` and basic.get it (unacked)."""
        self.send(publish(b"pending", queue=queue, delivery_mode=2))
        for _ in range(100):
            self.send(method(C.Basic.Get(queue=queue)))
            _, value = self.read_decoded()
            if isinstance(value, C.Basic.GetOk):
                self.expect(header.ContentHeader, 1)
                self.expect(ContentBody, 1)
                return int(value.delivery_tag or 0)
            assert isinstance(value, C.Basic.GetEmpty), vars(value)
            time.sleep(0.01)
        raise AssertionError(f"nothing arrived on {queue}")

    # how it ends -----------------------------------------------------------

    def send_and_settle(self, data: bytes) -> Outcome:
        """Send ``data``, aligned on a frame boundary and followed by a probe
        (a fresh channel), in one write; return how the connection ended.

        One write keeps the probe in the chunk that carries a fault, so our
        later close-ok reaches the listener on its own (see
        test_close_ok_after_another_frame_in_one_write_is_honoured).
        """
        pad = completion(data, self.relayed)
        self.send(data + (pad or b"") + method(C.Channel.Open(), PROBE_CHANNEL))
        try:
            return self.outcome(first_wait=PROBE_WAIT)
        except _ProbeSwallowed:
            pass  # the probe went into a frame we could not predict: finish it
        self.send(b"\xce" * (FRAME_MAX + 8))
        return self.outcome()

    def outcome(self, first_wait: float = TIMEOUT) -> Outcome:
        """How the connection ends: a connection.close (answered with close-ok,
        then the listener must close the socket), a close-ok to a close in the
        input, or the probe's channel.open-ok (then we close, and must get a
        close-ok). A client that received close-ok closes the socket itself."""
        self.sock.settimeout(first_wait)
        try:
            what, payload = self._next_control()
        except TimeoutError as e:
            raise _ProbeSwallowed from e
        finally:
            self.sock.settimeout(TIMEOUT)
        kind = "client-closed"
        if what == CHANNEL_OPEN_OK:
            kind = "usable"
            close = C.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0)
            self.send(method(close, 0))
            what, payload = self._next_control()
        if what == CONNECTION_CLOSE:  # a fault, or the broker's close crossing ours
            code, text = _close_reply(payload)
            self.send(method(C.Connection.CloseOk(), 0))
            # The listener must close the socket once it has our close-ok. A
            # close from RabbitMQ after a framing fault is another matter: it
            # cannot read our close-ok and waits 3 s (SILENT_CLOSE_DELAY)
            # before it hangs up, so we close first, as pika does.
            ours = any(p.fullmatch(text) for p in LISTENER_TEXTS)
            seconds = self._until_eof() if ours else 0.0
            return Outcome("closed", code, text, seconds)
        if what == CONNECTION_CLOSE_OK:
            return Outcome(kind)
        return Outcome("eof")

    def _next_control(self) -> tuple[tuple[int, int] | None, bytes]:
        """The next connection.close / close-ok, or the probe's open-ok; None at EOF."""
        while True:
            f = self.read_frame()
            if f is None:
                return None, b""
            ftype, channel, payload = f
            if ftype != 1 or len(payload) < 4:
                continue
            ids = struct.unpack_from(">HH", payload)
            if channel == 0 and ids in (CONNECTION_CLOSE, CONNECTION_CLOSE_OK):
                return ids, payload
            if channel == PROBE_CHANNEL and ids == CHANNEL_OPEN_OK:
                return ids, payload

    def _until_eof(self) -> float:
        t0 = time.monotonic()
        while self.read_frame() is not None:
            pass
        return time.monotonic() - t0


# ---------------------------------------------------------------- fixtures


@dataclass
class ListenerCloses:
    """The listener's own "closing client connection" log lines: (code, text)."""

    seen: list[tuple[int, str]] = field(default_factory=list)
    broker_faults: list[str] = field(default_factory=list)

    def take(self) -> list[tuple[int, str]]:
        out, self.seen = self.seen, []
        return out


class _CloseLog(logging.Handler):
    def __init__(self, sink: ListenerCloses) -> None:
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        if "closing client connection" in record.msg:
            _, code, text = cast(tuple[int, int, str], record.args)
            self.sink.seen.append((code, text))
        elif "broker sent a bad frame" in record.msg:
            self.sink.broker_faults.append(record.getMessage())


@pytest.fixture
def listener_closes() -> Iterator[ListenerCloses]:
    closes = ListenerCloses()
    handler = _CloseLog(closes)
    logger = logging.getLogger("plugin.session")
    logger.addHandler(handler)
    try:
        yield closes
    finally:
        logger.removeHandler(handler)
    assert closes.broker_faults == []


def _vhost_with_queues(site: LocalSite, vhost: str, *queues: str) -> None:
    site.rabbit.add_vhost(vhost)
    conn = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url(vhost)))
    try:
        ch = conn.channel()
        for q in queues:
            ch.queue_declare(q, durable=True)
        # so that a fuzzed publish to amq.headers is routed by its headers table
        ch.queue_bind("q", "amq.headers", arguments={"x-match": "any", "a": 1, "k": "v"})
    finally:
        conn.close()


@pytest.fixture
def vhosts(site_a: LocalSite, listener_a: ListenerThread) -> dict[str, str]:
    """``orders`` replicated (queues q, work, held and steady in scope),
    ``plain`` not; q is also bound to amq.headers. Fuzzed frames name q and
    work, never held, which only ever holds the delivery a case needs pending,
    nor steady, the well-behaved client's (a fuzzed basic.get of its queue
    would take its messages)."""
    queues = ("q", "work", "held", STEADY)
    _vhost_with_queues(site_a, REPLICATED, *queues)
    _vhost_with_queues(site_a, UNREPLICATED, *queues)
    enable_vpn(listener_a, site_a, REPLICATED, queues=queues)
    return {"replicated": REPLICATED, "unreplicated": UNREPLICATED}


def memory_sink(lt: ListenerThread) -> MemorySink:
    assert isinstance(lt.sink, MemorySink)
    return lt.sink


def run_case(
    port: int, vhost: str, data: bytes, setup: Callable[[RawAMQP], None] | None = None
) -> Outcome:
    """One raw connection: handshake, optional setup, ``data``, and its end."""
    with RawAMQP(port, relayed=vhost == UNREPLICATED) as client:
        client.handshake(vhost)
        if setup is not None:
            setup(client)
        return client.send_and_settle(data)


def judge(
    outcome: Outcome, data: bytes, closes: ListenerCloses, lt: ListenerThread, relayed: bool
) -> str:
    """Check one fuzzed outcome against the rules in the module docstring;
    return who ended the connection."""
    assert lt.errors == [], lt.errors
    ours = closes.take()
    if outcome.kind == "closed":
        if (outcome.code, outcome.text) in ours:
            assert outcome.code in LISTENER_CODES, outcome
            assert any(p.fullmatch(outcome.text) for p in LISTENER_TEXTS), outcome
            return f"listener {outcome.code}"
        assert outcome.code in BROKER_CODES, outcome
        return f"broker {outcome.code}"
    assert completion(data, relayed) is not None, f"a framing fault left the connection {outcome}"
    if outcome.kind == "usable":
        return "usable"
    if outcome.kind == "client-closed":
        assert b"\x00\x0a\x00\x32" in data, "close-ok without a connection.close from us"
        return "client-closed"
    raise AssertionError(f"EOF without a connection.close: {outcome}")


# ---------------------------------------------------------------- deterministic cases


@dataclass(frozen=True)
class Case:
    """One fault, and the close it must get on each vhost."""

    name: str
    data: bytes
    code: int  # the listener's reply code on the replicated vhost
    text: str  # and a regex for its reply text
    #: RabbitMQ's (code, text regex) on the unreplicated vhost, where the
    #: listener relays the bytes untouched after open-ok
    broker: tuple[int, str]
    pending_delivery: bool = False  # basic.get an unacked message first
    #: bytes nobody can frame follow the fault (the rest of an oversize frame):
    #: our close-ok may be lost in them, and the listener's close timer ends it
    residue: bool = False


def _tag1_ack() -> bytes:
    return payload_of(C.Basic.Ack(delivery_tag=1))


def _rabbit_frame_error(ftype: int, detail: str) -> tuple[int, str]:
    return 501, rf"FRAME_ERROR - type {ftype}, (all|first 16) octets = <<.*>>: {detail}"


CANNOT_DECODE = (501, r"FRAME_ERROR - cannot decode <<.*>>")
EXPECTED_METHOD = (505, "UNEXPECTED_FRAME - expected method frame, got non method frame instead")
EXPECTED_HEADER = (
    505,
    "UNEXPECTED_FRAME - expected content header for class 60, got non content header frame instead",
)
EXPECTED_BODY = (
    505,
    "UNEXPECTED_FRAME - expected content body, got non content body frame instead",
)
#: What the requirement asks for where RabbitMQ 3.10.8 gives no close at all:
#: an unknown class or method crashes its connection reader (the socket is
#: dropped without connection.close), and it accepts a content body longer
#: than declared. Relayed untouched, these fail the requirement.
REQUIRED_503 = (503, r"COMMAND_INVALID - .*")
REQUIRED_501 = (501, r"FRAME_ERROR - .*")

CASES = [
    Case(
        "bad frame-end octet",
        method(C.Basic.Qos(prefetch_count=1))[:-1] + b"\x00",
        501,
        r"FRAME_ERROR - frame-end octet is 0x00, expected 0xce",
        _rabbit_frame_error(1, r"\{invalid_frame_end_marker,0\}"),
    ),
    Case(
        "missing frame-end (next frame follows at once)",
        method(C.Basic.Qos(prefetch_count=1))[:-1] + method(C.Basic.Qos(prefetch_count=2)),
        501,
        r"FRAME_ERROR - frame-end octet is 0x01, expected 0xce",
        _rabbit_frame_error(1, r"\{invalid_frame_end_marker,1\}"),
    ),
    Case(
        "unknown frame type",
        raw_frame(9, 1, b"x"),
        501,
        r"FRAME_ERROR - unknown frame type 9",
        _rabbit_frame_error(9, "unknown_frame"),
    ),
    Case(
        "frame type 0",
        raw_frame(0, 0, b""),
        501,
        r"FRAME_ERROR - unknown frame type 0",
        _rabbit_frame_error(0, "unknown_frame"),
    ),
    Case(
        "protocol header inside the connection",
        PROTOCOL_HEADER,
        501,
        r"FRAME_ERROR - protocol header received inside an open connection",
        _rabbit_frame_error(65, r"\{frame_too_large,\d+,\d+\}"),
    ),
    Case(
        "frame one octet over frame-max, refused on its header",
        struct.pack(">BHI", 3, 1, FRAME_MAX - 7) + bytes(16),
        501,
        rf"FRAME_ERROR - frame of {FRAME_MAX + 1} bytes exceeds frame-max {FRAME_MAX}",
        # RabbitMQ allows 8 octets over frame-max: it reads the frame, a body
        # frame without a publish
        EXPECTED_METHOD,
    ),
    Case(
        "oversize frame, complete",
        method(C.Basic.Publish(routing_key="q"))
        + content_header(FRAME_MAX + 1)
        + raw_frame(3, 1, bytes(FRAME_MAX + 1)),
        501,
        rf"FRAME_ERROR - frame of {FRAME_MAX + 9} bytes exceeds frame-max {FRAME_MAX}",
        _rabbit_frame_error(3, rf"\{{frame_too_large,{FRAME_MAX + 1},{FRAME_MAX - 8}\}}"),
        residue=True,
    ),
    Case(
        "heartbeat on channel 1",
        raw_frame(8, 1, b""),
        501,
        r"FRAME_ERROR - heartbeat frame on channel 1",
        (505, r"UNEXPECTED_FRAME - type 8, all octets = <<>>"),
    ),
    Case(
        "method frame too short for ids",
        raw_frame(1, 1, b"\x00\x3c"),
        501,
        r"FRAME_ERROR - method frame too short for a class and method id",
        _rabbit_frame_error(1, "unknown_frame"),
    ),
    Case(
        "truncated basic.publish",
        raw_frame(1, 1, payload_of(C.Basic.Publish(exchange="amq.direct", routing_key="q"))[:-3]),
        502,
        r"SYNTAX_ERROR - malformed basic\.publish",
        CANNOT_DECODE,
    ),
    Case(
        "basic.publish without its bit field",
        raw_frame(1, 1, payload_of(C.Basic.Publish(routing_key="q"))[:-1]),
        502,
        r"SYNTAX_ERROR - malformed basic\.publish",
        CANNOT_DECODE,
    ),
    Case(
        "truncated basic.ack of a delivered message",
        raw_frame(1, 1, _tag1_ack()[:8]),
        502,
        r"SYNTAX_ERROR - malformed arguments of method 60\.80",
        CANNOT_DECODE,
        pending_delivery=True,
    ),
    Case(
        "truncated queue.declare",
        raw_frame(1, 1, payload_of(C.Queue.Declare(queue="fuzzed"))[:9]),
        502,
        r"SYNTAX_ERROR - malformed arguments of method 50\.10",
        CANNOT_DECODE,
    ),
    Case(
        "truncated connection.tune-ok",
        raw_frame(1, 0, payload_of(C.Connection.TuneOk(frame_max=FRAME_MAX))[:7]),
        502,
        r"SYNTAX_ERROR - malformed arguments of method 10\.31",
        (541, "INTERNAL_ERROR"),
    ),
    Case(
        "truncated connection.open",
        raw_frame(1, 0, payload_of(C.Connection.Open(virtual_host="orders"))[:6]),
        502,
        r"SYNTAX_ERROR - malformed arguments of method 10\.40",
        (541, "INTERNAL_ERROR"),
    ),
    Case(
        "unknown class",
        raw_frame(1, 1, struct.pack(">HH", 999, 10)),
        503,
        r"COMMAND_INVALID - unknown class 999 method 10",
        REQUIRED_503,
    ),
    Case(
        "unknown method of a known class",
        raw_frame(1, 1, struct.pack(">HH", 60, 999) + bytes(8)),
        503,
        r"COMMAND_INVALID - unknown class 60 method 999",
        REQUIRED_503,
    ),
    Case(
        "unknown method on channel 0",
        raw_frame(1, 0, struct.pack(">HH", 10, 12)),
        503,
        r"COMMAND_INVALID - unknown class 10 method 12",
        REQUIRED_503,
    ),
    Case(
        "content header without a publish",
        content_header(3),
        505,
        r"UNEXPECTED_FRAME - content header on channel 1 without a publish",
        EXPECTED_METHOD,
    ),
    Case(
        # the client's close has gone to the broker: ours must not follow it
        "content header after the client's connection.close",
        method(C.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0), 0)
        + content_header(3),
        505,
        r"UNEXPECTED_FRAME - content header on channel 1 without a publish",
        EXPECTED_METHOD,
    ),
    Case(
        "second content header for one publish",
        method(C.Basic.Publish(routing_key="q")) + content_header(3) + content_header(3),
        505,
        r"UNEXPECTED_FRAME - content header on channel 1 without a publish",
        EXPECTED_BODY,
    ),
    Case(
        "body without a publish",
        body(b"abc"),
        505,
        r"UNEXPECTED_FRAME - content body on channel 1 without a header",
        EXPECTED_METHOD,
    ),
    Case(
        "body without a header",
        method(C.Basic.Publish(routing_key="q")) + body(b"abc"),
        505,
        r"UNEXPECTED_FRAME - content body on channel 1 without a header",
        EXPECTED_HEADER,
    ),
    Case(
        "method frame while the content header is expected",
        method(C.Basic.Publish(routing_key="q")) + method(C.Basic.Qos(prefetch_count=1)),
        505,
        r"UNEXPECTED_FRAME - method frame on channel 1 while content was expected",
        EXPECTED_HEADER,
    ),
    Case(
        "method frame while the content body is expected",
        method(C.Basic.Publish(routing_key="q"))
        + content_header(10)
        + body(b"12345")
        # a second publish where the other half of the body should be
        + method(C.Basic.Publish(routing_key="q")),
        505,
        r"UNEXPECTED_FRAME - method frame on channel 1 while content was expected",
        EXPECTED_BODY,
    ),
    Case(
        "content body longer than declared, one frame",
        method(C.Basic.Publish(routing_key="q")) + content_header(3) + body(b"12345"),
        501,
        r"FRAME_ERROR - content body of 5 bytes exceeds the declared size 3",
        REQUIRED_501,
    ),
    Case(
        "content body longer than declared, second frame",
        method(C.Basic.Publish(routing_key="q"))
        + content_header(4, delivery_mode=2)
        + body(b"123")
        + body(b"45"),
        501,
        r"FRAME_ERROR - content body of 5 bytes exceeds the declared size 4",
        REQUIRED_501,
    ),
    Case(
        "content header frame too short",
        method(C.Basic.Publish(routing_key="q")) + raw_frame(2, 1, bytes(10)),
        502,
        r"SYNTAX_ERROR - content header frame too short",
        _rabbit_frame_error(2, "unknown_frame"),
    ),
]

#: RabbitMQ decodes properties only when it routes the message, and its
#: channel process crashes on bad ones: connection.close 541 INTERNAL_ERROR
CHANNEL_CRASH = (541, "INTERNAL_ERROR")

#: faults only the replicated path decodes; what RabbitMQ makes of them on a
#: plain vhost is measured in test_properties_only_the_replicated_path_decodes
PROPERTY_CASES = [
    Case(
        "persistent publish whose content-type runs past the header",
        method(C.Basic.Publish(routing_key="q"))
        + raw_frame(2, 1, struct.pack(">HHQH", 60, 0, 1, 0x8000 | 0x1000) + b"\x05ab")
        + body(b"x"),
        502,
        r"SYNTAX_ERROR - malformed content header properties",
        CHANNEL_CRASH,
    ),
    Case(
        "persistent publish with a headers table that does not parse",
        method(C.Basic.Publish(routing_key="q"))
        + raw_frame(
            2,
            1,
            struct.pack(">HHQH", 60, 0, 1, 0x2000 | 0x1000)
            + struct.pack(">I", 5)
            + b"\x01kZ\x00\x00"  # field type Z does not exist
            + b"\x02",
        )
        + body(b"x"),
        502,
        r"SYNTAX_ERROR - malformed headers table in content header",
        CHANNEL_CRASH,
    ),
]


def _get_one_first(client: RawAMQP) -> None:
    client.get_one()


def _setup_for(case: Case) -> Callable[[RawAMQP], None] | None:
    return _get_one_first if case.pending_delivery else None


@pytest.mark.parametrize("kind", ["replicated", "unreplicated"])
def test_each_fault_closes_the_client_with_its_reply_code(
    kind: str,
    site_a: LocalSite,
    vhosts: dict[str, str],
    listener_a: ListenerThread,
    listener_closes: ListenerCloses,
) -> None:
    """Replicated vhost: the listener closes with its code and a text naming
    the fault, then closes the socket at once on our close-ok. Unreplicated
    vhost: faults the listener checks there get the same close; the others
    are relayed and RabbitMQ closes with its own code (see :data:`CASES`)."""
    log = BrokerLog(site_a)
    wrong: list[str] = []
    for case in CASES:
        outcome = run_case(listener_a.port, vhosts[kind], case.data, _setup_for(case))
        by_listener = (outcome.code, outcome.text) in listener_closes.take()
        if kind == "replicated" or by_listener:
            code, text, producer = case.code, case.text, "listener"
            slowest = CLOSE_TIMEOUT + 1 if case.residue else FAST_CLOSE
        else:
            (code, text), producer, slowest = case.broker, "broker", FAST_CLOSE
        if (
            outcome.kind != "closed"
            or outcome.code != code
            or not re.fullmatch(text, outcome.text)
            or by_listener != (producer == "listener")
            or outcome.close_seconds > slowest
        ):
            wrong.append(
                f"{case.name}: want {producer} {code} {text!r}, got {outcome}"
                f" (by the listener: {by_listener})"
            )
        assert listener_a.errors == [], (case.name, listener_a.errors)
    # on the replicated vhost the listener closed each upstream with AMQP
    assert_upstreams_closed(site_a, listener_a, log, len(CASES) if kind == "replicated" else 0)
    assert wrong == [], "\n".join(wrong)


def test_close_ok_after_another_frame_in_one_write_is_honoured(
    vhosts: dict[str, str], listener_a: ListenerThread, listener_closes: ListenerCloses
) -> None:
    """A pipelining publisher still has frames in flight when the listener's
    connection.close reaches it; its close-ok follows them in the same write.
    The listener must complete the close then, not when its close timer fires."""
    with RawAMQP(listener_a.port) as client:
        client.handshake(vhosts["replicated"])
        client.send(raw_frame(1, 1, struct.pack(">HH", 999, 10)))
        close = client.expect(C.Connection.Close)
        assert isinstance(close, C.Connection.Close) and close.reply_code == 503
        client.send(publish(b"in flight") + method(C.Connection.CloseOk(), 0))
        t0 = time.monotonic()
        assert client.read_frame() is None
        elapsed = time.monotonic() - t0
    assert elapsed < FAST_CLOSE, f"close-ok ignored: socket closed after {elapsed:.1f} s"
    assert listener_closes.take() == [(503, close.reply_text)]
    assert listener_a.errors == []


@pytest.mark.parametrize(
    ("header_payload", "code", "text"),
    [
        # class 61 where basic (60) is due (RabbitMQ: 505 as well)
        (struct.pack(">HHQH", 61, 0, 7, 0x1000) + b"\x02", 505, r"UNEXPECTED_FRAME - .*class 61.*"),
        # delivery-mode 2, and a priority flag without its octet (RabbitMQ's
        # channel crashes with 541; the listener names the fault)
        (struct.pack(">HHQH", 60, 0, 7, 0x1800) + b"\x02", 502, "SYNTAX_ERROR - .*properties.*"),
    ],
    ids=["wrong-class", "property-missing"],
)
def test_a_publish_the_broker_refuses_never_reaches_the_sink(
    header_payload: bytes,
    code: int,
    text: str,
    vhosts: dict[str, str],
    listener_a: ListenerThread,
    listener_closes: ListenerCloses,
) -> None:
    """A persistent publish to a replicated queue with a content header
    RabbitMQ would refuse: the listener checks the whole header first and
    closes the client itself, so the message exists neither at the broker nor
    in the ledger (else the standby would deliver a message the active never
    had)."""
    data = (
        method(C.Basic.Publish(routing_key="q"))
        + raw_frame(2, 1, header_payload)
        + body(b"phantom")
    )
    outcome = run_case(listener_a.port, vhosts["replicated"], data)
    assert (outcome.kind, outcome.code) == ("closed", code), outcome
    assert re.fullmatch(text, outcome.text), outcome
    assert listener_closes.take() == [(outcome.code, outcome.text)]
    published = [e for e in memory_sink(listener_a).events if isinstance(e, Published)]
    assert [e.body for e in published] == [], "a publish the broker refused reached the sink"
    assert listener_a.errors == []


@pytest.mark.parametrize("kind", ["replicated", "unreplicated"])
@pytest.mark.parametrize(
    "stamp",
    [1_700_000_000, 1_700_000_000_000, 1_700_000_000_000_000, 2**63],
    ids=["seconds", "milliseconds", "microseconds", "2**63"],
)
def test_header_timestamp_of_any_magnitude_is_relayed(
    kind: str,
    stamp: int,
    vhosts: dict[str, str],
    listener_a: ListenerThread,
    listener_closes: ListenerCloses,
) -> None:
    """An AMQP timestamp is any unsigned 64-bit value, and RabbitMQ accepts a
    persistent publish with one in its headers whatever it holds (a client
    writing microseconds since the epoch, say). pamqp reads a value above
    2**32 as milliseconds and raises ValueError past year 9999, so a listener
    that decodes the headers with pamqp must not turn that into a refusal of a
    valid message."""
    table = b"\x01tT" + struct.pack(">Q", stamp)
    data = (
        method(C.Basic.Publish(routing_key="q"))
        + raw_frame(
            2,
            1,
            struct.pack(">HHQH", 60, 0, 2, 0x2000 | 0x1000)
            + struct.pack(">I", len(table))
            + table
            + b"\x02",
        )
        + body(b"ts")
    )
    outcome = run_case(listener_a.port, vhosts[kind], data)
    assert listener_a.errors == [], listener_a.errors[0].get("exception")
    assert outcome.kind == "usable", outcome
    assert listener_closes.take() == []


def test_properties_only_the_replicated_path_decodes(
    vhosts: dict[str, str], listener_a: ListenerThread, listener_closes: ListenerCloses
) -> None:
    """On a replicated vhost the listener parses the properties of a persistent
    publish (it splices the replication id into them) and refuses bad ones with
    502; on a plain vhost the header is relayed and RabbitMQ decides."""
    for case in PROPERTY_CASES:
        outcome = run_case(listener_a.port, vhosts["replicated"], case.data)
        assert (outcome.kind, outcome.code) == ("closed", case.code), (case.name, outcome)
        assert re.fullmatch(case.text, outcome.text), (case.name, outcome)
        assert listener_closes.take() == [(outcome.code, outcome.text)]
        assert outcome.close_seconds < FAST_CLOSE

        with RawAMQP(listener_a.port) as client:
            client.handshake(vhosts["unreplicated"])
            client.send(case.data)
            outcome = client.outcome()
        assert (outcome.kind, outcome.code) == ("closed", case.broker[0]), (case.name, outcome)
        assert re.fullmatch(case.broker[1], outcome.text), (case.name, outcome)
        assert listener_closes.take() == [], (case.name, outcome)
    assert listener_a.errors == []


@pytest.mark.parametrize("kind", ["replicated", "unreplicated"])
def test_valid_edge_cases_are_relayed(
    kind: str,
    vhosts: dict[str, str],
    listener_a: ListenerThread,
    listener_closes: ListenerCloses,
) -> None:
    """What is legal must not be refused: a frame of exactly frame-max, an
    empty body, a body in many frames, a heartbeat on channel 0."""
    body_max = FRAME_MAX - 8
    legal = {
        "frame of exactly frame-max": method(C.Basic.Publish(routing_key="q"))
        + content_header(body_max, delivery_mode=2)
        + body(bytes(body_max)),
        "empty body": publish(b"", delivery_mode=2),
        "body in one-byte frames": method(C.Basic.Publish(routing_key="q"))
        + content_header(5, delivery_mode=2)
        + b"".join(body(bytes([c])) for c in b"12345"),
        "heartbeat on channel 0": raw_frame(8, 0, b""),
    }
    for name, data in legal.items():
        outcome = run_case(listener_a.port, vhosts[kind], data)
        assert outcome.kind == "usable", (name, outcome)
        assert listener_closes.take() == [], name
    assert listener_a.errors == []


def test_protocol_header_in_pieces_then_a_normal_session(
    vhosts: dict[str, str], listener_a: ListenerThread
) -> None:
    with RawAMQP(listener_a.port) as client:
        for octet in PROTOCOL_HEADER:
            client.send(bytes([octet]))
            time.sleep(0.005)
        client.expect(C.Connection.Start)
        client.sock.close()
    with RawAMQP(listener_a.port) as client:
        client.handshake(vhosts["replicated"])
        assert client.send_and_settle(b"").kind == "usable"
    assert listener_a.errors == []


@pytest.mark.parametrize(
    "garbage",
    [b"AMQP\x01\x01\x00\x09", b"AMQP\x00\x00\x09\x00", b"HTTP/1.1 GET /\r\n\r\n", bytes(8)],
)
def test_wrong_protocol_header_gets_ours_then_eof(
    garbage: bytes, listener_a: ListenerThread
) -> None:
    """AMQP 0-9-1 section 4.2.2: the server answers with the header it speaks
    and closes the socket."""
    with RawAMQP(listener_a.port) as client:
        client.send(garbage)
        assert client.read_raw(16) == PROTOCOL_HEADER  # then EOF: no more bytes
    assert listener_a.errors == []


# ---------------------------------------------------------------- hypothesis

#: (class id, method id) of every AMQP 0-9-1 method, for plausible frames
KNOWN_IDS = sorted((i >> 16, i & 0xFFFF) for i in C.INDEX_MAPPING)

short_names = st.sampled_from(["", "q", "work", "amq.direct", "amq.topic", "nope", "fuzz.x"])
#: queues a fuzzed purge or delete may hit (not those other clients rely on)
scratch_names = st.sampled_from(["fuzz.x", "nope"])
channels = st.one_of(st.sampled_from([0, 1, 2, PROBE_CHANNEL - 1]), st.integers(0, 65535))
channels_not_0 = st.one_of(st.sampled_from([1, 2, PROBE_CHANNEL - 1]), st.integers(1, 65535))
frame_types = st.one_of(st.sampled_from([1, 2, 3, 8]), st.integers(0, 255))
method_ids = st.one_of(
    st.sampled_from(KNOWN_IDS), st.tuples(st.integers(0, 65535), st.integers(0, 65535))
)
header_values = st.one_of(
    st.text(max_size=8), st.integers(-(2**31), 2**31 - 1), st.booleans(), st.none()
)


channel_methods = st.one_of(
    st.builds(
        C.Basic.Publish, exchange=short_names, routing_key=short_names, mandatory=st.booleans()
    ),
    st.builds(C.Basic.Ack, delivery_tag=st.integers(0, 2**63 - 1), multiple=st.booleans()),
    st.builds(C.Basic.Nack, delivery_tag=st.integers(0, 2**63 - 1), requeue=st.booleans()),
    st.builds(C.Basic.Reject, delivery_tag=st.integers(0, 2**63 - 1), requeue=st.booleans()),
    st.builds(C.Basic.Get, queue=short_names, no_ack=st.booleans()),
    st.builds(C.Basic.Consume, queue=short_names, nowait=st.booleans()),
    st.builds(C.Queue.Declare, queue=short_names, exclusive=st.just(True), nowait=st.booleans()),
    st.builds(
        C.Queue.Bind, queue=short_names, exchange=st.just("amq.topic"), routing_key=st.just("#")
    ),
    st.builds(C.Basic.Qos, prefetch_count=st.integers(0, 65535)),
    st.sampled_from([C.Confirm.Select(), C.Tx.Select(), C.Tx.Commit(), C.Tx.Rollback()]),
    # nowait or not, refused or not (another connection's exclusive queue, a
    # queue that does not exist): the listener turns nowait ones synchronous
    st.builds(C.Queue.Purge, queue=scratch_names, nowait=st.booleans()),
    st.builds(
        C.Queue.Delete,
        queue=scratch_names,
        if_unused=st.booleans(),
        if_empty=st.booleans(),
        nowait=st.booleans(),
    ),
)


@st.composite
def valid_frames(draw: st.DrawFn) -> tuple[int, int, bytes]:
    """(type, channel, payload) of a well-formed frame a client may send."""
    ch = draw(st.sampled_from([1, 1, 1, 2]))
    kind = draw(
        st.sampled_from(["method"] * 4 + ["header", "body", "heartbeat", "channel", "close"])
    )
    if kind == "method":
        return 1, ch, payload_of(draw(channel_methods))
    if kind == "header":
        props = C.Basic.Properties(
            delivery_mode=draw(st.sampled_from([None, 1, 2])),
            content_type=draw(st.sampled_from([None, "text/plain"])),
            headers=draw(
                st.none()
                | st.dictionaries(st.sampled_from(["CC", "BCC", "a", "x"]), header_values).map(
                    lambda d: cast(dict[str, Any], d)
                )
            ),
        )
        size = draw(st.one_of(st.integers(0, 16), st.integers(0, 2**64 - 1)))
        return (
            2,
            ch,
            frame.marshal(header.ContentHeader(body_size=size, properties=props), ch)[7:-1],
        )
    if kind == "body":
        return 3, ch, draw(st.binary(max_size=32))
    if kind == "heartbeat":
        return 8, 0, b""
    if kind == "channel":
        m = draw(
            st.sampled_from(
                [C.Channel.Open(), C.Channel.Close(reply_code=200, class_id=0, method_id=0)]
            )
        )
        return 1, draw(channels_not_0), payload_of(m)
    close = C.Connection.Close(reply_code=200, reply_text="fuzz", class_id=0, method_id=0)
    return 1, 0, payload_of(close)


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    ftype, ch, payload = draw(valid_frames())
    size: int | None = None
    end = b"\xce"
    mutation = draw(
        st.sampled_from(["none", "none", "type", "channel", "size", "payload", "ids", "end"])
    )
    if mutation == "type":
        ftype = draw(frame_types)
    elif mutation == "channel":
        ch = draw(channels)
    elif mutation == "size":
        size = draw(
            st.one_of(
                st.integers(0, len(payload) + 8),
                st.sampled_from([FRAME_MAX - 8, FRAME_MAX - 7, 2**32 - 1]),
                st.integers(0, 2**32 - 1),
            )
        )
    elif mutation == "payload":
        how = draw(st.sampled_from(["truncate", "flip", "extend"]))
        if how == "truncate" or not payload:
            payload = payload[: draw(st.integers(0, len(payload)))]
        elif how == "flip":
            i = draw(st.integers(0, len(payload) - 1))
            payload = payload[:i] + bytes([draw(st.integers(0, 255))]) + payload[i + 1 :]
        else:
            payload += draw(st.binary(min_size=1, max_size=16))
    elif mutation == "ids":
        ftype = 1
        payload = struct.pack(">HH", *draw(method_ids)) + payload[4:]
    elif mutation == "end":
        end = draw(st.sampled_from([b"", b"\xce\xce", b"\x00", b"\xcf"]))
    size = len(payload) if size is None else size
    return struct.pack(">BHI", ftype, ch, size) + payload + end


@st.composite
def truncated_publishes(draw: st.DrawFn) -> bytes:
    """publish + header + body (optionally persistent, optionally too long), cut."""
    data = draw(st.binary(max_size=40))
    declared = draw(st.sampled_from([len(data), len(data), max(len(data) - 1, 0), len(data) + 3]))
    whole = (
        method(C.Basic.Publish(routing_key=draw(short_names)))
        + content_header(declared, delivery_mode=draw(st.sampled_from([1, 2])))
        + (body(data) if data else b"")
    )
    cut = draw(st.integers(0, len(whole)))
    tail = draw(st.sampled_from([b"", method(C.Basic.Qos(prefetch_count=1)), body(b"z")]))
    return whole[:cut] + tail


def _longstr(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


#: AMQP field values, hand-encoded (pamqp cannot encode every type, nor junk)
_FIXED_FIELDS = {"t": 1, "b": 1, "B": 1, "s": 2, "u": 2, "I": 4, "i": 4, "f": 4}
_FIXED_FIELDS |= {"l": 8, "L": 8, "d": 8, "T": 8, "D": 5}
field_values = st.recursive(
    st.one_of(
        st.sampled_from(sorted(_FIXED_FIELDS)).flatmap(
            lambda t: st.binary(min_size=_FIXED_FIELDS[t], max_size=_FIXED_FIELDS[t]).map(
                lambda v: t.encode() + v
            )
        ),
        st.tuples(st.sampled_from([b"S", b"x"]), st.binary(max_size=12)).map(
            lambda tv: tv[0] + _longstr(tv[1])
        ),
        st.just(b"V"),
        st.binary(min_size=1, max_size=3),  # an unknown type, or a value cut short
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(lambda vs: b"A" + _longstr(b"".join(vs))),
        st.lists(st.tuples(st.sampled_from([b"a", b"k"]), inner), max_size=3).map(
            lambda kvs: b"F" + _longstr(b"".join(bytes([len(k)]) + k + v for k, v in kvs))
        ),
    ),
    max_leaves=6,
)
header_keys = st.sampled_from(
    [b"CC", b"BCC", b"a", b"k", b"x-match", REPLICATION_HEADER.encode(), b"\xff\xfe"]
)


@st.composite
def persistent_publishes(draw: st.DrawFn) -> bytes:
    """A persistent publish routed to the replicated queue q, whose content
    header carries random property flags and a random headers table: the path
    where the listener parses properties, routes by headers and splices."""
    entries = draw(st.lists(st.tuples(header_keys, field_values), max_size=4))
    table = b"".join(bytes([len(k)]) + k + v for k, v in entries)
    if draw(st.booleans()):
        table = table[: draw(st.integers(0, len(table)))]
    declared = draw(st.sampled_from([None, len(table), len(table) + 1]))
    flags = draw(st.sampled_from([0x3000, 0x3000, 0xB000, 0x7000])) | draw(
        st.sampled_from([0, 0, 0, 0x0800, 0x0001, draw(st.integers(0, 0xFFFF))])
    )
    props = b""
    if flags & 0x8000:
        props += b"\x0atext/plain"
    if flags & 0x4000:
        props += b"\x04gzip"
    if flags & 0x2000:
        props += struct.pack(">I", len(table) if declared is None else declared) + table
    if flags & 0x1000:
        props += bytes([draw(st.sampled_from([2, 2, 1, 0, 255]))])
    props += draw(st.binary(max_size=6))
    data = draw(st.binary(max_size=8))
    exchange = draw(st.sampled_from(["", "", "amq.headers"]))
    return (
        method(C.Basic.Publish(exchange=exchange, routing_key="q"))
        + raw_frame(2, 1, struct.pack(">HHQH", 60, 0, len(data), flags) + props)
        + (body(data) if data else b"")
    )


fuzz_streams = st.one_of(
    st.lists(mutated_frames(), min_size=1, max_size=5).map(b"".join),
    truncated_publishes(),
    persistent_publishes(),
)


#: random bytes, some behind a valid frame type (and channel) so that not every
#: example stops at the first octet
random_streams = st.tuples(
    st.sampled_from(
        [b"", b"", b"\x01", b"\x02", b"\x03", b"\x08", b"\x01\x00\x01", b"\x03\x00\x01"]
    ),
    st.binary(min_size=1, max_size=200),
).map(b"".join)


@pytest.mark.parametrize("kind", ["replicated", "unreplicated"])
@FUZZ_SETTINGS
@given(data=random_streams)
def test_fuzz_random_bytes_after_handshake(
    kind: str,
    data: bytes,
    vhosts: dict[str, str],
    listener_a: ListenerThread,
    listener_closes: ListenerCloses,
) -> None:
    outcome = run_case(listener_a.port, vhosts[kind], data)
    event(judge(outcome, data, listener_closes, listener_a, kind == "unreplicated"))


@pytest.mark.parametrize("kind", ["replicated", "unreplicated"])
@FUZZ_SETTINGS
@given(data=fuzz_streams, delivered=st.booleans())
def test_fuzz_plausible_frames_after_handshake(
    kind: str,
    data: bytes,
    delivered: bool,
    vhosts: dict[str, str],
    listener_a: ListenerThread,
    listener_closes: ListenerCloses,
) -> None:
    """``delivered``: an unacked delivery is pending (on the replicated vhost
    the listener then decodes acks, nacks and rejects)."""
    outcome = run_case(listener_a.port, vhosts[kind], data, _get_one_first if delivered else None)
    event(judge(outcome, data, listener_closes, listener_a, kind == "unreplicated"))


@FUZZ_SETTINGS
@given(
    garbage=st.one_of(
        st.binary(min_size=8, max_size=64),
        st.binary(min_size=0, max_size=8).map(lambda b: (PROTOCOL_HEADER[:4] + b + bytes(8))[:8]),
    ).filter(lambda g: g[:8] != PROTOCOL_HEADER)
)
def test_fuzz_garbage_instead_of_the_protocol_header(
    garbage: bytes, listener_a: ListenerThread
) -> None:
    with RawAMQP(listener_a.port) as client:
        client.send(garbage)
        assert client.read_raw(16) == PROTOCOL_HEADER
    assert listener_a.errors == []


# ---------------------------------------------------------------- carry on


class SteadyClient(threading.Thread):
    """A well-behaved pika client: confirmed publishes, then consume them back."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.published = 0
        self.consumed = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = pika.BlockingConnection(pika.URLParameters(self.url))
            try:
                self._loop(conn)
            finally:
                conn.close()
        except BaseException as e:  # reported by the test thread
            self.error = e

    def _loop(self, conn: pika.BlockingConnection) -> None:
        ch = conn.channel()
        ch.confirm_delivery()
        persistent = pika.BasicProperties(delivery_mode=2)
        while not self.stop.is_set():
            batch = [f"m{self.published + i}".encode() for i in range(10)]
            for b in batch:
                ch.basic_publish("", STEADY, b, persistent)  # raises unless confirmed
                self.published += 1
            got = []
            for m, _, b in ch.consume(STEADY, inactivity_timeout=TIMEOUT):
                assert m is not None, "a confirmed message did not come back"
                ch.basic_ack(m.delivery_tag)
                got.append(b)
                if len(got) == len(batch):
                    break
            ch.cancel()
            assert got == batch
            self.consumed += len(got)


class BrokerLog:
    """What RabbitMQ logged since this object was made."""

    def __init__(self, site: LocalSite) -> None:
        self.path = Path(site.rabbit.base, "log", f"{site.rabbit.nodename}.log")
        self.start = self.path.stat().st_size

    def since(self) -> str:
        with self.path.open("rb") as f:
            f.seek(self.start)
            return f.read().decode(errors="replace")


def assert_upstreams_closed(
    site: LocalSite, lt: ListenerThread, log: BrokerLog, orderly: int
) -> None:
    """No connection is left at the broker nor in the listener, RabbitMQ
    logged at least ``orderly`` AMQP closes, and no TCP connection closed
    under it without one."""
    deadline = time.monotonic() + TIMEOUT
    while (left := site.rabbit.api("GET", "connections")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], [(c["name"], c["vhost"]) for c in left]
    while lt.call(lambda: len(lt.listener.connections)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lt.call(lambda: len(lt.listener.connections)) == 0
    while (text := log.since()).count("closing AMQP connection") < orderly:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert text.count("closing AMQP connection") >= orderly, text[-3000:]
    assert "unexpectedly closed TCP connection" not in text, text[-3000:]


def test_listener_and_other_clients_carry_on(
    site_a: LocalSite,
    vhosts: dict[str, str],
    listener_a: ListenerThread,
    listener_closes: ListenerCloses,
) -> None:
    """While clients are fuzzed and closed, a pika client on the same listener
    keeps publishing with confirms and consuming, and replication goes on;
    afterwards a fresh connection works and no upstream connection is left."""
    vhost = vhosts["replicated"]
    log = BrokerLog(site_a)
    steady = SteadyClient(listener_a.url(vhost))
    steady.start()
    deadline = time.monotonic() + TIMEOUT
    while steady.consumed == 0 and steady.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert steady.consumed > 0, steady.error
    before = steady.published

    cases = [c for c in CASES if not c.residue]
    for _ in range(2):
        for case in cases:
            outcome = run_case(listener_a.port, vhost, case.data, _setup_for(case))
            assert (outcome.kind, outcome.code) == ("closed", case.code), (case.name, outcome)
            assert re.fullmatch(case.text, outcome.text), (case.name, outcome)
            assert outcome.close_seconds < FAST_CLOSE, (case.name, outcome)
    assert len(listener_closes.take()) == 2 * len(cases)

    @settings(FUZZ_SETTINGS, max_examples=40)
    @given(data=fuzz_streams)
    def fuzzed(data: bytes) -> None:
        judge(run_case(listener_a.port, vhost, data), data, listener_closes, listener_a, False)

    fuzzed()
    during = steady.published - before
    steady.stop.set()
    steady.join(TIMEOUT * 2)
    assert not steady.is_alive()
    assert steady.error is None, repr(steady.error)
    assert steady.consumed == steady.published and during >= 20, (during, steady.consumed)

    # replication went on for the good client
    sink = memory_sink(listener_a)
    published = [e for e in sink.events if isinstance(e, Published) and e.routing_key == STEADY]
    assert [e.body for e in published] == [f"m{i}".encode() for i in range(steady.published)]
    consumed = [e for e in sink.events if isinstance(e, Consumed) and e.queue == STEADY]
    assert sorted(e.repl_id.hex for e in consumed) == sorted(e.repl_id.hex for e in published)

    # a fresh connection works
    conn = pika.BlockingConnection(pika.URLParameters(listener_a.url(vhost)))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", STEADY, b"after", pika.BasicProperties(delivery_mode=2))
        _, _, got = ch.basic_get(STEADY, auto_ack=True)
        assert got == b"after"
    finally:
        conn.close()

    assert_upstreams_closed(site_a, listener_a, log, orderly=2 * len(cases) + 2)
    assert listener_a.errors == []
