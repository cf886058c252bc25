"""Client XA branches: the node is their resource manager.

A branch's prepare, commit, rollback and recovery over both sites, on
top of the local transactions' coordinator (:class:`XaCoordinator`).
"""

from __future__ import annotations

from ._manager import BranchChannel, XaCoordinator, XaStats

__all__ = [
    "BranchChannel",
    "XaCoordinator",
    "XaStats",
]
