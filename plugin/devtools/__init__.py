"""Local servers for the demo, the sandbox, the tests and the benchmarks.

Apart from the replication packages: nothing under ``plugin``, ``txn`` or
``bridge`` imports this package but the CLI's ``demo`` and ``sandbox``
commands (an import-linter contract keeps it so). It starts private
RabbitMQ nodes and PostgreSQL clusters from the Debian binaries on free
ports (:class:`LocalSites`: two sites), and runs ``vpnrepl demo``
(:func:`run_demo`) and ``vpnrepl sandbox`` (:func:`start_sandbox`,
:func:`stop_sandbox`).
"""

from __future__ import annotations

from ._demo import run_demo
from ._localnode import LocalNode
from ._localsites import LocalSite, LocalSites, kill_servers_in, sweep_orphans
from ._otlp import OtlpReceiver
from ._postgres import PostgresCluster
from ._processes import HarnessError, free_port, process_tree
from ._rabbit import RabbitNode
from ._sandbox import start_sandbox, stop_sandbox

__all__ = [
    "HarnessError",
    "LocalNode",
    "LocalSite",
    "LocalSites",
    "OtlpReceiver",
    "PostgresCluster",
    "RabbitNode",
    "free_port",
    "kill_servers_in",
    "process_tree",
    "run_demo",
    "start_sandbox",
    "stop_sandbox",
    "sweep_orphans",
]
