"""The client's side of client XA: :class:`XAResource`, replicated broker
work in a global transaction, speaking the XA wire to the node.
"""

from __future__ import annotations

from ._resource import XAResource

__all__ = [
    "XAResource",
]
