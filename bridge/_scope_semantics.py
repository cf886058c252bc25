"""Rewriting ``--queues`` patterns between the two meanings they have had.

A scope pattern is *searched* in a queue name, as RabbitMQ searches a
policy's ``pattern``: ``^orders\\.`` is a prefix, ``.`` matches every name.
Until bridge protocol version 5 (schema revision 0008) a pattern had to match
the *whole* name. Two rewrites keep a pattern's meaning across that change:

* :func:`anchored` turns a whole-name pattern into a searched one with the
  same matches: ``\\A(?:P)\\Z``. ``\\Z`` rather than ``$``, which would also
  match before a trailing newline.
* :func:`unanchored` turns a searched pattern into a whole-name one with the
  same matches, for a peer of protocol version 4:
  ``(?s:.*?)(?:P)(?s:.*)``. A match of P anywhere is a whole-name match with
  the text before and after it taken by the wildcards; ``^``, ``\\A`` and
  lookbehinds in P still see the whole name, so their meaning holds.

Python accepts global inline flags (``(?i)``, ``(?x)``) only at the start of
a pattern, so a leading run of them stays in front of the wrapper. Under
``(?x)`` a ``#`` in P starts a comment that runs to the end of the line: the
wrapper's closing parenthesis then goes on a line of its own.

Pure functions on strings, shared by the bridge (a version-4 peer) and the
CLI; the schema migration keeps a frozen copy of its own.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["anchored", "unanchored"]

#: a leading run of global inline flags, e.g. ``(?i)`` or ``(?i)(?x)``
_LEADING_FLAGS: Final = re.compile(r"(?:\(\?[aiLmsux]+\))+")


def _split(pattern: str) -> tuple[str, str, str]:
    """(leading flags, rest, line end before a closing parenthesis)."""
    m = _LEADING_FLAGS.match(pattern)
    flags = m.group(0) if m else ""
    verbose = "x" in flags
    return flags, pattern[len(flags) :], "\n" if verbose else ""


def anchored(pattern: str) -> str:
    """The searched pattern that matches exactly the names ``pattern``
    matched as a whole-name pattern."""
    flags, rest, eol = _split(pattern)
    return f"{flags}\\A(?:{rest}{eol})\\Z"


def unanchored(pattern: str) -> str:
    """The whole-name pattern that matches exactly the names in which
    ``pattern`` is found."""
    flags, rest, eol = _split(pattern)
    return f"{flags}(?s:.*?)(?:{rest}{eol})(?s:.*)"
