"""Sites upgraded one at a time: the bridge speaks the previous protocol
version (5) with a peer that has not been upgraded yet, and from version 6
on the two ends agree capability flags in their Hellos. What a peer cannot
receive (topology events) reaches it as a no-op, so its indexes stay dense."""

from __future__ import annotations

import struct
from dataclasses import replace

import pytest

from bridge import (
    LedgerEntry,
    Mode,
    Published,
    Purged,
    ReplicationId,
    Role,
    SyncTimeoutPolicy,
    TopologyChanged,
    VersionMismatch,
    encode_event,
    name_item,
)
from bridge.wire import (
    CAP_TOPOLOGY,
    CAP_XA_OWNER,
    MAGIC,
    OUR_CAPABILITIES,
    PREVIOUS_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    BridgeConnection,
    Error,
    Events,
    Frame,
    GetAllResources,
    Hello,
    ResourceList,
    Sentinel,
    SyncAccepted,
    SyncFinished,
    SyncRequest,
    TxnPrepare,
    VpnResource,
    decode_frame,
)

#: what the release before take-over and purge points offers in version 6
PREDECESSOR_CAPABILITIES = CAP_TOPOLOGY | CAP_XA_OWNER


def listing(index: int | None = 7) -> ResourceList:
    resource = VpnResource(
        "orders", 1, Mode.SYNC, 2000, SyncTimeoutPolicy.REJECT, (r"^orders\.",), (), b"{}",
        definitions_index=index,
    )  # fmt: skip
    return ResourceList((resource,))


def frames(conn: BridgeConnection, data: bytes) -> list[Frame]:
    conn.receive_data(data)
    got = []
    while not isinstance(event := conn.next_event(), Sentinel):  # NEED_DATA, CLOSED
        got.append(event)
    return got


def header_version(data: bytes) -> int:
    magic, version = struct.unpack_from(">BB", data)
    assert magic == MAGIC
    return int(version)


def greeted(
    standby_version: int = PROTOCOL_VERSION, standby_offers: int = OUR_CAPABILITIES
) -> tuple[BridgeConnection, BridgeConnection]:
    active = BridgeConnection(Role.ACTIVE, "a")
    standby = BridgeConnection(Role.STANDBY, "b", version=standby_version, offered=standby_offers)
    frames(active, standby.send(standby.our_hello()))
    frames(standby, active.send(active.our_hello()))
    frames(active, standby.send(GetAllResources()))
    frames(standby, active.send(listing()))
    return active, standby


def streaming(active: BridgeConnection, standby: BridgeConnection) -> None:
    frames(active, standby.send(SyncRequest("orders", 1, 0, 0)))
    frames(standby, active.send(SyncAccepted("orders", 1, 1)))
    frames(standby, active.send(SyncFinished("orders", 1, 0)))


def entries() -> tuple[LedgerEntry, ...]:
    rid = ReplicationId(b"\x01" * 16)
    return (
        LedgerEntry("orders", 1, 1, TopologyChanged("orders", "queue.declare", name_item("q"))),
        LedgerEntry("orders", 1, 2, Published("orders", rid, "", "q", b"\x00\x00", b"x", ("q",))),
        LedgerEntry("orders", 1, 3, TopologyChanged("orders", "queue.delete", name_item("q"))),
    )


def test_two_upgraded_ends_speak_the_newest_version_with_every_capability() -> None:
    active, standby = greeted()
    assert active.version == standby.version == PROTOCOL_VERSION == 6
    assert active.capabilities == standby.capabilities == OUR_CAPABILITIES
    assert active.lacking() == standby.lacking() == []
    assert standby.resources["orders"].definitions_index == 7  # version 6 carries it


def test_topology_events_and_xa_owners_travel_as_they_are_between_two_upgraded_ends() -> None:
    active, standby = greeted()
    streaming(active, standby)
    got = frames(standby, active.send(Events("orders", 1, entries())))
    assert got == [Events("orders", 1, entries())]
    prepare = TxnPrepare("orders", 1, "xa/1:67:62/1.1.1.1", b"", owner="alice")
    assert frames(standby, active.send(prepare)) == [prepare]
    unowned = replace(prepare, owner="")  # a local transaction's: the frame as version 5 had it
    assert unowned.encode() == TxnPrepare("orders", 1, unowned.txid, b"").encode()
    assert frames(standby, active.send(unowned)) == [unowned]


def test_a_previous_version_standby_gets_each_topology_event_as_a_no_op_at_its_index() -> None:
    """The active was upgraded first: the old standby proposes version 5,
    every frame it gets says version 5, and a topology event (which a
    version-5 node cannot decode) arrives as a purge of the queue named ""
    at the same index, so no gap shows."""
    active = BridgeConnection(Role.ACTIVE, "a")
    old_hello = Hello("b", PREVIOUS_PROTOCOL_VERSION, Role.STANDBY).encode(5)
    assert frames(active, old_hello) == [Hello("b", 5, Role.STANDBY)]
    assert active.version == 5
    answer = active.send(active.our_hello())
    assert header_version(answer) == 5
    assert active.capabilities == 0
    assert active.lacking() == [
        "topology events",
        "XA branch owners",
        "take-over points in sync requests",
        "purge points",
    ]
    frames(active, GetAllResources().encode(5))
    wire = active.send(listing())
    sent, _ = decode_frame(wire)  # what a version-5 node decodes
    assert isinstance(sent, ResourceList) and sent.vpns[0].definitions_index is None
    frames(active, SyncRequest("orders", 1, 0, 0).encode(5))
    active.send(SyncAccepted("orders", 1, 1))
    active.send(SyncFinished("orders", 1, 0))
    wire = active.send(Events("orders", 1, entries()))
    assert header_version(wire) == 5
    sent, _ = decode_frame(wire)
    assert isinstance(sent, Events)
    assert [(e.index, e.event) for e in sent.entries] == [
        (1, Purged("orders", "")),
        (2, entries()[1].event),
        (3, Purged("orders", "")),
    ]
    prepare = TxnPrepare("orders", 1, "xa/1:67:62/1.1.1.1", b"", owner="alice")
    sent, _ = decode_frame(active.send(prepare))
    assert sent == replace(prepare, owner="")  # an old node's row names no owner
    with pytest.raises(Exception, match="may not send"):
        active.send(Hello("a", PROTOCOL_VERSION, Role.ACTIVE))  # not twice, not another version


def test_a_sync_request_names_where_its_epoch_took_over_to_an_active_that_can_read_it() -> None:
    """Between two ends with the take-over capability the SyncRequest
    carries the site that took its epoch and where; to an active without
    it (the previous release, in version 6 or 5) it goes as that one reads
    it: byte for byte the frame without them."""
    request = SyncRequest("orders", 2, 0, 0, taken_over_by="b", taken_over_at=10)
    plain = SyncRequest("orders", 2, 0, 0)
    active, standby = greeted()
    assert frames(active, standby.send(request)) == [request]

    active = BridgeConnection(Role.ACTIVE, "a", offered=PREDECESSOR_CAPABILITIES)
    standby = BridgeConnection(Role.STANDBY, "b")
    frames(active, standby.send(standby.our_hello()))
    frames(standby, active.send(active.our_hello()))
    assert standby.lacking() == ["take-over points in sync requests", "purge points"]
    frames(active, standby.send(GetAllResources()))
    frames(standby, active.send(listing()))
    wire = standby.send(request)
    assert wire == plain.encode()
    assert frames(active, wire) == [plain]

    standby = BridgeConnection(Role.STANDBY, "b", version=PREVIOUS_PROTOCOL_VERSION)
    standby.send(standby.our_hello())
    frames(standby, Hello("a", 5, Role.ACTIVE).encode(5))
    standby.send(GetAllResources())
    frames(standby, listing(None).encode(5))
    assert standby.send(request) == plain.encode(5)

    with pytest.raises(ValueError, match="taken_over_by"):
        SyncRequest("orders", 2, 0, 0, taken_over_at=10)


def test_a_purge_says_its_purge_point_only_to_a_standby_that_reads_it() -> None:
    """An upgraded standby gets a purge's point (the ledger index its request
    went out at) and purges below it; a standby of the previous release (in
    version 6 without the capability, or in version 5) gets the purge as it
    always did, encoded as it knows it, and purges what its own index says."""
    at = Purged("orders", "q", (), sent_at=2)
    batch = (
        LedgerEntry("orders", 1, 1, entries()[1].event),
        LedgerEntry("orders", 1, 2, at),
    )
    active, standby = greeted()
    streaming(active, standby)
    (got,) = frames(standby, active.send(Events("orders", 1, batch)))
    assert isinstance(got, Events) and got.entries[1].event == at
    for offers in (PREDECESSOR_CAPABILITIES, 0):
        active, standby = greeted(standby_offers=offers)
        streaming(active, standby)
        wire = active.send(Events("orders", 1, batch))
        sent, _ = decode_frame(wire)
        assert isinstance(sent, Events)
        assert sent.entries[1].event == Purged("orders", "q")
        assert sent.entries[1].encoded == encode_event(Purged("orders", "q"))  # the old bytes
    active = BridgeConnection(Role.ACTIVE, "a")
    frames(active, Hello("b", PREVIOUS_PROTOCOL_VERSION, Role.STANDBY).encode(5))
    active.send(active.our_hello())
    frames(active, GetAllResources().encode(5))
    active.send(listing())
    frames(active, SyncRequest("orders", 1, 0, 0).encode(5))
    active.send(SyncAccepted("orders", 1, 1))
    active.send(SyncFinished("orders", 1, 0))
    sent, _ = decode_frame(active.send(Events("orders", 1, batch)))
    assert isinstance(sent, Events) and sent.entries[1].event == Purged("orders", "q")


def test_a_standby_that_offers_no_topology_gets_no_topology_events_in_version_6() -> None:
    active, standby = greeted(standby_offers=0)
    assert active.capabilities == 0 and standby.capabilities == 0
    streaming(active, standby)
    (got,) = frames(standby, active.send(Events("orders", 1, entries())))
    assert isinstance(got, Events)
    assert not any(isinstance(e.event, TopologyChanged) for e in got.entries)


def test_an_upgraded_standby_speaks_version_5_to_a_previous_version_active() -> None:
    standby = BridgeConnection(Role.STANDBY, "b", version=PREVIOUS_PROTOCOL_VERSION)
    hello = standby.our_hello()
    assert hello.capabilities == 0 and header_version(standby.send(hello)) == 5
    frames(standby, Hello("a", 5, Role.ACTIVE).encode(5))
    assert standby.lacking() == [
        "topology events",
        "XA branch owners",
        "take-over points in sync requests",
        "purge points",
    ]
    standby.send(GetAllResources())
    old = listing(None)
    frames(standby, old.encode(5))
    assert standby.resources["orders"].definitions_index is None


def test_a_standby_refuses_an_answer_in_another_version_than_it_proposed() -> None:
    standby = BridgeConnection(Role.STANDBY, "b")
    standby.send(standby.our_hello())
    with pytest.raises(VersionMismatch, match="answered version 5 to 6"):
        frames(standby, Hello("a", 5, Role.ACTIVE).encode(5))


def test_a_version_this_node_does_not_speak_is_refused_by_its_frame_header() -> None:
    active = BridgeConnection(Role.ACTIVE, "a")
    with pytest.raises(VersionMismatch, match="frame version 4, this node speaks versions 5 to 6"):
        frames(active, Hello("b", 4, Role.STANDBY).encode(4))
    with pytest.raises(ValueError, match="cannot speak bridge protocol version 7"):
        BridgeConnection(Role.STANDBY, "b", version=7)


def test_an_old_actives_refusal_of_the_newest_version_is_an_error_frame_the_standby_reads() -> None:
    """What a version-5 active sends when a version-6 Hello arrives: a
    connection-level Error in its own version; the standby reads it (and
    redials in version 5, see the transport)."""
    standby = BridgeConnection(Role.STANDBY, "b")
    standby.send(standby.our_hello())
    refusal = Error(VersionMismatch.code, "", "frame version 6, this node speaks 4 to 5")
    got = frames(standby, refusal.encode(5))
    assert got == [refusal]
    assert isinstance(refusal.exception(), VersionMismatch)


def test_the_capability_flags_are_a_version_6_field_of_the_hello() -> None:
    hello = Hello("b", 6, Role.STANDBY, CAP_TOPOLOGY | 0x80)
    assert decode_frame(hello.encode(6))[0] == hello  # type: ignore[index]
    assert decode_frame(hello.encode(5))[0] == Hello("b", 6, Role.STANDBY)  # type: ignore[index]
