"""Two sites replicating one VPN: the preamble two-site tests share."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from plugin.devtools import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.two_sites import enable, setup_vpn


class TwoNodes(NamedTuple):
    """Both sites, A's CLI and both nodes (not started)."""

    site_a: LocalSite
    site_b: LocalSite
    vpnrepl_a: Vpnrepl
    node_a: NodeProcess
    node_b: NodeProcess

    def replicating(self, *options: str) -> TwoNodes:
        """The workload's VPN on A, enabled for replication with ``options``
        (``vpn enable``'s), and both nodes started: B follows A."""
        setup_vpn(self.site_a)
        enable(self.vpnrepl_a, *options)
        self.node_a.start()
        self.node_b.start()
        return self


@pytest.fixture
def two_nodes(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> TwoNodes:
    return TwoNodes(site_a, site_b, vpnrepl_a, node_a, node_b)
