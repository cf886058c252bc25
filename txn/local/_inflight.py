"""A local transaction in flight on the coordinator: its step machine, its
spans, and the client's answer waiting for the decision.

The outcome is counted and the spans ended once (:meth:`InFlight.finish`),
whichever path ends the transaction.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from bridge import LocalTransaction

from ._machine import TxnMachine

__all__ = ["InFlight", "TxnStats", "tracer"]

tracer = trace.get_tracer("vpnrepl.txn")


@dataclass
class TxnStats:
    """Counters the coordinator bumps inline; ``/metrics`` reads them."""

    #: (vpn, outcome) -> transactions that ended so (the ``txn.outcome`` span attribute)
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: vpn -> transactions the standby committed early (ahead of the ledger stream)
    committed_early: Counter[str] = field(default_factory=Counter)


@dataclass
class InFlight:
    txn: LocalTransaction
    machine: TxnMachine
    done: asyncio.Future[bool]
    span: Span  # the transaction's span, parent of one span per phase
    stats: TxnStats
    published: tuple[bytes, ...] = ()
    #: a client's XA branch: its id (the broker commit waits for its commit)
    xid: str | None = None
    #: an XA branch's broker user
    owner: str | None = None
    phase: Span | None = None  # the phase under way
    finished: bool = False  # its outcome is counted and its span ended
    #: the listener's answer to call once the commit is recorded (commit_soon)
    on_done: Callable[[BaseException | None], None] | None = None
    #: a degraded transaction's group was handed over to be recorded as a
    #: sync-ineligible window (its answer waits for that)
    window_asked: bool = False
    #: closes the client's wait if the decision is not durable in time
    late_answer: asyncio.TimerHandle | None = None
    #: the client was told the outcome is unknown (the decision was late)
    answered_late: bool = False

    def enter(self, phase: str | None) -> None:
        """End the phase under way and start ``phase`` (None: no next phase)."""
        if self.phase is not None:
            self.phase.end()
            self.phase = None
        if phase is not None:
            self.phase = tracer.start_span(phase, context=trace.set_span_in_context(self.span))

    def finish(self, outcome: str, error: str | None = None) -> None:
        """End the transaction's spans (once) with its outcome."""
        if self.finished:
            return
        self.finished = True
        if self.xid is None:  # a client's XA branch is counted as such (txn.branches._manager)
            self.stats.outcomes[(self.txn.vpn, outcome)] += 1
        self.enter(None)
        self.span.set_attribute("txn.outcome", outcome)
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()
