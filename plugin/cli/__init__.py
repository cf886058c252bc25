"""``vpnrepl``: the broker admin's command line and its ``status`` table."""

from __future__ import annotations

from ._cli import main
from ._status_table import render

__all__ = [
    "main",
    "render",
]
