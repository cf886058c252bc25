"""Commit markers nobody but the site's node can make.

Crash recovery reads a local transaction's commit marker
(:data:`~bridge.MARKER_QUEUE`) as "the broker committed it", so a marker a
client put there would steer recovery. The listener refuses every method a
client sends on the marker queue, but a publish whose ``CC`` or ``BCC``
header names it can still route a message there. So a marker carries, after
the transaction's id, an HMAC-SHA256 of the vhost and that id under a secret
of the site (table ``marker_key``, which only the node's database role
reads): recovery counts a marker only when its tag is right. A marker a
client forged is no marker.

Markers written before a site had its key (a node of an earlier release)
carry no tag. They are taken for what they say only when their
transaction's incarnation is below ``signs_from`` (the first incarnation
after the key was made); an untagged marker naming a later incarnation is
forged.
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
