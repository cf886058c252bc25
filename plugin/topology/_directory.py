"""The listener's view of the site's VPNs: role, scope and topology per vhost.

Plain data, no I/O: the node refreshes it from the site database and the
broker's management API; the AMQP sessions read it on every connection.open
and every intercepted publish, and update topologies from what passes on the
wire.
"""

from __future__ import annotations

from dataclasses import dataclass

from bridge import Role

from ._scope import ReplicationScope
from ._topology import Topology

__all__ = ["VpnDirectory", "VpnView"]


@dataclass(slots=True)
class VpnView:
    """One replicated VPN as the listener sees it."""

    name: str
    role: Role
    scope: ReplicationScope
    topology: Topology
    #: consumers see our id header (``vpn enable --expose-id``)
    expose_id: bool = False
    #: ``sync`` or ``async``, as last read from the site's settings
    mode: str = "async"
    #: why clients are refused (530) although the VPN is active here: its
    #: promotion is still running, or a newer epoch took it over (fenced)
    refusal: str | None = None

    @property
    def replicated(self) -> bool:
        """Only an active VPN replicates what its clients do."""
        return self.role is Role.ACTIVE


class VpnDirectory:
    """The VPNs with replication enabled on this site, by vhost name."""

    def __init__(self) -> None:
        self._vpns: dict[str, VpnView] = {}

    def lookup(self, vhost: str) -> VpnView | None:
        return self._vpns.get(vhost)

    def put(self, view: VpnView) -> None:
        self._vpns[view.name] = view

    def remove(self, vhost: str) -> None:
        self._vpns.pop(vhost, None)

    def names(self) -> list[str]:
        return sorted(self._vpns)
