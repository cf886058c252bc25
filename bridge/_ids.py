"""Replication ids: what makes every replicated message unique across
restarts and failovers, and how an id travels in the message's headers.

Invariant: no id is ever handed out twice. An id is put into the message
before its ledger entry is durable, so it is never derived from the ledger
index (a restarted node would hand that index out again); it is a process
incarnation, persisted at start, and a counter (:class:`IdSource`).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "COUNTER_BITS",
    "INCARNATION_BITS",
    "INCARNATION_LIMIT",
    "REPLICATION_HEADER",
    "IdSource",
    "IdsExhausted",
    "ReplicationId",
    "id_in_header",
]

#: The message header carrying a replication id (our own: JMS clients do not
#: set ``message_id``, and a client's own properties must stay the client's).
#: Its value is a signed 64-bit integer (AMQP field type ``l``), the id's
#: :attr:`ReplicationId.wire` form. Why not the 32 hex digits it once was:
#: RabbitMQ 3.10 spends 10-20 % more CPU per persistent message once the
#: content header's properties pass 64 bytes (Erlang's limit for binaries
#: copied onto a process heap), measured with the same lean publisher direct
#: to the broker: a compact client (28 bytes of properties) went from ~1.0 to
#: ~0.87 of its own rate with the hex header (+54 bytes) and stayed at ~1.0
#: with the integer (+26 bytes); a client already past 64 bytes pays that
#: cost whatever we add. Messages carrying the hex form (published by an
#: earlier version) are still recognised.
#:
#: Consumers never see it (unless the VPN exposes it): the listener cuts it
#: out of every message it hands a client. When the publisher sent no
#: headers table at all, the table is ours alone and must go too; the value
#: then says so by being negative (the wire form complemented), since an
#: empty table the publisher did send looks the same once our entry is out.
REPLICATION_HEADER = "x-vpnrepl-id"
#: An id is an incarnation (one per node start, from the site database) and a
#: counter; in the header they share one positive int64.
INCARNATION_BITS = 19
COUNTER_BITS = 44
INCARNATION_LIMIT = 1 << INCARNATION_BITS  # exclusive
COUNTER_LIMIT = 1 << COUNTER_BITS  # exclusive
#: counters left when an :class:`IdSource` asks for a new incarnation
RENEW_MARGIN = 1 << 32


_U64 = struct.Struct(">Q").pack
_I64 = struct.Struct(">q").pack
_I64_FROM = struct.Struct(">q").unpack_from
_new_id = object.__new__
_set = object.__setattr__


class IdsExhausted(RuntimeError):
    """An :class:`IdSource` ran out of counters before it got a new incarnation."""


@dataclass(frozen=True, slots=True)
class ReplicationId:
    """A process incarnation (persisted at start) and a counter, 8 bytes each
    (big-endian) as stored; ids made by :class:`IdSource` fit the header's
    64-bit :attr:`wire` form (19 + 44 bits).

    Not derived from the ledger index: the id is put into the message before
    its ledger entry is durable, so a restarted node must never hand out an
    id again; a new incarnation guarantees it.
    """

    value: bytes

    def __post_init__(self) -> None:
        if len(self.value) != 16:
            raise ValueError(f"a replication id is 16 bytes, got {len(self.value)}")

    @classmethod
    def from_parts(cls, incarnation: int, counter: int) -> ReplicationId:
        if not 0 <= incarnation < 2**64 or not 0 <= counter < 2**64:
            raise ValueError("incarnation and counter must fit in 64 bits")
        return cls(incarnation.to_bytes(8, "big") + counter.to_bytes(8, "big"))

    @classmethod
    def from_hex(cls, text: str) -> ReplicationId:
        if len(text) != 32:
            raise ValueError(f"a replication id is 32 hex digits, got {len(text)}")
        return cls(bytes.fromhex(text))

    @classmethod
    def from_wire(cls, wire: int) -> ReplicationId:
        """The id whose header value is ``wire``."""
        if not 0 <= wire < 1 << 63:
            raise ValueError(f"a replication id's header value is a positive int64, got {wire}")
        return cls.from_parts(wire >> COUNTER_BITS, wire & (COUNTER_LIMIT - 1))

    @property
    def wire(self) -> int:
        """The header value: incarnation and counter in one positive int64."""
        incarnation = int.from_bytes(self.value[:8], "big")
        counter = int.from_bytes(self.value[8:], "big")
        if incarnation >= INCARNATION_LIMIT or counter >= COUNTER_LIMIT:
            raise ValueError(f"replication id {self.hex} does not fit the 64-bit header form")
        return incarnation << COUNTER_BITS | counter

    @property
    def hex(self) -> str:
        return self.value.hex()

    def __str__(self) -> str:
        return self.hex


def id_in_header(value: bytes) -> tuple[ReplicationId, bool] | None:
    """The replication id in our header's encoded field value (type octet
    and data), and whether the headers table is ours alone; None when the
    value is not one of ours. An int64 (negative: the table is ours alone),
    or the 32 hex digits of messages published by an earlier version."""
    try:
        if len(value) == 9 and value[0] == ord("l"):
            wire = _I64_FROM(value, 1)[0]
            return ReplicationId.from_wire(~wire if wire < 0 else wire), wire < 0
        if len(value) == 5 + 32 and value[0] == ord("S"):
            return ReplicationId.from_hex(value[5:].decode("ascii")), False
    except ValueError:  # incl. UnicodeDecodeError: not one of ours
        return None
    return None


class IdSource:
    """Hands out replication ids for one process incarnation.

    ``first`` is the first counter (tests start near the end). When fewer
    than :data:`RENEW_MARGIN` counters are left, ``on_low`` is called once:
    the node records a new incarnation and hands it over with :meth:`renew`
    (at 100,000 messages a second that margin lasts half a day; the counter
    itself lasts five years). Running out before that raises
    :class:`IdsExhausted` rather than reusing an id.

    Across sites: each site numbers its incarnations from its own sequence,
    so both sites can hold the same incarnation number. That is safe while a
    VPN's ids are made only on its active site; a promotion first moves the
    site's ``node_incarnation`` sequence past every incarnation in that
    VPN's replicated state (``bridge.roles._roles``), so the new active never
    repeats an id the old one handed out.
    """

    def __init__(
        self, incarnation: int, *, first: int = 1, on_low: Callable[[], None] | None = None
    ) -> None:
        self.on_low = on_low
        self.renew(incarnation, first)

    def renew(self, incarnation: int, first: int = 1) -> None:
        """Continue with ``incarnation`` (a new one, never used before)."""
        if not 1 <= incarnation < INCARNATION_LIMIT:
            raise ValueError(
                f"incarnation {incarnation} does not fit a replication id "
                f"(1 to {INCARNATION_LIMIT - 1})"
            )
        if not 1 <= first < COUNTER_LIMIT:
            raise ValueError(f"first counter {first} out of range")
        self.incarnation = incarnation
        self._prefix = incarnation.to_bytes(8, "big")
        self._base = incarnation << COUNTER_BITS
        self._counter = itertools.count(first)
        self._low_at = COUNTER_LIMIT - RENEW_MARGIN
        self._asked = False

    def next(self) -> ReplicationId:
        return self.next_with_wire()[0]

    def next_with_wire(self, alone: bool = False) -> tuple[ReplicationId, bytes]:
        """The next id and its header value as 8 big-endian bytes (the
        listener's hot path: cheaper than :attr:`ReplicationId.wire`).

        ``alone``: the header goes into a headers table the publisher did
        not send; the value is then the id's wire form complemented (a
        negative int64), which tells the listener to remove the whole table
        again on delivery (:func:`id_in_header`)."""
        n = next(self._counter)
        if n >= self._low_at:
            self._running_low(n)
        # 16 bytes by construction: skip the validating __init__ (hot path)
        rid = _new_id(ReplicationId)
        _set(rid, "value", self._prefix + _U64(n))
        if alone:
            return rid, _I64(~(self._base | n))
        return rid, _U64(self._base | n)

    def _running_low(self, n: int) -> None:
        if n >= COUNTER_LIMIT:
            raise IdsExhausted(
                f"incarnation {self.incarnation} has used all {COUNTER_LIMIT - 1} replication "
                "ids and no new incarnation was recorded: restart the node"
            )
        if not self._asked:
            self._asked = True
            if self.on_low is not None:
                self.on_low()
