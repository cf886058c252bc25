"""What the listener's driver must do after feeding a session.

Plain data: the session (``plugin.session._session``) and the channels it keeps
fill one :class:`Output` per call; the asyncio shell (``plugin.listener._server``)
carries it out. Its invariant: **each list is in the order the session made
it**, which is the order the frames came in, so writing ``to_broker`` and
``to_client`` as they are keeps every frame behind the ones read before it,
and the sink gets events in the order their frames arrived.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bridge import ConfirmKey, Event, LocalTransaction, Published

__all__ = ["LedgerMark", "Output", "XaCall"]


@dataclass(slots=True)
class LedgerMark:
    """Where a request went to the broker in its VPN's ledger order: the
    index the VPN's next event took when the request's bytes were written.
    The driver fills it (:func:`plugin.listener._sink.append_events`) before the
    broker's answer can come; 0 until then, or when the sink cannot say."""

    index: int = 0


@dataclass(frozen=True, slots=True)
class XaCall:
    """An XA request a client published on ``channel`` (``txn.xa._wire``),
    taken out of the stream: the node answers it."""

    channel: int
    verb: str
    correlation_id: str | None
    reply_to: str | None
    body: bytes


@dataclass(slots=True)
class Output:
    """What the driver must do after feeding the session."""

    to_broker: list[bytes] = field(default_factory=list)
    to_client: list[bytes] = field(default_factory=list)
    #: (event, confirm key or None): hand to ``ReplicationSink.append``.
    events: list[tuple[Event, ConfirmKey | None]] = field(default_factory=list)
    #: (how many of ``events`` came before it, mark): a request in
    #: ``to_broker`` whose place in the ledger order is to be recorded
    #: (a purge: ``plugin.session._topology_changes``); in the order of ``events``
    marks: list[tuple[int, LedgerMark]] = field(default_factory=list)
    #: transactions to prepare (sink.prepare, then ``transaction_prepared``).
    prepare: list[LocalTransaction] = field(default_factory=list)
    #: transactions to commit (sink.commit, then ``transaction_committed``).
    commit: list[LocalTransaction] = field(default_factory=list)
    #: prepared transactions whose broker commit will never be sent (sink.abort).
    abort: list[LocalTransaction] = field(default_factory=list)
    #: transactions whose tx.commit went to the broker but whose commit-ok
    #: will never be seen: the outcome is the marker's (sink.resolve).
    unresolved: list[LocalTransaction] = field(default_factory=list)
    #: replicated publishes the broker never answered: it died (``plugin.node._uncertain``).
    uncertain: list[Published] = field(default_factory=list)
    #: XA requests to answer (``plugin.listener._xa_gateway``).
    xa_calls: list[XaCall] = field(default_factory=list)
    #: channels holding an XA branch that closed (the broker rolled it back).
    xa_gone: list[int] = field(default_factory=list)
    #: the upstream connection is to be dropped without an AMQP close.
    drop_broker: bool = False
