"""Publisher confirms held until a replicated publish is durable.

Each publish of a confirm channel on a replicated connection gets a
:class:`HeldConfirm` in the channel's :class:`HeldConfirms`; the broker's ack
or nack is not relayed. The client gets ``basic.ack`` once the broker acked
and, for a replicated publish, the sink made it durable, else ``basic.nack``
(a replicated publish the broker nacked is taken back with a
:class:`Consumed` event per queue, so both sites hold what the broker holds).

Invariant: a confirm is released once, and ``multiple`` never spans a held
tag. :meth:`HeldConfirms.release` releases the ready entries at the front of
``order`` as ``multiple`` runs cut where the verdict changes, and stops at
the first held one; ready entries behind it go one by one, by name; each
release deletes its entry from ``pending``, and only entries still there are
released. (The node's own publishes: :class:`bridge.amqp.BrokerConfirms`.)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from bridge import ConfirmKey, Consumed, Event, Published, amqp

__all__ = ["HeldConfirms", "HeldConfirm"]


@dataclass(slots=True)
class HeldConfirm:
    """One publish's confirm, until it is released."""

    replicated: bool = False
    broker: bool | None = None  # True ack, False nack, None not yet
    durable: bool | None = None  # sink outcome for replicated publishes
    #: the replicated publish, kept until the broker has answered: a broker
    #: nack (e.g. a full queue with reject-publish) must take it back out
    event: Published | None = None

    @property
    def ready(self) -> bool:
        if self.broker is None:
            return False
        return not self.replicated or self.durable is not None

    @property
    def ok(self) -> bool:
        return bool(self.broker) and (not self.replicated or bool(self.durable))


class HeldConfirms:
    """The client's confirms the listener holds on one channel in confirm
    mode (see the module's invariant).

    ``channel`` is the channel number, for the frames released. On a
    connection that replicates nothing the tracker only numbers publishes
    (:meth:`number`); confirms then pass as the broker sends them.
    """

    __slots__ = ("channel", "next_seq", "order", "pending")

    def __init__(self, channel: int) -> None:
        self.channel = channel
        self.next_seq = 1
        #: sequence number -> its confirm, until released
        self.pending: dict[int, HeldConfirm] = {}
        #: sequence numbers in publish order; released ones are skipped lazily
        self.order: deque[int] = deque()

    def number(self) -> int:
        """The next publish's sequence number, its confirm not held."""
        seq = self.next_seq
        self.next_seq = seq + 1
        return seq

    def hold(self) -> int:
        """The next publish's sequence number, its confirm held from now."""
        seq = self.next_seq
        self.next_seq = seq + 1
        self.pending[seq] = HeldConfirm()
        self.order.append(seq)
        return seq

    def replicated(self, seq: int, event: Published) -> None:
        """The publish ``seq`` went to the sink as ``event``: its confirm
        waits for the sink's verdict too."""
        entry = self.pending[seq]
        entry.replicated, entry.event = True, event

    def unanswered(self) -> list[Published]:
        """The replicated publishes the broker has not answered yet."""
        return [
            e.event
            for e in self.pending.values()
            if e.replicated and e.broker is None and e.event is not None
        ]

    def broker_answered(self, tag: int, multiple: bool, ok: bool) -> list[int]:
        """The broker's ack (``ok``) or nack of ``tag`` (and every lower tag
        with ``multiple``); returns the sequence numbers it answered."""
        pending = self.pending
        changed: list[int] = []
        if multiple:
            for seq in self.order:
                if seq > tag:
                    break
                entry = pending.get(seq)
                if entry is not None and entry.broker is None:
                    entry.broker = ok
                    changed.append(seq)
        elif tag in pending:
            pending[tag].broker = ok
            changed.append(tag)
        return changed

    def sink_answered(self, seq: int, ok: bool) -> bool:
        """The sink's verdict on the replicated publish ``seq``; True if its
        confirm may be released now (the broker has answered too)."""
        entry = self.pending.get(seq)
        if entry is None:
            return False
        entry.durable = ok
        return entry.broker is not None

    def release(
        self,
        changed: list[int],
        out: list[bytes],
        events: list[tuple[Event, ConfirmKey | None]],
    ) -> None:
        """Append to ``out`` the confirm frames that became ready; see the
        module's invariant. ``changed`` are the sequence numbers whose state
        just changed. A replicated publish the broker nacked is taken back
        into ``events``."""
        channel = self.channel
        pending, order = self.pending, self.order
        run_seq, run_ok, run_len = 0, True, 0
        while order:
            seq = order[0]
            entry = pending.get(seq)
            if entry is None:  # released earlier, behind a held one
                order.popleft()
                continue
            if not entry.ready:
                break
            ok = entry.ok
            if entry.broker is False and entry.event is not None:
                _take_back(entry.event, events)
            if run_len and ok != run_ok:
                out.append(_confirm_frame(channel, run_seq, run_ok, multiple=run_len > 1))
                run_len = 0
            run_seq, run_ok, run_len = seq, ok, run_len + 1
            del pending[seq]
            order.popleft()
        if run_len:
            out.append(_confirm_frame(channel, run_seq, run_ok, multiple=run_len > 1))
        for seq in changed:
            entry = pending.get(seq)
            if entry is not None and entry.ready:
                if entry.broker is False and entry.event is not None:
                    _take_back(entry.event, events)
                out.append(_confirm_frame(channel, seq, entry.ok, multiple=False))
                del pending[seq]


def _take_back(event: Published, events: list[tuple[Event, ConfirmKey | None]]) -> None:
    """The broker refused a publish the sink already has: replicate its
    removal, so both sites hold what the broker holds."""
    for queue in event.queues:
        events.append((Consumed(event.vpn, event.repl_id, queue), None))


def _confirm_frame(channel: int, tag: int, ok: bool, multiple: bool) -> bytes:
    if ok:
        return amqp.encode_ack(channel, tag, multiple)
    return amqp.encode_nack(channel, tag, multiple)
