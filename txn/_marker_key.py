"""Commit markers nobody but the site's node can make.

Recovery reads a marker in :data:`~bridge.MARKER_QUEUE` as "the broker
committed it", and a publish whose ``CC`` or ``BCC`` header names that queue
can still route a client's message there (the listener refuses every method
a client sends on it). So a marker carries, after the transaction's id, an
HMAC-SHA256 of the vhost and that id under the site's secret (table
``marker_key``, which only the node's database role reads), and recovery
counts a marker only when its tag is right. Untagged markers, of an earlier
release, are believed only for incarnations below ``signs_from``
(docs/behaviour.md, "The schema", revision 0017).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

__all__ = ["MarkerKey"]

#: hex digits of the tag kept in a marker: 128 bits
_TAG_HEX = 32
_SEP = " "


@dataclass(frozen=True, slots=True)
class MarkerKey:
    """A site's marker secret, and the first incarnation that signs."""

    secret: bytes
    signs_from: int = 0

    @classmethod
    def new(cls) -> MarkerKey:
        """A key of this process alone (a listener not given its site's key):
        its markers cannot be forged, nor read by another process."""
        return cls(secrets.token_bytes(32))

    def _tag(self, vhost: str, name: str) -> str:
        message = vhost.encode() + b"\0" + name.encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()[:_TAG_HEX]

    def body(self, vhost: str, name: str) -> bytes:
        """The marker queue message body of marker ``name`` in ``vhost``."""
        return f"{name}{_SEP}{self._tag(vhost, name)}".encode()

    def name_of(self, vhost: str, body: bytes) -> str | None:
        """The marker a body found in ``vhost``'s marker queue is (None: a
        forged one, or not a marker)."""
        try:
            text = body.decode("ascii")  # every marker we make is ASCII
        except UnicodeDecodeError:
            return None
        name, sep, tag = text.rpartition(_SEP)
        if sep:
            expected = self._tag(vhost, name).encode()
            return name if hmac.compare_digest(tag.encode(), expected) else None
        return text if _incarnation(text) < self.signs_from else None


def _incarnation(name: str) -> int:
    """The incarnation in marker ``name`` (``[xa/<xid>/]<incarnation>.…``,
    perhaps with a ``#restored`` suffix); a huge one when there is none."""
    local = name.rpartition("/")[2]
    head = local.partition(".")[0]
    if not (head.isascii() and head.isdecimal() and 0 < len(head) < 19):
        return 1 << 63
    return int(head)
