"""The bridge's error taxonomy: one root, :class:`BridgeError`, split by who is
at fault.

* :class:`LocalProtocolError` — *we* were asked to send what the protocol
  forbids (a caller bug, or :class:`Fenced`: a higher epoch exists); nothing
  was sent and the connection state is unchanged.
* :class:`RemoteProtocolError` — the *peer* sent something bad or reported
  a fault in an ``Error`` frame; each class carries a bridge error code and
  :data:`ERROR_CODES` maps it back, so the receiving side raises the class
  the sender raised.

``closes_connection``: ``True`` — answer with a connection-level ``Error``
frame and close; ``False`` — the fault concerns one VPN (:class:`Gap`,
:class:`StaleEpoch`, :class:`UnknownVpn`): its frame was discarded and the
other VPNs keep streaming.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "ERROR_CODES",
    "BadChecksum",
    "BadFrame",
    "BridgeError",
    "Fenced",
    "Gap",
    "LocalProtocolError",
    "PeerFailure",
    "RemoteProtocolError",
    "RoleConflict",
    "StaleEpoch",
    "Unauthorised",
    "UnexpectedFrame",
    "UnknownVpn",
    "VersionMismatch",
]

# Bridge error codes: stable wire values, never reused.
BAD_FRAME = 1
BAD_CHECKSUM = 2
VERSION_MISMATCH = 3
UNEXPECTED_FRAME = 4
ROLE_CONFLICT = 5
UNAUTHORISED = 6
UNKNOWN_VPN = 7
STALE_EPOCH = 8
GAP = 9
PEER_FAILURE = 10


class BridgeError(Exception):
    """Root of every error raised by the ``bridge`` package.

    ``vpn`` is the VPN the fault concerns ("" for the whole connection);
    ``reported_by_peer`` is True when the error was rebuilt from an ``Error``
    frame rather than detected here.
    """

    code: ClassVar[int] = PEER_FAILURE
    closes_connection: ClassVar[bool] = True

    def __init__(self, text: str, vpn: str = "", *, reported_by_peer: bool = False) -> None:
        super().__init__(text)
        self.text = text
        self.vpn = vpn
        self.reported_by_peer = reported_by_peer

    def __str__(self) -> str:
        where = f"VPN {self.vpn!r}: " if self.vpn else ""
        who = " (reported by the peer)" if self.reported_by_peer else ""
        return f"{where}{self.text}{who}"


class LocalProtocolError(BridgeError):
    """We were asked to send a frame the protocol does not allow now."""


class Fenced(LocalProtocolError):
    """A frame for a VPN carries an epoch older than one this connection has
    seen: another site was promoted. An active getting this must stop
    accepting publishes for the VPN (and answer a pending ``SyncRequest``
    with a ``STALE_EPOCH`` ``Error``)."""

    code = STALE_EPOCH


class RemoteProtocolError(BridgeError):
    """The peer sent something we must not accept, or reported a fault."""


class BadFrame(RemoteProtocolError):
    """Not a well-formed bridge frame: bad magic, unknown type, oversize,
    truncated or over-long payload, a field out of range, invalid UTF-8."""

    code = BAD_FRAME


class BadChecksum(RemoteProtocolError):
    """The frame's CRC-32 does not match its header and payload."""

    code = BAD_CHECKSUM


class VersionMismatch(RemoteProtocolError):
    """The peer speaks another bridge protocol version."""

    code = VERSION_MISMATCH


class UnexpectedFrame(RemoteProtocolError):
    """A well-formed frame that is not legal in the connection's state."""

    code = UNEXPECTED_FRAME


class RoleConflict(RemoteProtocolError):
    """Both ends claim the same role (two actives, two standbys), or the peer
    claims our own site name (a bridge address pointing back at us)."""

    code = ROLE_CONFLICT


class Unauthorised(RemoteProtocolError):
    """The peer is not allowed to replicate with us (certificate, site name)."""

    code = UNAUTHORISED


class PeerFailure(RemoteProtocolError):
    """The peer failed on its own side (its database vanished, a bug) or sent
    an error code this version does not know."""

    code = PEER_FAILURE


class UnknownVpn(RemoteProtocolError):
    """A frame names a VPN that is not in the current resource list; usually
    a ``ResourceList`` crossed it on the wire. Nothing needs answering."""

    code = UNKNOWN_VPN
    closes_connection = False


class StaleEpoch(RemoteProtocolError):
    """A frame carries an epoch older than the VPN's known epoch (fencing)."""

    code = STALE_EPOCH
    closes_connection = False

    def __init__(
        self,
        text: str,
        vpn: str = "",
        *,
        known: int | None = None,
        got: int | None = None,
        reported_by_peer: bool = False,
    ) -> None:
        super().__init__(text, vpn, reported_by_peer=reported_by_peer)
        self.known = known
        self.got = got


class Gap(RemoteProtocolError):
    """An ``Events`` batch does not start at the next expected index.

    The standby resynchronises from its last *applied* index.
    """

    code = GAP
    closes_connection = False

    def __init__(
        self,
        text: str,
        vpn: str = "",
        *,
        expected: int | None = None,
        got: int | None = None,
        reported_by_peer: bool = False,
    ) -> None:
        super().__init__(text, vpn, reported_by_peer=reported_by_peer)
        self.expected = expected
        self.got = got


ERROR_CODES: dict[int, type[RemoteProtocolError]] = {
    cls.code: cls
    for cls in (
        BadFrame,
        BadChecksum,
        VersionMismatch,
        UnexpectedFrame,
        RoleConflict,
        Unauthorised,
        UnknownVpn,
        StaleEpoch,
        Gap,
        PeerFailure,
    )
}
