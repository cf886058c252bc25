"""Topology requests as typed values (``plugin.session._topology_changes``), alone.

How the session holds them until the broker's -ok, and what a purge or a
delete sends to the sink, is in ``tests/unit/plugin/session/test_session.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
from pamqp import commands as C

from plugin.session import (
    NAMES_A_QUEUE,
    REFUSABLE,
    BindExchange,
    BindQueue,
    DeclareExchange,
    DeclareQueue,
    DeleteExchange,
    DeleteQueue,
    PurgeQueue,
    UnbindExchange,
    UnbindQueue,
    change_of,
)
from plugin.topology import Topology

ARGS = {"x-match": "any", "k": 1}


@pytest.mark.parametrize(
    ("method", "change"),
    [
        (
            C.Exchange.Declare(
                exchange="e", exchange_type="topic", auto_delete=True, arguments=ARGS
            ),
            DeclareExchange("e", "topic", ARGS, internal=False, auto_delete=True),
        ),
        (C.Exchange.Delete(exchange="e"), DeleteExchange("e")),
        (
            C.Exchange.Bind(destination="d", source="s", routing_key="k", arguments=ARGS),
            BindExchange("d", "s", "k", ARGS),
        ),
        (
            C.Exchange.Unbind(destination="d", source="s", routing_key="k"),
            UnbindExchange("d", "s", "k", {}),
        ),
        (
            C.Queue.Declare(queue="q", exclusive=True, arguments=ARGS),
            DeclareQueue("q", ARGS, exclusive=True),
        ),
        (C.Queue.Delete(queue="q"), DeleteQueue("q")),
        (C.Queue.Purge(queue="q"), PurgeQueue("q")),
        (
            C.Queue.Bind(queue="q", exchange="e", routing_key="k", arguments=ARGS),
            BindQueue("q", "e", "k", ARGS),
        ),
        (C.Queue.Unbind(queue="q", exchange="e", routing_key="k"), UnbindQueue("q", "e", "k", {})),
    ],
)
def test_each_request_becomes_the_value_of_its_change(method: object, change: object) -> None:
    made = change_of(method)  # type: ignore[arg-type]
    assert made == change
    first = dataclasses.fields(made)[0].name  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, first, "other")


@pytest.mark.parametrize(
    "method",
    [
        C.Exchange.Declare(exchange="e", passive=True),
        C.Queue.Declare(queue="q", passive=True),
        C.Basic.Qos(),
    ],
)
def test_a_request_that_changes_nothing_has_no_change(method: object) -> None:
    assert change_of(method) is None  # type: ignore[arg-type]


def test_a_change_holds_its_own_copy_of_the_arguments() -> None:
    arguments = {"x-dead-letter-exchange": "dlx"}
    change = change_of(C.Queue.Declare(queue="q", arguments=arguments))
    arguments["x-dead-letter-exchange"] = "other"
    assert isinstance(change, DeclareQueue)
    assert change.arguments == {"x-dead-letter-exchange": "dlx"}


def test_applied_changes_build_the_topology_the_broker_has() -> None:
    topology = Topology("orders")
    for change in (
        DeclareExchange("e", "direct"),
        DeclareExchange("f", "fanout"),
        DeclareQueue("", {}),
        BindExchange("f", "e", "k"),
        BindQueue("q", "f", ""),
    ):
        if isinstance(change, DeclareQueue):
            change.apply(topology, "q")  # the name the declare-ok gave
        else:
            change.apply(topology)
    assert topology.route("e", "k", None) == {"q"}
    PurgeQueue("q").apply(topology)  # the model holds no messages
    assert topology.route("e", "k", None) == {"q"}
    UnbindExchange("f", "e", "k").apply(topology)
    assert topology.route("e", "k", None) == set()
    BindQueue("q", "e", "k").apply(topology)
    UnbindQueue("q", "e", "k").apply(topology)
    DeleteQueue("q").apply(topology)
    DeleteExchange("e").apply(topology)
    assert "q" not in topology.queues and "e" not in topology.exchanges


def test_the_changes_a_nowait_request_may_have_refused_name_a_queue_or_an_exchange() -> None:
    assert set(REFUSABLE) == {DeleteQueue, PurgeQueue, DeleteExchange}
    assert all("queue" in {f.name for f in dataclasses.fields(c)} for c in NAMES_A_QUEUE)
