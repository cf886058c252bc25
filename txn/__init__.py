"""Transactions over both sites: local transactions as an internal
two-phase (XA) commit, and clients' own XA branches.

The middle layer (``plugin`` → ``txn`` → ``bridge``). Its subpackages:
``local`` (local transactions: the step table, the coordinator and its
recovery, the participant, ``txn_log``, commit markers), ``xa`` (the XA
protocol between a client and the node, sans-IO), ``branches`` (the node as
the resource manager of client XA branches) and ``client`` (the client's
:class:`~txn.client.XAResource`). This package's own name is the commit
markers' key, which the listener's sans-IO session uses.
"""

from __future__ import annotations

from ._marker_key import MarkerKey

__all__ = ["MarkerKey"]
