"""The broker's publisher confirms of what the node's own client published.

Invariant: **a message counts as confirmed once, and only after the broker
acked its delivery tag.** Delivery tags are handed out densely from 1
(:meth:`BrokerConfirms.sent`); the broker confirms each exactly once,
singly or ``multiple`` (everything up to a tag). An ack for a tag never
sent or one confirmed before is the broker's protocol error, raised, never
silently counted.

(The confirms the listener holds for its clients are another thing:
``plugin.session.HeldConfirms``.)
"""

from __future__ import annotations

from ._errors import BrokerProtocolError

__all__ = ["BrokerConfirms"]


class BrokerConfirms:
    """Publisher-confirm bookkeeping for one confirm channel of ours."""

    __slots__ = ("_ahead", "_low", "confirmed", "next_tag")

    def __init__(self) -> None:
        self.next_tag = 1
        self.confirmed = 0
        self._low = 1  # lowest tag not confirmed
        self._ahead: set[int] = set()  # tags above _low confirmed singly

    @property
    def unconfirmed(self) -> int:
        return self.next_tag - 1 - self.confirmed

    def sent(self, count: int) -> None:
        self.next_tag += count

    def ack(self, tag: int, multiple: bool) -> int:
        """Record a ``basic.ack``; returns how many tags it newly confirmed."""
        if not 1 <= tag < self.next_tag:
            raise BrokerProtocolError(f"the broker acked delivery tag {tag}, never published")
        if multiple:
            if tag < self._low:
                return 0  # nothing new: everything up to it was confirmed
            newly = tag - self._low + 1
            if self._ahead:
                covered = {t for t in self._ahead if t <= tag}
                newly -= len(covered)
                self._ahead -= covered
            self._low = tag + 1
        else:
            if tag < self._low or tag in self._ahead:
                raise BrokerProtocolError(f"the broker acked delivery tag {tag} twice")
            newly = 1
            if tag == self._low:
                self._low += 1
            else:
                self._ahead.add(tag)
        ahead = self._ahead
        while ahead and self._low in ahead:
            ahead.remove(self._low)
            self._low += 1
        self.confirmed += newly
        return newly
