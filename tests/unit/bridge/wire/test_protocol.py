"""The bridge wire protocol without sockets: codec, malformed frames, and the
connection state machine driven through the synchronisation procedure.

Frames are fed whole, byte by byte and in chunks that cut across frame
boundaries; malformed frames are built by hand with ``struct.pack``.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, strategies as st

from bridge import (
    ERROR_CODES,
    TOPOLOGY_OPS,
    BadChecksum,
    BadFrame,
    BridgeError,
    Consumed,
    DeadLettered,
    EventDecodeError,
    Fenced,
    Gap,
    LedgerEntry,
    LocalProtocolError,
    Mode,
    PeerFailure,
    Published,
    Purged,
    RemoteProtocolError,
    ReplicationId,
    Role,
    RoleConflict,
    StaleEpoch,
    SyncTimeoutPolicy,
    TopicFilter,
    TopologyChanged,
    Unauthorised,
    UnexpectedFrame,
    UnknownVpn,
    VersionMismatch,
    VpnSettings,
    decode_event,
    encode_event,
)
from bridge.wire import (
    CLOSED,
    CONNECTION_TRANSITIONS,
    FRAME_TYPES,
    MAGIC,
    NEED_DATA,
    PROTOCOL_VERSION,
    Ack,
    BridgeConnection,
    Checkpoint,
    CheckpointRow,
    ConnectionPhase,
    Error,
    Events,
    Frame,
    FrameReader,
    GetAllResources,
    Heartbeat,
    Hello,
    Repair,
    ResourceList,
    SyncAccepted,
    SyncFinished,
    SyncRequest,
    TxnApplied,
    TxnCommit,
    TxnOutcome,
    TxnPrepare,
    TxnQuery,
    TxnVote,
    VpnResource,
    VpnState,
    decode_frame,
)

ACTIVE_SITE, STANDBY_SITE = "nyc", "ldn"
VPN = "orders"


# ---------------------------------------------------------------- builders


def rid(n: int) -> ReplicationId:
    return ReplicationId.from_parts(7, n)


def published(n: int, vpn: str = VPN, body: bytes = b"hello") -> Published:
    return Published(vpn, rid(n), "amq.topic", "a.b", b"\x90\x00\x02", body, ("q1", "q2"))


def entries(first: int, last: int, epoch: int = 3, vpn: str = VPN) -> tuple[LedgerEntry, ...]:
    return tuple(LedgerEntry(vpn, epoch, i, published(i, vpn)) for i in range(first, last + 1))


def batch(first: int, last: int, epoch: int = 3, vpn: str = VPN) -> Events:
    return Events(vpn, epoch, entries(first, last, epoch, vpn))


def resource(
    name: str = VPN, epoch: int = 3, expose_id: bool = False, taken_over_at: int = 0
) -> VpnResource:
    return VpnResource(
        name,
        epoch,
        Mode.SYNC,
        2000,
        SyncTimeoutPolicy.REJECT,
        ("orders\\..*",),
        (TopicFilter("amq.topic", "eu.#"), TopicFilter("x:y", "*.z")),
        b'{"queues": [{"name": "orders.q1"}]}',
        expose_id,
        taken_over_at,
    )


def row(n: int, queue: str = "orders.q1") -> CheckpointRow:
    return CheckpointRow(queue, rid(n), n, "amq.direct", queue, b"\x00\x00", b"m%d" % n)


SAMPLES: list[Frame] = [
    Hello(STANDBY_SITE, PROTOCOL_VERSION, Role.STANDBY),
    Hello("zürich-ä", 7, Role.ACTIVE),
    GetAllResources(),
    ResourceList(()),
    ResourceList((resource(), resource("billing", 9, expose_id=True, taken_over_at=2**40))),
    SyncRequest(VPN, 3, 0, 0),
    SyncRequest(VPN, 3, 1042, 2),
    SyncRequest(VPN, 3, 1042, 2, "zürich-ä", 2**40),
    SyncRequest(VPN, 3, 0, 0, "b"),
    SyncAccepted(VPN, 3, 1043),
    Checkpoint(VPN, 3, 0, (), True),
    Checkpoint(VPN, 3, 50, (row(1), row(2, "orders.q2"), row(50)), False),
    SyncFinished(VPN, 3, 1042),
    batch(1, 1),
    Events(
        VPN,
        4,
        (
            LedgerEntry(VPN, 3, 9, published(9, body=b"")),
            LedgerEntry(VPN, 4, 10, Consumed(VPN, rid(9), "q1")),
        ),
    ),
    Ack(VPN, 3, 0),
    Ack(VPN, 3, 2**64 - 1),
    Heartbeat(),
    Error(StaleEpoch.code, VPN, "epoch 2 is stale"),
    Error(BadFrame.code, "", ""),
    TxnPrepare(VPN, 3, "7.1.1.1", b"\x00\x00\x00\x01P"),
    TxnVote(VPN, 3, "7.1.1.1", True),
    TxnOutcome(VPN, 3, "7.1.1.1", False),
    TxnQuery(VPN, 3, ("7.1.1.1", "7.2.1.5")),
    TxnCommit(VPN, 3, "7.1.1.1", 2**64 - 1),
    TxnApplied(VPN, 3, "7.1.1.1", True),
    TxnApplied(VPN, 3, "7.1.1.1", False),
    Repair(VPN, 3, (row(4), row(5, "orders.q2")), (("orders.q1", rid(6)),)),
    Repair(VPN, 3, (), (("orders.q1", rid(7)),)),
]


def stream_of(frames: list[Frame]) -> bytes:
    return b"".join(f.encode() for f in frames)


def whole(data: bytes) -> Iterator[bytes]:
    yield data


def bytewise(data: bytes) -> Iterator[bytes]:
    for i in range(len(data)):
        yield data[i : i + 1]


def odd_chunks(data: bytes) -> Iterator[bytes]:
    """Chunks of 7 bytes: each one that ends a frame carries the next one's start."""
    for i in range(0, len(data), 7):
        yield data[i : i + 7]


CHUNKERS = [whole, bytewise, odd_chunks]


def phase(conn: BridgeConnection) -> ConnectionPhase:
    """Read the phase through a call, so mypy does not narrow it for good."""
    return conn.phase


def drain(conn: BridgeConnection) -> list[Frame]:
    out: list[Frame] = []
    while (event := conn.next_event()) is not NEED_DATA and event is not CLOSED:
        out.append(event)
    return out


# ---------------------------------------------------------------- codec


def test_samples_cover_every_frame_type() -> None:
    assert {type(f) for f in SAMPLES} == set(FRAME_TYPES.values())


@pytest.mark.parametrize("frame", SAMPLES, ids=lambda f: type(f).__name__)
def test_every_frame_type_round_trips(frame) -> None:
    data = frame.encode()
    assert decode_frame(data) == (frame, len(data))
    assert type(frame).decode(data) == frame
    assert decode_frame(data[:-1]) is None


def test_frame_layout_is_header_payload_crc() -> None:
    data = Ack(VPN, 3, 5).encode()
    payload = struct.pack(">H", len(VPN)) + VPN.encode() + struct.pack(">QQ", 3, 5)
    header = struct.pack(">BBBBI", MAGIC, PROTOCOL_VERSION, Ack.TYPE, 0, len(payload))
    assert data == header + payload + struct.pack(">I", zlib.crc32(header + payload))


def test_a_purge_event_decodes_back_and_a_damaged_one_is_refused() -> None:
    event = Purged("v", "q.ü", (rid(1), rid(2)), deleted=True)
    good = encode_event(event)
    assert decode_event(good, "v") == event
    assert decode_event(encode_event(Purged("v", "q")), "v") == Purged("v", "q", (), False)
    at = Purged("v", "q", (rid(1),), sent_at=2**40)
    assert encode_event(at) == encode_event(at._replace(sent_at=0)) + struct.pack(">Q", 2**40)
    assert decode_event(encode_event(at), "v") == at
    with pytest.raises(EventDecodeError, match="purge flag"):
        decode_event(b"Q\x07" + good[2:], "v")
    with pytest.raises(EventDecodeError, match="truncated"):
        decode_event(good + b"x", "v")  # a purge point cut short
    with pytest.raises(EventDecodeError, match="bytes after the event"):
        decode_event(good + struct.pack(">Q", 5) + b"x", "v")
    with pytest.raises(EventDecodeError, match="truncated"):
        decode_event(good[:-1], "v")


def test_a_topology_event_decodes_back_and_a_damaged_one_is_refused() -> None:
    event = TopologyChanged("v", "bind", '{"source":"x.ü"}')
    good = encode_event(event)
    assert good[:2] == b"T\x05" and decode_event(good, "v") == event
    with pytest.raises(EventDecodeError, match="unknown topology operation 9"):
        decode_event(b"T\x09" + good[2:], "v")
    with pytest.raises(EventDecodeError, match="not UTF-8"):
        decode_event(good[:6] + b"\xff" + good[7:], "v")
    with pytest.raises(EventDecodeError, match="bytes after the event"):
        decode_event(good + b"x", "v")
    with pytest.raises(EventDecodeError, match="truncated"):
        decode_event(good[:-1], "v")


def test_decode_refuses_a_frame_of_another_type() -> None:
    with pytest.raises(BadFrame, match="not exactly one Ack"):
        Ack.decode(Heartbeat().encode())
    with pytest.raises(BadFrame, match="not exactly one Heartbeat"):
        Heartbeat.decode(Heartbeat().encode() + b"\x00")


@pytest.mark.parametrize("chunker", CHUNKERS)
def test_reader_gets_the_same_frames_however_the_stream_is_cut(chunker) -> None:
    reader = FrameReader()
    got = []
    for chunk in chunker(stream_of(SAMPLES)):
        reader.feed(chunk)
        while (frame := reader.next_frame()) is not None:
            got.append(frame)
    assert got == SAMPLES
    assert reader.pending == 0


def test_reader_keeps_the_start_of_the_next_frame() -> None:
    first, second = Ack(VPN, 3, 1).encode(), Heartbeat().encode()
    reader = FrameReader()
    reader.feed(first + second[:5])
    assert reader.next_frame() == Ack(VPN, 3, 1)
    assert reader.next_frame() is None
    assert reader.pending == 5
    reader.feed(second[5:])
    assert reader.next_frame() == Heartbeat()
    assert reader.pending == 0


def test_vpn_resource_from_settings() -> None:
    settings = VpnSettings.from_args(VPN, "active", "sync", 500, "reject", ("q.*",), ("x:a.*",))
    got = VpnResource.from_settings(settings, 4, b"{}")
    assert got == VpnResource(
        VPN,
        4,
        Mode.SYNC,
        500,
        SyncTimeoutPolicy.REJECT,
        ("q.*",),
        (TopicFilter("x", "a.*"),),
        b"{}",
    )


@pytest.mark.parametrize(
    "build",
    [
        lambda: Events(VPN, 3, ()),
        lambda: Events(VPN, 3, (entries(1, 1)[0], entries(3, 3)[0])),
        lambda: Events(VPN, 3, entries(1, 2, vpn="billing")),
        lambda: Events(VPN, 2, entries(1, 2, epoch=3)),
        lambda: Events(VPN, 3, (entries(1, 1, 3)[0], entries(2, 2, 2)[0])),
        lambda: SyncRequest(VPN, 3, 5, 4),
        lambda: SyncRequest(VPN, 3, 5, 0),
        lambda: SyncRequest("", 3, 0, 0),
        lambda: SyncAccepted(VPN, 3, 0),
        lambda: Ack(VPN, 0, 1),
        lambda: Ack(VPN, 1, 2**64),
        lambda: Hello("\ud800", 1, Role.ACTIVE),
        lambda: Hello("x" * 70000, 1, Role.ACTIVE),
        lambda: Hello("x", 1, "leader"),  # type: ignore[arg-type]
        lambda: Checkpoint(VPN, 3, 5, (row(6),), True),
        lambda: ResourceList((resource(), resource())),
        lambda: VpnResource(VPN, 1, "sometimes", 0, "degrade", (), (), b""),  # type: ignore[arg-type]
    ],
)
def test_constructors_refuse_what_cannot_be_sent(build: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        build()


# ---------------------------------------------------------------- hypothesis

texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=20)  # no lone surrogates
names = texts.filter(bool)
repl_ids = st.binary(min_size=16, max_size=16).map(ReplicationId)
u64 = st.integers(0, 2**64 - 1)


def events_of(vpn: str) -> st.SearchStrategy:
    return st.one_of(
        st.builds(
            Published,
            st.just(vpn),
            repl_ids,
            texts,
            texts,
            st.binary(max_size=40),
            st.binary(max_size=200),
            st.lists(texts, max_size=4).map(tuple),
        ),
        st.builds(Consumed, st.just(vpn), repl_ids, texts),
        st.builds(
            Purged,
            st.just(vpn),
            texts,
            st.lists(repl_ids, max_size=3).map(tuple),
            st.booleans(),
            st.integers(0, 2**64 - 1),
        ),
        st.builds(
            DeadLettered, st.just(vpn), repl_ids, texts, st.lists(texts, max_size=3).map(tuple)
        ),
        st.builds(TopologyChanged, st.just(vpn), st.sampled_from(TOPOLOGY_OPS), texts),
    )


@st.composite
def events_frames(draw) -> Events:
    vpn = draw(names)
    n = draw(st.integers(1, 8))
    first = draw(st.integers(1, 2**64 - 1 - n))
    epochs = sorted(draw(st.lists(st.integers(1, 2**40), min_size=n, max_size=n)))
    frame_epoch = draw(st.integers(epochs[-1], 2**64 - 1))
    evs = draw(st.lists(events_of(vpn), min_size=n, max_size=n))
    items = zip(epochs, evs, strict=True)
    return Events(
        vpn,
        frame_epoch,
        tuple(LedgerEntry(vpn, e, first + i, ev) for i, (e, ev) in enumerate(items)),
    )


@st.composite
def checkpoints(draw) -> Checkpoint:
    index = draw(st.integers(1, 2**64 - 1))
    rows = draw(
        st.lists(
            st.builds(
                CheckpointRow,
                names,
                repl_ids,
                st.integers(1, index),
                texts,
                texts,
                st.binary(max_size=30),
                st.binary(max_size=100),
            ),
            max_size=5,
        )
    )
    return Checkpoint(
        draw(names), draw(st.integers(1, 2**64 - 1)), index, tuple(rows), draw(st.booleans())
    )


resources = st.builds(
    VpnResource,
    names,
    st.integers(1, 2**64 - 1),
    st.sampled_from(Mode),
    st.integers(0, 2**32 - 1),
    st.sampled_from(SyncTimeoutPolicy),
    st.lists(names, max_size=3).map(tuple),
    st.lists(st.builds(TopicFilter, texts, names), max_size=3).map(tuple),
    st.binary(max_size=100),
    st.booleans(),
    u64,
    st.none() | st.integers(0, 2**64 - 2),
)

frames = st.one_of(
    st.builds(
        Hello, names, st.integers(0, 2**16 - 1), st.sampled_from(Role), st.integers(0, 2**32 - 1)
    ),
    st.just(GetAllResources()),
    st.lists(resources, max_size=4, unique_by=lambda r: r.name).map(
        lambda r: ResourceList(tuple(r))
    ),
    st.builds(SyncAccepted, names, st.integers(1, 2**64 - 1), st.integers(1, 2**64 - 1)),
    st.builds(SyncFinished, names, st.integers(1, 2**64 - 1), u64),
    st.builds(Ack, names, st.integers(1, 2**64 - 1), u64),
    st.just(Heartbeat()),
    st.builds(Error, st.integers(0, 2**16 - 1), texts, texts),
    events_frames(),
    checkpoints(),
)


@given(events_frames())
def test_random_events_round_trip(frame: Events) -> None:
    data = frame.encode()
    assert decode_frame(data) == (frame, len(data))
    assert [e.event for e in Events.decode(data).entries] == [e.event for e in frame.entries]


@given(checkpoints())
def test_random_checkpoints_round_trip(frame: Checkpoint) -> None:
    assert Checkpoint.decode(frame.encode()) == frame


@given(st.lists(frames, min_size=1, max_size=6), st.lists(st.integers(1, 64), min_size=1))
def test_random_frames_survive_any_cut(sent: list[Frame], cuts: list[int]) -> None:
    data = stream_of(sent)
    reader, got, pos, i = FrameReader(), [], 0, 0
    while pos < len(data):
        step = cuts[i % len(cuts)]
        reader.feed(data[pos : pos + step])
        pos, i = pos + step, i + 1
        while (frame := reader.next_frame()) is not None:
            got.append(frame)
    assert got == sent


# ---------------------------------------------------------------- malformed frames


def raw(
    ftype: int,
    payload: bytes,
    *,
    magic: int = MAGIC,
    version: int = PROTOCOL_VERSION,
    flags: int = 0,
    crc: int | None = None,
) -> bytes:
    header = struct.pack(">BBBBI", magic, version, ftype, flags, len(payload))
    if crc is None:
        crc = zlib.crc32(header + payload)
    return header + payload + struct.pack(">I", crc)


def s16(data: bytes) -> bytes:
    return struct.pack(">H", len(data)) + data


GOOD_ACK = Ack(VPN, 3, 5).encode()
MALFORMED = [
    ("bad checksum", GOOD_ACK[:-4] + struct.pack(">I", 0xDEADBEEF), BadChecksum, "checksum"),
    ("flipped payload bit", GOOD_ACK[:9] + b"\x7f" + GOOD_ACK[10:], BadChecksum, "checksum"),
    (
        "oversize length",
        struct.pack(">BBBBI", MAGIC, PROTOCOL_VERSION, 9, 0, 2**32 - 1),
        BadFrame,
        "limit",
    ),
    ("unknown type", raw(99, b""), BadFrame, "unknown frame type 99"),
    ("type zero", raw(0, b""), BadFrame, "unknown frame type 0"),
    ("bad magic", b"GET / HTTP/1.1\r\n\r\n", BadFrame, "magic"),
    ("tls client hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", BadFrame, "magic"),
    ("other version", raw(Ack.TYPE, b"", version=9), VersionMismatch, "version 9"),
    ("unknown flags", raw(Heartbeat.TYPE, b"", flags=1), BadFrame, "flags"),
    ("truncated string", raw(Hello.TYPE, struct.pack(">H", 10) + b"abc"), BadFrame, "truncated"),
    ("truncated integer", raw(Ack.TYPE, s16(b"orders") + b"\x00" * 9), BadFrame, "truncated"),
    ("bad utf-8", raw(Hello.TYPE, s16(b"\xff\xfe") + b"\x00\x01\x02"), BadFrame, "UTF-8"),
    ("trailing payload", raw(Heartbeat.TYPE, b"\x00"), BadFrame, "1 bytes after"),
    ("unknown role", raw(Hello.TYPE, s16(b"nyc") + b"\x00\x01\x07"), BadFrame, "role"),
    (
        "flag not 0/1",
        raw(Checkpoint.TYPE, s16(b"o") + struct.pack(">QQB", 1, 0, 2) + b"\x00" * 4),
        BadFrame,
        "last must be 0 or 1",
    ),
    (
        "undecodable event",
        raw(Events.TYPE, s16(b"o") + struct.pack(">QQIQI", 1, 1, 1, 1, 1) + b"Z"),
        BadFrame,
        "Events",
    ),
    (
        "value out of range",
        raw(SyncAccepted.TYPE, s16(b"o") + struct.pack(">QQ", 1, 0)),
        BadFrame,
        "from_index",
    ),
    (
        "empty events",
        raw(Events.TYPE, s16(b"o") + struct.pack(">QQI", 1, 1, 0)),
        BadFrame,
        "at least one",
    ),
    (
        "vpn listed twice",
        raw(ResourceList.TYPE, struct.pack(">I", 2) + resource().payload() * 2),
        BadFrame,
        "twice",
    ),
]


@pytest.mark.parametrize(
    ("name", "data", "error", "text"), MALFORMED, ids=[m[0] for m in MALFORMED]
)
def test_malformed_frames_raise_their_own_class(name, data, error, text) -> None:
    with pytest.raises(error, match=text) as info:
        decode_frame(data)
    assert type(info.value) is error
    assert info.value.closes_connection


@pytest.mark.parametrize(
    ("name", "data", "error", "text"), MALFORMED, ids=[m[0] for m in MALFORMED]
)
def test_malformed_frames_fail_the_connection(name, data, error, text) -> None:
    active = BridgeConnection(Role.ACTIVE, ACTIVE_SITE)
    active.receive_data(data)
    with pytest.raises(error):
        active.next_event()
    assert phase(active) is ConnectionPhase.FAILED
    with pytest.raises(RemoteProtocolError, match="already failed"):
        active.next_event()
    with pytest.raises(LocalProtocolError, match="only a connection-level Error"):
        active.send(Heartbeat())
    report = Error.from_exception(error("x"))
    assert Error.decode(active.send(report)).code == error.code
    assert phase(active) is ConnectionPhase.CLOSED
    assert active.next_event() is CLOSED


def test_oversize_is_refused_from_the_header_alone() -> None:
    conn = BridgeConnection(Role.ACTIVE, ACTIVE_SITE, max_frame_size=1024)
    conn.receive_data(struct.pack(">BBBBI", MAGIC, PROTOCOL_VERSION, Events.TYPE, 0, 1025))
    with pytest.raises(BadFrame, match="1025-byte frame exceeds the 1024-byte limit"):
        conn.next_event()


def test_a_frame_at_the_limit_is_accepted() -> None:
    frame = Hello(STANDBY_SITE, PROTOCOL_VERSION, Role.STANDBY)
    size = len(frame.encode()) - 12
    conn = BridgeConnection(Role.ACTIVE, ACTIVE_SITE, max_frame_size=size)
    conn.receive_data(frame.encode())
    assert conn.next_event() == frame


def test_send_refuses_a_frame_over_the_limit() -> None:
    pair = Pair(max_frame_size=256)
    pair.sync(from_index=1)
    big = Events(VPN, 3, (LedgerEntry(VPN, 3, 1, published(1, body=b"x" * 300)),))
    with pytest.raises(LocalProtocolError, match="frame limit"):
        pair.active.send(big)
    assert pair.active.next_index(VPN) == 1


def test_end_of_stream_between_frames_closes() -> None:
    conn = BridgeConnection(Role.ACTIVE, ACTIVE_SITE)
    conn.receive_data(Hello(STANDBY_SITE, PROTOCOL_VERSION, Role.STANDBY).encode())
    conn.receive_data(b"")
    assert isinstance(conn.next_event(), Hello)
    assert conn.next_event() is CLOSED
    assert phase(conn) is ConnectionPhase.CLOSED
    with pytest.raises(LocalProtocolError, match="after the end"):
        conn.receive_data(b"more")
    with pytest.raises(LocalProtocolError, match="closed"):
        conn.send(Heartbeat())


def test_end_of_stream_inside_a_frame_is_a_truncated_frame() -> None:
    conn = BridgeConnection(Role.ACTIVE, ACTIVE_SITE)
    hello = Hello(STANDBY_SITE, PROTOCOL_VERSION, Role.STANDBY).encode()
    conn.receive_data(hello[:-1])
    assert conn.next_event() is NEED_DATA
    conn.receive_data(b"")
    with pytest.raises(BadFrame, match=f"closed the stream {len(hello) - 1} bytes into a frame"):
        conn.next_event()


# ---------------------------------------------------------------- the state machine


class Pair:
    """A standby-side and an active-side connection and the wire between them."""

    def __init__(self, standby_epochs=None, **kwargs) -> None:
        self.standby = BridgeConnection(
            Role.STANDBY, STANDBY_SITE, known_epochs=standby_epochs, **kwargs
        )
        self.active = BridgeConnection(Role.ACTIVE, ACTIVE_SITE, **kwargs)
        self.to_standby = b""
        self.to_active = b""

    def a(self, *frames) -> None:
        """The active sends; the bytes wait on the wire."""
        self.to_standby += b"".join(self.active.send(f) for f in frames)

    def s(self, *frames) -> None:
        self.to_active += b"".join(self.standby.send(f) for f in frames)

    def at_standby(self, chunker=whole) -> list[Frame]:
        """Deliver everything on the wire to the standby, in chunks."""
        data, self.to_standby = self.to_standby, b""
        got = []
        for chunk in chunker(data):
            self.standby.receive_data(chunk)
            got += drain(self.standby)
        return got

    def at_active(self, chunker=whole) -> list[Frame]:
        data, self.to_active = self.to_active, b""
        got = []
        for chunk in chunker(data):
            self.active.receive_data(chunk)
            got += drain(self.active)
        return got

    def handshake(self, *vpns: VpnResource) -> None:
        self.s(Hello(STANDBY_SITE, PROTOCOL_VERSION, Role.STANDBY))
        self.at_active()
        self.a(Hello(ACTIVE_SITE, PROTOCOL_VERSION, Role.ACTIVE))
        self.at_standby()
        self.s(GetAllResources())
        self.at_active()
        self.a(ResourceList(vpns or (resource(),)))
        self.at_standby()

    def sync(self, from_index: int, last_applied: int = 0, vpn: str = VPN, epoch: int = 3) -> None:
        """Bring ``vpn`` to LIVE with nothing replayed."""
        if phase(self.standby) is ConnectionPhase.START:
            self.handshake()
        self.s(SyncRequest(vpn, epoch, last_applied, 1 if last_applied else 0))
        self.at_active()
        self.a(SyncAccepted(vpn, epoch, from_index))
        if from_index != last_applied + 1:
            self.a(Checkpoint(vpn, epoch, from_index - 1, (), True))
        self.a(SyncFinished(vpn, epoch, from_index - 1))
        assert len(self.at_standby()) >= 2

    def states(self, vpn: str = VPN) -> tuple[VpnState | None, VpnState | None]:
        return self.standby.vpn_state(vpn), self.active.vpn_state(vpn)


@pytest.mark.parametrize("chunker", CHUNKERS)
def test_the_seed_synchronisation_procedure(chunker) -> None:
    pair = Pair()
    standby_hello = Hello(STANDBY_SITE, PROTOCOL_VERSION, Role.STANDBY)
    active_hello = Hello(ACTIVE_SITE, PROTOCOL_VERSION, Role.ACTIVE)

    # The standby dials and speaks first; the active answers.
    pair.s(standby_hello)
    assert pair.at_active(chunker) == [standby_hello]
    assert pair.active.peer_site == STANDBY_SITE and phase(pair.active) is ConnectionPhase.GREETING
    pair.a(active_hello)
    assert pair.at_standby(chunker) == [active_hello]
    assert pair.standby.peer_site == ACTIVE_SITE and phase(pair.standby) is ConnectionPhase.GREETED

    # 1-2. GET_ALL_RESOURCES, RESOURCE_LIST.
    pair.s(GetAllResources())
    assert pair.at_active(chunker) == [GetAllResources()]
    listing = ResourceList((resource(), resource("billing", 5)))
    pair.a(listing)
    assert pair.at_standby(chunker) == [listing]
    assert pair.standby.phase is phase(pair.active) is ConnectionPhase.READY
    assert pair.standby.resources["billing"].epoch == 5
    assert pair.states() == (VpnState.LISTED, VpnState.LISTED)

    # 4. SYNC_REQ with the last applied index.
    request = SyncRequest(VPN, 3, 2, 3)
    pair.s(request, Heartbeat())
    assert pair.at_active(chunker) == [request, Heartbeat()]
    assert pair.states() == (VpnState.SYNC_REQUESTED, VpnState.SYNC_REQUESTED)

    # 5. SYNC_REQ_ACCEPTED, the replay, SYNC_FINISHED; then live events.
    replay = [SyncAccepted(VPN, 3, 3), batch(3, 5), batch(6, 6), SyncFinished(VPN, 3, 6)]
    live = [batch(7, 9), Heartbeat()]
    pair.a(*replay, *live)
    assert pair.at_standby(chunker) == replay + live
    assert pair.states() == (VpnState.LIVE, VpnState.LIVE)
    assert pair.standby.next_index(VPN) == pair.active.next_index(VPN) == 10

    # Cumulative acknowledgements.
    pair.s(Ack(VPN, 3, 6), Ack(VPN, 3, 9))
    assert pair.at_active(chunker) == [Ack(VPN, 3, 6), Ack(VPN, 3, 9)]
    assert pair.states("billing") == (VpnState.LISTED, VpnState.LISTED)


def test_a_catch_up_may_be_acknowledged_before_it_finishes() -> None:
    pair = Pair()
    pair.handshake()
    pair.s(SyncRequest(VPN, 3, 0, 0))
    pair.at_active()
    pair.a(SyncAccepted(VPN, 3, 1), batch(1, 4))
    pair.at_standby()
    pair.s(Ack(VPN, 3, 4))
    assert pair.at_active() == [Ack(VPN, 3, 4)]
    assert pair.states() == (VpnState.CATCHING_UP, VpnState.CATCHING_UP)


@pytest.mark.parametrize(
    ("last_applied", "from_index"),
    [(10, 51), (100, 96), (0, 8)],
    ids=["behind the retained ledger", "diverged history", "empty standby"],
)
def test_a_checkpoint_precedes_a_replay_that_does_not_follow(last_applied, from_index) -> None:
    pair = Pair()
    pair.handshake()
    pair.s(SyncRequest(VPN, 3, last_applied, 1 if last_applied else 0))
    pair.at_active()
    pair.a(SyncAccepted(VPN, 3, from_index))
    at = from_index - 1
    # Nothing but the checkpoint: no events, no SyncFinished, no Ack.
    for early in (batch(from_index, from_index), SyncFinished(VPN, 3, at)):
        with pytest.raises(LocalProtocolError, match="before the checkpoint is complete"):
            pair.active.send(early)
    with pytest.raises(
        LocalProtocolError, match=f"at index {at + 1} for a replay from {from_index}"
    ):
        pair.active.send(Checkpoint(VPN, 3, at + 1, (), True))
    pair.at_standby()
    with pytest.raises(LocalProtocolError, match="before the checkpoint"):
        pair.standby.send(Ack(VPN, 3, at))

    chunks = [
        Checkpoint(VPN, 3, at, (row(1),), False),
        Checkpoint(VPN, 3, at, (), False),
        Checkpoint(VPN, 3, at, (row(at),), True),
    ]
    pair.a(*chunks, batch(from_index, from_index + 1), SyncFinished(VPN, 3, from_index + 1))
    assert pair.at_standby() == [
        *chunks,
        batch(from_index, from_index + 1),
        SyncFinished(VPN, 3, from_index + 1),
    ]
    assert pair.states() == (VpnState.LIVE, VpnState.LIVE)


def test_a_standby_refuses_events_before_the_checkpoint() -> None:
    pair = Pair()
    pair.handshake()
    pair.s(SyncRequest(VPN, 3, 10, 1))
    pair.at_active()
    pair.a(SyncAccepted(VPN, 3, 51))
    pair.at_standby()
    pair.standby.receive_data(batch(51, 52).encode())
    with pytest.raises(UnexpectedFrame, match="before the checkpoint is complete"):
        pair.standby.next_event()


def test_no_checkpoint_once_the_replay_began() -> None:
    pair = Pair()
    pair.handshake()
    pair.s(SyncRequest(VPN, 3, 4, 3))
    pair.at_active()
    pair.a(SyncAccepted(VPN, 3, 5), Checkpoint(VPN, 3, 4, (row(2),), True))  # optional, allowed
    with pytest.raises(LocalProtocolError, match="once the replay began or the checkpoint ended"):
        pair.active.send(Checkpoint(VPN, 3, 4, (), True))
    pair.a(batch(5, 5))
    with pytest.raises(LocalProtocolError, match="once the replay began"):
        pair.active.send(Checkpoint(VPN, 3, 4, (), True))


# ---------------------------------------------------------------- gaps and duplicates


def test_a_gap_raises_and_the_standby_resyncs_from_its_last_applied_index() -> None:
    pair = Pair()
    pair.sync(from_index=1)
    pair.a(batch(1, 3))
    pair.at_standby()
    pair.a(batch(4, 4))
    pair.to_standby = b""  # lost on the wire
    pair.a(batch(5, 6), batch(7, 7))
    pair.standby.receive_data(pair.to_standby)
    pair.to_standby = b""
    with pytest.raises(Gap, match="from index 5, expected 4") as info:
        pair.standby.next_event()
    assert (info.value.vpn, info.value.expected, info.value.got) == (VPN, 4, 5)
    assert not info.value.closes_connection
    # The rest of the broken stream is dropped; the connection lives on.
    assert pair.standby.next_event() is NEED_DATA
    assert pair.standby.vpn_state(VPN) is VpnState.DRAINING
    with pytest.raises(LocalProtocolError):
        pair.standby.send(Ack(VPN, 3, 3))

    # Resync from the last *applied* index (2: index 3 was received, not applied).
    pair.s(SyncRequest(VPN, 3, 2, 3))
    pair.a(batch(8, 9))  # crosses the request on the wire
    assert pair.at_standby() == []
    assert pair.states() == (VpnState.RESYNC_REQUESTED, VpnState.LIVE)
    pair.at_active()
    assert pair.active.vpn_state(VPN) is VpnState.RESYNC_REQUESTED
    with pytest.raises(LocalProtocolError, match="in state resync-requested"):
        pair.active.send(batch(10, 10))
    pair.a(SyncAccepted(VPN, 3, 3), batch(3, 9), SyncFinished(VPN, 3, 9))
    assert pair.at_standby() == [SyncAccepted(VPN, 3, 3), batch(3, 9), SyncFinished(VPN, 3, 9)]
    assert pair.states() == (VpnState.LIVE, VpnState.LIVE)


def test_a_gap_on_one_vpn_leaves_the_others_streaming() -> None:
    pair = Pair()
    pair.handshake(resource(), resource("billing"))
    pair.sync(from_index=1)
    pair.sync(from_index=1, vpn="billing")
    pair.standby.receive_data(batch(3, 3).encode() + batch(1, 1, vpn="billing").encode())
    with pytest.raises(Gap):
        pair.standby.next_event()
    assert pair.standby.next_event() == batch(1, 1, vpn="billing")
    assert pair.standby.vpn_state("billing") is VpnState.LIVE


def test_duplicates_are_dropped_silently() -> None:
    pair = Pair()
    pair.sync(from_index=1)
    pair.a(batch(1, 3))
    sent = pair.to_standby
    assert pair.at_standby() == [batch(1, 3)]
    pair.standby.receive_data(sent)  # the same batch again
    assert pair.standby.next_event() is NEED_DATA
    pair.standby.receive_data(batch(2, 5).encode())  # overlaps: only 4..5 are new
    assert pair.standby.next_event() == batch(4, 5)
    assert pair.standby.next_index(VPN) == 6


def test_the_active_may_not_skip_or_resend() -> None:
    pair = Pair()
    pair.sync(from_index=1)
    pair.a(batch(1, 3))
    with pytest.raises(LocalProtocolError, match="Events from 5, the stream is at 4"):
        pair.active.send(batch(5, 5))
    with pytest.raises(LocalProtocolError, match="Events from 3, the stream is at 4"):
        pair.active.send(batch(3, 4))
    assert pair.active.next_index(VPN) == 4


# ---------------------------------------------------------------- epochs and fencing


def test_a_standby_knowing_a_higher_epoch_fences_the_active() -> None:
    pair = Pair(standby_epochs={VPN: 4})
    pair.handshake(resource(epoch=3))  # a stale listing is not refused ...
    assert pair.standby.known_epoch(VPN) == 4
    with pytest.raises(Fenced):  # ... and the standby speaks the higher epoch
        pair.standby.send(SyncRequest(VPN, 3, 0, 0))
    pair.s(SyncRequest(VPN, 4, 0, 0))
    pair.at_active()
    assert pair.active.known_epoch(VPN) == 4  # the active learns it is fenced
    with pytest.raises(Fenced) as info:
        pair.active.send(SyncAccepted(VPN, 3, 1))
    assert isinstance(info.value, LocalProtocolError)
    pair.a(Error.from_exception(info.value))
    [refusal] = pair.at_standby()
    assert isinstance(refusal, Error)
    assert refusal == Error(
        StaleEpoch.code, VPN, "SyncAccepted carries epoch 3, but epoch 4 is known"
    )
    assert not refusal.closes_connection
    assert isinstance(refusal.exception(), StaleEpoch)
    assert pair.states() == (VpnState.LISTED, VpnState.LISTED)


def test_a_stale_frame_is_rejected_and_the_stream_abandoned() -> None:
    pair = Pair()
    pair.sync(from_index=1)
    pair.standby.receive_data(batch(1, 1, epoch=2).encode() + batch(2, 2, epoch=2).encode())
    with pytest.raises(StaleEpoch, match="epoch 2, but epoch 3") as info:
        pair.standby.next_event()
    assert (info.value.known, info.value.got, info.value.closes_connection) == (3, 2, False)
    assert pair.standby.next_event() is NEED_DATA  # the rest of that stream is dropped
    assert pair.standby.vpn_state(VPN) is VpnState.DRAINING
    pair.s(Error.from_exception(info.value))
    assert pair.at_active() == [
        Error(StaleEpoch.code, VPN, "Events carries epoch 2, but epoch 3 is known")
    ]
    assert pair.states() == (VpnState.DRAINING, VpnState.DRAINING)
    with pytest.raises(LocalProtocolError):
        pair.active.send(batch(1, 1))


def test_a_higher_epoch_is_accepted_and_recorded() -> None:
    pair = Pair()
    pair.sync(from_index=1)
    pair.a(batch(1, 1, epoch=4))
    assert pair.at_standby() == [batch(1, 1, epoch=4)]
    assert pair.standby.known_epoch(VPN) == pair.active.known_epoch(VPN) == 4
    with pytest.raises(Fenced):
        pair.active.send(batch(2, 2, epoch=3))
    with pytest.raises(Fenced):
        pair.standby.send(Ack(VPN, 3, 1))


def test_the_active_rejects_a_stale_ack() -> None:
    pair = Pair()
    pair.sync(from_index=1)
    pair.a(batch(1, 2, epoch=4))
    pair.at_standby()
    pair.active.receive_data(Ack(VPN, 3, 2).encode() + Ack(VPN, 4, 1).encode())
    with pytest.raises(StaleEpoch):
        pair.active.next_event()
    assert pair.active.next_event() == Ack(VPN, 4, 1)


def test_a_stale_sync_request_must_be_refused() -> None:
    pair = Pair(standby_epochs={VPN: 2})
    pair.handshake(resource(epoch=3))
    pair.active.receive_data(SyncRequest(VPN, 2, 0, 0).encode())
    with pytest.raises(StaleEpoch):
        pair.active.next_event()
    assert pair.active.vpn_state(VPN) is VpnState.SYNC_REQUESTED
    with pytest.raises(LocalProtocolError, match="rejected request"):
        pair.active.send(SyncAccepted(VPN, 3, 1))
    pair.active.send(Error(StaleEpoch.code, VPN, "resend with epoch 3"))
    assert pair.active.vpn_state(VPN) is VpnState.LISTED


# ---------------------------------------------------------------- illegal transitions

STAGES = ["start", "greeting", "greeted", "listed", "requested", "catching-up", "live"]


def at_stage(stage: str) -> Pair:
    pair = Pair()

    def greet() -> None:
        pair.s(Hello(STANDBY_SITE, PROTOCOL_VERSION, Role.STANDBY))
        pair.at_active()

    def answer() -> None:
        pair.a(Hello(ACTIVE_SITE, PROTOCOL_VERSION, Role.ACTIVE))
        pair.at_standby()

    def listing() -> None:
        pair.s(GetAllResources())
        pair.at_active()
        pair.a(ResourceList((resource(),)))
        pair.at_standby()

    def request() -> None:
        pair.s(SyncRequest(VPN, 3, 0, 0))
        pair.at_active()

    def accept() -> None:
        pair.a(SyncAccepted(VPN, 3, 1))
        pair.at_standby()

    def finish() -> None:
        pair.a(batch(1, 3), SyncFinished(VPN, 3, 3))
        pair.at_standby()

    steps = [greet, answer, listing, request, accept, finish]
    for step in steps[: STAGES.index(stage)]:
        step()
    return pair


ILLEGAL_SENDS = [
    ("start", "standby", GetAllResources(), "phase start"),
    ("start", "standby", Heartbeat(), "phase start"),
    ("start", "active", Hello(ACTIVE_SITE, PROTOCOL_VERSION, Role.ACTIVE), "phase start"),
    ("start", "active", Heartbeat(), "phase start"),
    ("greeting", "standby", Hello(STANDBY_SITE, PROTOCOL_VERSION, Role.STANDBY), "phase greeting"),
    ("greeting", "standby", GetAllResources(), "phase greeting"),
    ("greeting", "active", Heartbeat(), "phase greeting"),
    ("greeting", "active", Hello(ACTIVE_SITE, PROTOCOL_VERSION, Role.STANDBY), "this end is"),
    ("greeting", "active", Hello("elsewhere", PROTOCOL_VERSION, Role.ACTIVE), "this end is"),
    ("greeting", "active", Hello(ACTIVE_SITE, 9, Role.ACTIVE), "this end is"),
    ("greeted", "active", ResourceList(()), "phase greeted"),
    ("greeted", "standby", SyncRequest(VPN, 3, 0, 0), "not listed"),
    ("greeted", "active", GetAllResources(), "from the active"),
    ("listed", "standby", ResourceList(()), "from the standby"),
    ("listed", "standby", Ack(VPN, 3, 0), "in state listed"),
    ("listed", "standby", SyncRequest("billing", 3, 0, 0), "not listed"),
    ("listed", "active", SyncAccepted(VPN, 3, 1), "in state listed"),
    ("listed", "active", batch(1, 1), "in state listed"),
    ("listed", "active", Error(PeerFailure.code, VPN, "spontaneous"), "in state listed"),
    ("requested", "standby", SyncRequest(VPN, 3, 0, 0), "in state sync-requested"),
    ("requested", "standby", Error(PeerFailure.code, VPN, "x"), "in state sync-requested"),
    ("requested", "standby", Ack(VPN, 3, 0), "in state sync-requested"),
    ("requested", "active", batch(1, 1), "in state sync-requested"),
    ("requested", "active", SyncFinished(VPN, 3, 0), "in state sync-requested"),
    ("catching-up", "active", SyncAccepted(VPN, 3, 1), "in state catching-up"),
    ("catching-up", "active", SyncFinished(VPN, 3, 5), "replay reached 0"),
    ("catching-up", "standby", Ack(VPN, 3, 1), "outside 0..0"),
    ("catching-up", "standby", batch(1, 1), "in state catching-up"),
    ("live", "active", SyncFinished(VPN, 3, 3), "in state live"),
    ("live", "active", Checkpoint(VPN, 3, 0, (), True), "in state live"),
    ("live", "active", Error(PeerFailure.code, VPN, "ledger read failed"), "in state live"),
    ("live", "standby", Ack(VPN, 3, 4), "outside 0..3"),
]


@pytest.mark.parametrize(
    ("stage", "side", "frame", "text"),
    ILLEGAL_SENDS,
    ids=[f"{s}-{side}-{type(f).__name__}" for s, side, f, _ in ILLEGAL_SENDS],
)
def test_illegal_sends_raise_and_change_nothing(stage, side, frame, text) -> None:
    pair = at_stage(stage)
    conn = getattr(pair, side)
    before = (conn.phase, conn.vpn_state(VPN), conn.next_index(VPN))
    with pytest.raises(LocalProtocolError, match=text):
        conn.send(frame)
    assert (conn.phase, conn.vpn_state(VPN), conn.next_index(VPN)) == before


ILLEGAL_RECEIPTS = [
    ("start", "active", GetAllResources(), UnexpectedFrame),
    ("start", "active", Hello("x", PROTOCOL_VERSION, Role.ACTIVE), RoleConflict),
    ("start", "active", Hello(ACTIVE_SITE, PROTOCOL_VERSION, Role.STANDBY), RoleConflict),
    ("start", "active", Hello("x", PROTOCOL_VERSION + 1, Role.STANDBY), VersionMismatch),
    ("start", "standby", Hello(ACTIVE_SITE, PROTOCOL_VERSION, Role.ACTIVE), UnexpectedFrame),
    ("greeting", "standby", Hello("x", PROTOCOL_VERSION, Role.STANDBY), RoleConflict),
    ("greeting", "active", Hello(STANDBY_SITE, PROTOCOL_VERSION, Role.STANDBY), UnexpectedFrame),
    ("greeted", "standby", ResourceList(()), UnexpectedFrame),
    ("greeted", "standby", GetAllResources(), UnexpectedFrame),
    ("listed", "standby", batch(1, 1), UnexpectedFrame),
    ("listed", "standby", SyncAccepted(VPN, 3, 1), UnexpectedFrame),
    ("listed", "active", Ack(VPN, 3, 0), UnexpectedFrame),
    ("listed", "active", batch(1, 1), UnexpectedFrame),
    ("requested", "standby", batch(1, 1), UnexpectedFrame),
    ("requested", "active", SyncRequest(VPN, 3, 0, 0), UnexpectedFrame),
    ("catching-up", "standby", SyncFinished(VPN, 3, 7), UnexpectedFrame),
    ("catching-up", "standby", Ack(VPN, 3, 0), UnexpectedFrame),
    ("live", "active", Ack(VPN, 3, 9), UnexpectedFrame),
    ("live", "standby", Error(PeerFailure.code, VPN, "spontaneous"), UnexpectedFrame),
]


@pytest.mark.parametrize(
    ("stage", "side", "frame", "error"),
    ILLEGAL_RECEIPTS,
    ids=[f"{s}-{side}-{type(f).__name__}" for s, side, f, _ in ILLEGAL_RECEIPTS],
)
def test_illegal_receipts_fail_the_connection(stage, side, frame, error) -> None:
    conn = getattr(at_stage(stage), side)
    conn.receive_data(frame.encode())
    with pytest.raises(error) as info:
        conn.next_event()
    assert type(info.value) is error and info.value.closes_connection
    assert phase(conn) is ConnectionPhase.FAILED


def test_frames_for_an_unlisted_vpn_are_discarded() -> None:
    pair = at_stage("live")
    pair.standby.receive_data(SyncAccepted("billing", 3, 1).encode() + Heartbeat().encode())
    with pytest.raises(UnknownVpn) as info:
        pair.standby.next_event()
    assert info.value.vpn == "billing" and not info.value.closes_connection
    assert pair.standby.next_event() == Heartbeat()


def test_the_transition_table_only_lets_each_role_send_its_own_frames() -> None:
    by_standby = {SyncRequest, Ack, GetAllResources}
    by_active = {SyncAccepted, Checkpoint, SyncFinished, Events, ResourceList}
    for sender, frame_type, _ in CONNECTION_TRANSITIONS:
        assert frame_type not in (by_active if sender is Role.STANDBY else by_standby)


# ---------------------------------------------------------------- re-listing


def test_a_new_resource_list_forgets_dropped_vpns_and_keeps_the_others() -> None:
    pair = Pair()
    pair.handshake(resource(), resource("billing"))
    pair.sync(from_index=1)
    pair.s(SyncRequest("billing", 3, 0, 0))  # crosses the new list
    pair.a(ResourceList((resource(epoch=5),)))
    assert pair.at_standby() == [ResourceList((resource(epoch=5),))]
    assert pair.states() == (VpnState.LIVE, VpnState.LIVE)
    assert pair.states("billing") == (None, None)
    assert pair.standby.known_epoch(VPN) == 5
    with pytest.raises(UnknownVpn):
        pair.at_active()
    with pytest.raises(LocalProtocolError, match="not listed"):
        pair.active.send(batch(1, 1, vpn="billing"))


def test_the_standby_may_ask_for_the_resources_again() -> None:
    pair = at_stage("live")
    pair.s(GetAllResources())
    pair.at_active()
    assert phase(pair.active) is ConnectionPhase.LISTING
    pair.a(batch(4, 4), ResourceList((resource(),)))
    assert pair.at_standby() == [batch(4, 4), ResourceList((resource(),))]
    assert phase(pair.standby) is ConnectionPhase.READY


# ---------------------------------------------------------------- Error frames


@pytest.mark.parametrize(("code", "cls"), sorted(ERROR_CODES.items()), ids=lambda x: str(x))
def test_error_codes_map_to_the_same_class_on_the_peer(code, cls) -> None:
    assert cls.code == code
    local = cls("something bad", VPN)
    frame = Error.decode(Error.from_exception(local).encode())
    assert frame == Error(code, VPN, "something bad")
    remote = frame.exception()
    assert type(remote) is cls
    assert (remote.vpn, remote.text, remote.reported_by_peer) == (VPN, "something bad", True)
    assert "reported by the peer" in str(remote)


def test_error_codes_are_distinct_and_all_remote() -> None:
    assert len(ERROR_CODES) == 10
    assert all(issubclass(cls, RemoteProtocolError) for cls in ERROR_CODES.values())
    assert not issubclass(LocalProtocolError, RemoteProtocolError)
    assert issubclass(LocalProtocolError, BridgeError) and issubclass(
        RemoteProtocolError, BridgeError
    )


def test_local_faults_and_unknown_codes_reach_the_peer_as_failures() -> None:
    assert type(Error.from_exception(LocalProtocolError("bug")).exception()) is PeerFailure
    assert type(Error.from_exception(Fenced("old", VPN)).exception()) is StaleEpoch
    unknown = Error(999, "", "from the future").exception()
    assert type(unknown) is PeerFailure and "999" in str(unknown)
    assert Error.from_exception(Gap("g", VPN), vpn="").closes_connection


def test_error_text_is_truncated_to_fit() -> None:
    frame = Error.from_exception(PeerFailure("é" * 5000))
    assert len(frame.text.encode()) <= 4096


@pytest.mark.parametrize("stage", STAGES)
def test_a_connection_level_error_closes_both_ends(stage) -> None:
    pair = at_stage(stage)
    pair.s(Error(Unauthorised.code, "", "certificate does not name ldn"))
    [frame] = pair.at_active()
    assert isinstance(frame, Error)
    assert type(frame.exception()) is Unauthorised
    for conn in (pair.standby, pair.active):
        assert phase(conn) is ConnectionPhase.CLOSED
        assert conn.next_event() is CLOSED
        with pytest.raises(LocalProtocolError, match="closed"):
            conn.send(Heartbeat())


def test_the_active_refuses_a_sync_request_with_a_vpn_error() -> None:
    pair = at_stage("requested")
    pair.a(Error(UnknownVpn.code, VPN, "replication disabled here"))
    [frame] = pair.at_standby()
    assert isinstance(frame, Error)
    assert isinstance(frame.exception(), UnknownVpn)
    assert pair.states() == (VpnState.LISTED, VpnState.LISTED)
    pair.s(SyncRequest(VPN, 3, 0, 0))  # may ask again
    pair.at_active()
    assert pair.states() == (VpnState.SYNC_REQUESTED, VpnState.SYNC_REQUESTED)


def test_the_standby_abandons_a_stream_and_resyncs_later() -> None:
    pair = at_stage("live")
    pair.s(Error(PeerFailure.code, VPN, "apply failed"))
    pair.a(batch(4, 5))  # in flight when the active sees the Error
    assert pair.at_standby() == []
    assert pair.at_active() == [Error(PeerFailure.code, VPN, "apply failed")]
    assert pair.states() == (VpnState.DRAINING, VpnState.DRAINING)
    pair.s(SyncRequest(VPN, 3, 5, 3))
    pair.at_active()
    pair.a(SyncAccepted(VPN, 3, 6), SyncFinished(VPN, 3, 5), batch(6, 6))
    assert len(pair.at_standby()) == 3
    assert pair.states() == (VpnState.LIVE, VpnState.LIVE)


# ---------------------------------------------------------------- no I/O


def test_transaction_frames_go_in_any_stream_state_and_change_none() -> None:
    pair = Pair()
    pair.handshake()  # listed, no stream yet
    pair.a(TxnPrepare(VPN, 3, "t1", b""))
    assert pair.at_standby() == [TxnPrepare(VPN, 3, "t1", b"")]
    pair.s(TxnVote(VPN, 3, "t1", True), TxnQuery(VPN, 3, ("t0",)))
    assert [type(f) for f in pair.at_active()] == [TxnVote, TxnQuery]
    pair.sync(from_index=1)
    pair.a(TxnOutcome(VPN, 3, "t1", True), batch(1, 2), TxnCommit(VPN, 3, "t2", 3))
    assert [type(f) for f in pair.at_standby()] == [TxnOutcome, Events, TxnCommit]
    pair.s(TxnApplied(VPN, 3, "t2", True))
    assert pair.at_active() == [TxnApplied(VPN, 3, "t2", True)]
    assert pair.states() == (VpnState.LIVE, VpnState.LIVE)


def test_transaction_frames_keep_their_direction_and_epoch() -> None:
    pair = Pair(standby_epochs={VPN: 5})
    pair.handshake()
    with pytest.raises(LocalProtocolError):
        pair.standby.send(TxnPrepare(VPN, 5, "t1", b""))  # only the active prepares
    with pytest.raises(LocalProtocolError):
        pair.active.send(TxnVote(VPN, 3, "t1", True))  # only the standby votes
    with pytest.raises(LocalProtocolError):
        pair.active.send(TxnApplied(VPN, 3, "t1", False))  # only the standby applies
    with pytest.raises(LocalProtocolError):
        pair.standby.send(TxnCommit(VPN, 5, "t1", 1))  # only the active decides
    with pytest.raises(LocalProtocolError):
        pair.active.send(TxnPrepare("billing", 3, "t1", b""))  # not listed
    pair.a(TxnPrepare(VPN, 3, "t1", b""))  # epoch 3, but the standby knows 5
    with pytest.raises(StaleEpoch):
        pair.at_standby()
