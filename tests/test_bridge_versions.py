"""Sites upgraded one at a time: the bridge speaks the previous protocol
version with a peer that has not been upgraded yet, and keeps the meaning of
what changed between the versions (scope patterns, searched from version 5,
matched whole before)."""

from __future__ import annotations

import struct

import pytest

from bridge import (
    PREVIOUS_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    BridgeConnection,
    Error,
    Frame,
    GetAllResources,
    Hello,
    Mode,
    ResourceList,
    Role,
    Sentinel,
    SyncTimeoutPolicy,
    VersionMismatch,
    VpnResource,
    anchored,
    decode_frame,
    unanchored,
)
from bridge._frames import MAGIC

SEARCHED = (r"^orders\.", r"(?i)audit")


def listing(patterns: tuple[str, ...] = SEARCHED) -> ResourceList:
    return ResourceList(
        (VpnResource("orders", 1, Mode.SYNC, 2000, SyncTimeoutPolicy.REJECT, patterns, (), b"{}"),)
    )


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


def test_two_upgraded_ends_speak_the_newest_version() -> None:
    active = BridgeConnection(Role.ACTIVE, "a")
    standby = BridgeConnection(Role.STANDBY, "b")
    frames(active, standby.send(Hello("b", PROTOCOL_VERSION, Role.STANDBY)))
    answer = active.send(Hello("a", active.version, Role.ACTIVE))
    assert header_version(answer) == PROTOCOL_VERSION == 5
    frames(standby, answer)
    frames(active, standby.send(GetAllResources()))
    wire = active.send(listing())
    assert frames(standby, wire) == [listing()]  # patterns travel as they are


def test_an_upgraded_active_answers_a_previous_version_standby_in_its_version() -> None:
    """The active was upgraded first: the old standby proposes version 4,
    and every frame it gets says version 4 and means what version 4 meant."""
    active = BridgeConnection(Role.ACTIVE, "a")
    old_hello = Hello("b", PREVIOUS_PROTOCOL_VERSION, Role.STANDBY).encode(4)
    assert frames(active, old_hello) == [Hello("b", 4, Role.STANDBY)]
    assert active.version == 4
    answer = active.send(Hello("a", active.version, Role.ACTIVE))
    assert header_version(answer) == 4
    frames(active, GetAllResources().encode(4))
    wire = active.send(listing())
    assert header_version(wire) == 4
    sent, _ = decode_frame(wire)  # what a version-4 node decodes
    assert isinstance(sent, ResourceList)
    assert sent.vpns[0].queue_patterns == tuple(unanchored(p) for p in SEARCHED)
    with pytest.raises(Exception, match="may not send"):
        active.send(Hello("a", PROTOCOL_VERSION, Role.ACTIVE))  # not twice, not another version


def test_an_upgraded_standby_reads_a_previous_version_actives_patterns_whole() -> None:
    """The standby was upgraded first and speaks version 4 to the old
    active: a pattern the old active sends matched whole, and is stored
    anchored so that it keeps matching the same queues."""
    standby = BridgeConnection(Role.STANDBY, "b", version=PREVIOUS_PROTOCOL_VERSION)
    assert header_version(standby.send(Hello("b", 4, Role.STANDBY))) == 4
    frames(standby, Hello("a", 4, Role.ACTIVE).encode(4))
    standby.send(GetAllResources())
    old = listing((r"orders\..*", r"audit"))
    frames(standby, old.encode(4))
    assert standby.resources["orders"].queue_patterns == (
        anchored(r"orders\..*"),
        anchored("audit"),
    )


def test_a_standby_refuses_an_answer_in_another_version_than_it_proposed() -> None:
    standby = BridgeConnection(Role.STANDBY, "b")
    standby.send(Hello("b", PROTOCOL_VERSION, Role.STANDBY))
    with pytest.raises(VersionMismatch, match="answered version 4 to 5"):
        frames(standby, Hello("a", 4, Role.ACTIVE).encode(4))


def test_a_version_this_node_does_not_speak_is_refused_by_its_frame_header() -> None:
    active = BridgeConnection(Role.ACTIVE, "a")
    with pytest.raises(VersionMismatch, match="frame version 3, this node speaks versions 4 to 5"):
        frames(active, Hello("b", 3, Role.STANDBY).encode(3))
    with pytest.raises(ValueError, match="cannot speak bridge protocol version 6"):
        BridgeConnection(Role.STANDBY, "b", version=6)


def test_an_old_actives_refusal_of_the_newest_version_is_an_error_frame_the_standby_reads() -> None:
    """What a version-4 active sends when a version-5 Hello arrives: a
    connection-level Error in its own version; the standby reads it (and
    redials in version 4, see the transport)."""
    standby = BridgeConnection(Role.STANDBY, "b")
    standby.send(Hello("b", PROTOCOL_VERSION, Role.STANDBY))
    refusal = Error(VersionMismatch.code, "", "frame version 5, this node speaks 4")
    got = frames(standby, refusal.encode(4))
    assert got == [refusal]
    assert isinstance(refusal.exception(), VersionMismatch)
