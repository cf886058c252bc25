"""``vpnrepl node``: the site process that wires the listener, the bridge,
transactions, the admin endpoint and the operator's requests together
(:func:`run_node`).
"""

from __future__ import annotations

from ._run import run_node

__all__ = [
    "run_node",
]
