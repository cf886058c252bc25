"""The bridge frames' bytes, pinned: one instance of every frame kind (and
of every optional part: capability fields, version-6 fields, each event
kind) is encoded and compared with the bytes the protocol has always had,
then decoded back. A peer of this release or the previous one reads these
exact bytes, so any change to them is a protocol change, not a refactor.

Encodings in version 5 differ from version 6 only where a field is new in
version 6 (``Hello.capabilities``, ``VpnResource.definitions_index``);
every other frame's version-5 bytes are its version-6 bytes with the
header's version byte (and so the checksum) changed.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import replace

import pytest

from bridge import (
    BadFrame,
    Consumed,
    DeadLettered,
    LedgerEntry,
    Mode,
    Published,
    Purged,
    ReplicationId,
    Role,
    StaleEpoch,
    SyncTimeoutPolicy,
    TopicFilter,
    TopologyChanged,
)
from bridge.wire import (
    FRAME_TYPES,
    OUR_CAPABILITIES,
    PREVIOUS_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Ack,
    Checkpoint,
    CheckpointRow,
    Error,
    Events,
    Frame,
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
    decode_frame,
)

VPN = "orders-ü"


def rid(n: int) -> ReplicationId:
    return ReplicationId.from_parts(7, n)


def row(n: int, queue: str = "orders.q1") -> CheckpointRow:
    return CheckpointRow(queue, rid(n), n, "amq.direct", "", b"\x90\x00", b"m%d" % n)


def resource(name: str, index: int | None) -> VpnResource:
    return VpnResource(
        name, 3, Mode.SYNC, 2000, SyncTimeoutPolicy.REJECT, ("orders\\..*", "ü"),
        (TopicFilter("", "eu.#"), TopicFilter("x:y", "*.z")), b'{"queues": []}',
        True, 2**40, index,
    )  # fmt: skip


EVENTS = (
    Published(VPN, rid(1), "amq.topic", "a.b", b"\x90\x00\x02", b"body", ("q1", "q2")),
    Consumed(VPN, rid(1), "q1"),
    Purged(VPN, "q1", (rid(2), rid(3)), deleted=True),
    Purged(VPN, "q1", (), sent_at=2**33),
    DeadLettered(VPN, rid(4), "q1", ("dlq",)),
    TopologyChanged(VPN, "queue.declare", '{"name":"q3"}'),
)
LISTING = ResourceList((resource(VPN, 7), resource("billing", None)))
PLAIN = VpnResource("b", 1, Mode.ASYNC, 0, SyncTimeoutPolicy.DEGRADE, (), (), b"")


def pinned(
    frame: Frame, version: int = PROTOCOL_VERSION, decoded: Frame | None = None
) -> tuple[Frame, int, Frame]:
    """``frame`` encoded in ``version``, and what a node decodes from it."""
    return frame, version, frame if decoded is None else decoded


SAMPLES: dict[str, tuple[Frame, int, Frame]] = {
    "hello": pinned(Hello("ldn", 6, Role.STANDBY, OUR_CAPABILITIES)),
    "hello-v5": pinned(Hello("ldn", 5, Role.STANDBY, 5), 5, Hello("ldn", 5, Role.STANDBY)),
    "get-all-resources": pinned(GetAllResources()),
    "resource-list-empty": pinned(ResourceList(())),
    "resource-list": pinned(LISTING),
    "resource-list-v5": pinned(
        LISTING, 5, ResourceList(tuple(replace(r, definitions_index=None) for r in LISTING.vpns))
    ),
    "resource-list-plain": pinned(ResourceList((PLAIN,))),
    "sync-request": pinned(SyncRequest(VPN, 3, 1042, 2)),
    "sync-request-empty": pinned(SyncRequest(VPN, 3, 0, 0)),
    "sync-request-takeover": pinned(SyncRequest(VPN, 3, 1042, 2, "zürich", 2**40)),
    "sync-accepted": pinned(SyncAccepted(VPN, 3, 1043)),
    "checkpoint": pinned(Checkpoint(VPN, 3, 50, (row(1), row(50, "orders.q2")), True)),
    "checkpoint-empty": pinned(Checkpoint(VPN, 3, 0, (), False)),
    "sync-finished": pinned(SyncFinished(VPN, 3, 1042)),
    "events": pinned(
        Events(VPN, 4, tuple(LedgerEntry(VPN, 3 + i // 4, 9 + i, e) for i, e in enumerate(EVENTS)))
    ),
    "ack": pinned(Ack(VPN, 3, 2**64 - 1)),
    "heartbeat": pinned(Heartbeat()),
    "error": pinned(Error(StaleEpoch.code, VPN, "epoch 2 is stale")),
    "error-connection": pinned(Error(BadFrame.code, "", "")),
    "txn-prepare": pinned(TxnPrepare(VPN, 3, "7.1.1.1", b"\x00\x00\x00\x01P")),
    "txn-prepare-owner": pinned(TxnPrepare(VPN, 3, "xa/1:67:62/1.1.1.1", b"", "alice")),
    "txn-vote": pinned(TxnVote(VPN, 3, "7.1.1.1", True)),
    "txn-outcome": pinned(TxnOutcome(VPN, 3, "7.1.1.1", False)),
    "txn-query": pinned(TxnQuery(VPN, 3, ("7.1.1.1", "7.2.1.5"))),
    "txn-commit": pinned(TxnCommit(VPN, 3, "7.1.1.1", 2**64 - 1)),
    "txn-applied": pinned(TxnApplied(VPN, 3, "7.1.1.1", False)),
    "repair": pinned(Repair(VPN, 3, (row(4), row(5, "orders.q2")), (("orders.q1", rid(6)),))),
    "repair-absent-only": pinned(Repair(VPN, 3, (), (("orders.q1", rid(7)),))),
}


#: the bytes of each sample, as hex
GOLDEN: dict[str, str] = {
    "hello": "bd0601000000000c00036c646e0006020000000f6a8a6f19",
    "hello-v5": "bd0501000000000800036c646e00050237a84d96",
    "get-all-resources": "bd0602000000000006c9882e",
    "resource-list-empty": "bd0603000000000400000000679649e5",
    "resource-list": (
        "bd060300000000c60000000200096f72646572732dc3bc000000000000000302000007d0020002000a6f"
        "72646572735c2e2e2a0002c3bc00020000000465752e230003783a7900032a2e7a0000000e7b22717565"
        "756573223a205b5d7d0100000100000000000000000000000007000762696c6c696e6700000000000000"
        "0302000007d0020002000a6f72646572735c2e2e2a0002c3bc00020000000465752e230003783a790003"
        "2a2e7a0000000e7b22717565756573223a205b5d7d010000010000000000ffffffffffffffff22194b93"
    ),
    "resource-list-v5": (
        "bd050300000000b60000000200096f72646572732dc3bc000000000000000302000007d0020002000a6f"
        "72646572735c2e2e2a0002c3bc00020000000465752e230003783a7900032a2e7a0000000e7b22717565"
        "756573223a205b5d7d010000010000000000000762696c6c696e67000000000000000302000007d00200"
        "02000a6f72646572735c2e2e2a0002c3bc00020000000465752e230003783a7900032a2e7a0000000e7b"
        "22717565756573223a205b5d7d0100000100000000003f0b7633"
    ),
    "resource-list-plain": (
        "bd0603000000002e00000001000162000000000000000101000000000100000000000000000000000000"
        "00000000ffffffffffffffff960ccf07"
    ),
    "sync-request": (
        "bd0604000000002300096f72646572732dc3bc0000000000000003000000000000041200000000000000"
        "02b329b701"
    ),
    "sync-request-empty": (
        "bd0604000000002300096f72646572732dc3bc0000000000000003000000000000000000000000000000"
        "00d6fa1ca0"
    ),
    "sync-request-takeover": (
        "bd0604000000003400096f72646572732dc3bc0000000000000003000000000000041200000000000000"
        "0200077ac3bc7269636800000100000000007d642c0a"
    ),
    "sync-accepted": (
        "bd0605000000001b00096f72646572732dc3bc00000000000000030000000000000413c364595a"
    ),
    "checkpoint": (
        "bd0606000000009b00096f72646572732dc3bc0000000000000003000000000000003201000000020009"
        "6f72646572732e7131000000000000000700000000000000010000000000000001000a616d712e646972"
        "6563740000000000029000000000026d3100096f72646572732e71320000000000000007000000000000"
        "00320000000000000032000a616d712e6469726563740000000000029000000000036d35303a18355b"
    ),
    "checkpoint-empty": (
        "bd0606000000002000096f72646572732dc3bc00000000000000030000000000000000000000000017b6e134"
    ),
    "sync-finished": (
        "bd0607000000001b00096f72646572732dc3bc00000000000000030000000000000412d986482a"
    ),
    "events": (
        "bd0608000000012100096f72646572732dc3bc0000000000000004000000000000000900000006000000"
        "00000000030000003a50000000000000000700000000000000010009616d712e746f7069630003612e62"
        "000200027131000271320000000390000200000004626f64790000000000000003000000154300000000"
        "0000000700000000000000010002713100000000000000030000002a5101000271310000000200000000"
        "000000070000000000000002000000000000000700000000000000030000000000000003000000125100"
        "0002713100000000000000020000000000000000000000040000001c4400000000000000070000000000"
        "0000040002713100010003646c7100000000000000040000001354030000000d7b226e616d65223a2271"
        "33227dcaf95904"
    ),
    "ack": "bd0609000000001b00096f72646572732dc3bc0000000000000003ffffffffffffffffd0ff1fe0",
    "heartbeat": "bd060a0000000000ea9a0a43",
    "error": (
        "bd060b000000001f000800096f72646572732dc3bc001065706f63682032206973207374616c6546949302"
    ),
    "error-connection": "bd060b0000000006000100000000c123c593",
    "txn-prepare": (
        "bd060c000000002500096f72646572732dc3bc00000000000000030007372e312e312e31000000050000"
        "000150fd6d5a7d"
    ),
    "txn-prepare-owner": (
        "bd060c000000003200096f72646572732dc3bc0000000000000003001278612f313a36373a36322f312e"
        "312e312e31000000000005616c69636518e8fc42"
    ),
    "txn-vote": (
        "bd060d000000001d00096f72646572732dc3bc00000000000000030007372e312e312e3101cf1d1f55"
    ),
    "txn-outcome": (
        "bd060e000000001d00096f72646572732dc3bc00000000000000030007372e312e312e310033c911da"
    ),
    "txn-query": (
        "bd060f000000002700096f72646572732dc3bc000000000000000300020007372e312e312e310007372e"
        "322e312e352c8d3d0a"
    ),
    "txn-commit": (
        "bd0610000000002400096f72646572732dc3bc00000000000000030007372e312e312e31ffffffffffff"
        "ffff88609b42"
    ),
    "txn-applied": (
        "bd0611000000001d00096f72646572732dc3bc00000000000000030007372e312e312e3100b53f992f"
    ),
    "repair": (
        "bd061200000000b000096f72646572732dc3bc00000000000000030000000200096f72646572732e7131"
        "000000000000000700000000000000040000000000000004000a616d712e646972656374000000000002"
        "9000000000026d3400096f72646572732e71320000000000000007000000000000000500000000000000"
        "05000a616d712e6469726563740000000000029000000000026d350000000100096f72646572732e7131"
        "00000000000000070000000000000006655373df"
    ),
    "repair-absent-only": (
        "bd0612000000003600096f72646572732dc3bc0000000000000003000000000000000100096f72646572"
        "732e71310000000000000007000000000000000706425307"
    ),
}


def changed_in_6(frame: Frame) -> bool:
    """Whether ``frame`` has a field that is new in version 6."""
    return isinstance(frame, Hello) or isinstance(frame, ResourceList) and bool(frame.vpns)


def in_version(data: bytes, version: int) -> bytes:
    """``data`` with its header's version byte set to ``version``."""
    body = data[:1] + bytes((version,)) + data[2:-4]
    return body + struct.pack(">I", zlib.crc32(body))


def with_payload(data: bytes, payload: bytes) -> bytes:
    """The frame ``data`` with another payload, its length and checksum right."""
    body = data[:4] + struct.pack(">I", len(payload)) + payload
    return body + struct.pack(">I", zlib.crc32(body))


def test_the_samples_cover_every_frame_kind_and_version() -> None:
    assert {type(f) for f, _, _ in SAMPLES.values()} == set(FRAME_TYPES.values())
    assert {v for _, v, _ in SAMPLES.values()} == {PREVIOUS_PROTOCOL_VERSION, PROTOCOL_VERSION}
    assert SAMPLES.keys() == GOLDEN.keys()


@pytest.mark.parametrize("name", SAMPLES)
def test_a_frame_encodes_to_its_pinned_bytes_and_decodes_back(name: str) -> None:
    frame, version, decoded = SAMPLES[name]
    data = bytes.fromhex(GOLDEN[name])
    assert frame.encode(version) == data
    assert decode_frame(data) == (decoded, len(data))
    assert type(frame).decode(data) == decoded


@pytest.mark.parametrize(
    "name", [n for n, (f, v, _) in SAMPLES.items() if v == PROTOCOL_VERSION and not changed_in_6(f)]
)
def test_in_the_previous_version_only_the_header_differs(name: str) -> None:
    frame, _, decoded = SAMPLES[name]
    data = in_version(bytes.fromhex(GOLDEN[name]), PREVIOUS_PROTOCOL_VERSION)
    assert frame.encode(PREVIOUS_PROTOCOL_VERSION) == data
    assert decode_frame(data) == (decoded, len(data))


@pytest.mark.parametrize("name", SAMPLES)
def test_a_pinned_payload_cut_short_or_extended_is_a_bad_frame(name: str) -> None:
    """Cut anywhere, a payload is refused as a BadFrame, unless the cut
    falls just before an optional trailing part (then it is another frame);
    one byte more is refused too (as trailing bytes, or as a cut tail)."""
    data = bytes.fromhex(GOLDEN[name])
    payload, decoded = data[8:-4], SAMPLES[name][2]
    for n in range(len(payload)):
        try:
            got = decode_frame(with_payload(data, payload[:n]))
        except BadFrame:
            continue
        assert got is not None and got[0] != decoded
        assert isinstance(got[0], SyncRequest | TxnPrepare), n
    with pytest.raises(BadFrame, match="1 bytes after the|truncated in (owner|taken_over_by)"):
        decode_frame(with_payload(data, payload + b"\x00"))
