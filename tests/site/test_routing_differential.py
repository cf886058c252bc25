"""The routing engine against the real thing: random topologies and messages
go to the harness's RabbitMQ 3.10.8 and to :class:`Topology`, and where the
broker put each message must be exactly what ``route()`` says.

Each operation is sent to the broker first and applied to the model only when
the broker answered ``-ok`` (as the listener does), so refused binds, deletes
of missing or reserved things and auto-delete cascades are covered too. Every
example also rebuilds the model from ``GET /api/definitions/{vhost}`` and
holds it to the same answers. Arguments and headers reach the model as pamqp
decodes what pika put on the wire.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from typing import Any
from urllib.parse import quote

import pika
import pika.data
import pika.exceptions
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings, strategies as st
from pamqp import decode

from plugin.devtools import LocalSite
from plugin.topology import Topology, tagged
from tests.unit.plugin.topology.test_topology import HEADERS_CASES, TOPIC_CASES, VALUE_CASES

EXCHANGES = ["x0", "x1", "x2", "x3"]
QUEUES = ["q0", "q1", "a", "a.b"]  # "a" and "a.b" are also routing keys
SOURCES = [*EXCHANGES, "amq.direct", "amq.topic", "amq.headers", "amq.fanout", "nope"]
TARGETS = [*EXCHANGES, "", "amq.direct", "amq.topic", "amq.headers", "amq.fanout", "nope"]
TYPES = ["direct", "fanout", "topic", "headers"]
HEADER_KEYS = ["h1", "h2", "x-h", "CC", "BCC"]
CORE_VALUES = [1, 2, "v", True]
MORE_VALUES = [
    "1",
    False,
    b"v",
    2**40,
    Decimal("1.5"),
    Decimal("15"),
    15,
    1577836800,
    datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC),
    [1, "v"],
    {"k": 1},
    {},
    [],
]


def wire(table: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the listener's pamqp sees of a table pika sends."""
    if table is None:
        return None
    pieces: list[bytes] = []
    pika.data.encode_table(pieces, table)
    return decode.field_table(b"".join(pieces))[1]


# -- strategies ----------------------------------------------------------------

words = st.sampled_from(["a", "b", ""])
pattern_words = st.sampled_from(["a", "b", "", "*", "#"])
routing_keys = st.lists(words, max_size=3).map(".".join)
binding_keys = st.lists(pattern_words, max_size=3).map(".".join)
values = st.one_of(st.sampled_from(CORE_VALUES), st.sampled_from(MORE_VALUES))
binding_values = st.one_of(st.none(), values)
# values RabbitMQ compares equal although pika sends them as different types,
# and look-alikes it does not; a header often carries one of these instead
EQUAL_ACROSS_TYPES: list[tuple[object, object]] = [
    ("v", b"v"),
    (1577836800, datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)),
    (2**40, 2**40),
    ({}, []),
]
LOOK_ALIKES: list[tuple[object, object]] = [
    (1, True),
    (15, Decimal("15")),
    ("1", 1),
    ([1, "v"], [1, b"v"]),
    ({"k": 1}, {"k": True}),
]


def rarely(draw: st.DrawFn, one_in: int) -> bool:
    """True about once in ``one_in`` draws. The rare case must not be the
    minimal draw: hypothesis tries minimal and near-minimal data far more
    often than its share."""
    return bool(draw(st.integers(1, one_in)) == one_in)


def counterpart(draw: st.DrawFn, value: object) -> object:
    """``value``, or a value of another type that may or may not equal it."""
    for a, b in EQUAL_ACROSS_TYPES + LOOK_ALIKES:
        for mine, other in ((a, b), (b, a)):
            if type(mine) is type(value) and mine == value and draw(st.booleans()):
                return other
    return value


@st.composite
def binding_args(draw: st.DrawFn) -> dict[str, Any]:
    if rarely(draw, 5):
        return {}
    args = draw(st.dictionaries(st.sampled_from(HEADER_KEYS), binding_values, max_size=3))
    mode = draw(st.sampled_from([None, "all", "any", "all-with-x", "any-with-x", "any", "bogus"]))
    if mode is not None:
        args["x-match"] = mode
    return args


@st.composite
def cc_values(draw: st.DrawFn) -> object:
    if rarely(draw, 6):  # the broker refuses these, or skips the odd elements
        return draw(st.sampled_from(["a", None, [1, "a"], [b"a", "b"]]))
    return draw(st.lists(st.one_of(routing_keys, st.sampled_from(QUEUES)), max_size=2))


@st.composite
def message_headers(
    draw: st.DrawFn, bindings: list[tuple[str, str, str, dict[str, Any]]]
) -> dict[str, Any] | None:
    """Often a binding's own arguments: a match, or a near miss once a key is
    dropped or a value swapped for one of another type."""
    if rarely(draw, 6):
        return None
    headers: dict[str, Any] = {}
    with_args = [b[3] for b in bindings if b[3]]
    if with_args and not rarely(draw, 3):
        chosen = draw(st.sampled_from(with_args))
        for k, v in chosen.items():
            if k == "x-match" or rarely(draw, 4):
                continue
            headers[k] = v if v is None or k in ("CC", "BCC") else counterpart(draw, v)
    headers.update(draw(st.dictionaries(st.sampled_from(HEADER_KEYS[:3]), binding_values)))
    for name in ("CC", "BCC"):
        if name in headers or rarely(draw, 3):
            headers[name] = draw(cc_values())
    return headers


@st.composite
def instance_of(draw: st.DrawFn, pattern: str) -> str:
    """A routing key the topic pattern is likely to match."""
    out: list[str] = []
    for word in pattern.split(".") if pattern else []:
        if word == "*":
            out.append(draw(words))
        elif word == "#":
            out.extend(draw(st.lists(words, max_size=2)))
        else:
            out.append(word)
    return ".".join(out)


@dataclass(frozen=True, slots=True)
class ExchangeSpec:
    name: str
    type: str
    internal: bool
    auto_delete: bool
    ae: str | None


@dataclass(frozen=True, slots=True)
class Scenario:
    exchanges: list[ExchangeSpec]
    queues: list[str]
    queue_bindings: list[tuple[str, str, str, dict[str, Any]]]
    exchange_bindings: list[tuple[str, str, str, dict[str, Any]]]
    removals: list[tuple[str, Any]]
    messages: list[tuple[str, dict[str, Any] | None]]  # each goes to every exchange

    def publishes(self) -> list[tuple[str, str, dict[str, Any] | None]]:
        return [(x, key, headers) for key, headers in self.messages for x in TARGETS]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """Mostly well-formed: bindings between declared things, messages whose
    keys and headers come from the bindings, so most publishes route
    somewhere; a few name missing things, which the broker refuses."""
    names = draw(st.lists(st.sampled_from(EXCHANGES), min_size=2, max_size=4, unique=True))
    exchanges = [
        ExchangeSpec(
            name,
            draw(st.sampled_from(TYPES)),
            rarely(draw, 8),
            rarely(draw, 3),
            None if rarely(draw, 3) else draw(st.sampled_from([*names, "amq.fanout", "nope"])),
        )
        for name in names
    ]
    queues = draw(st.lists(st.sampled_from(QUEUES), min_size=2, max_size=4, unique=True))
    sources = st.one_of(st.sampled_from(names), st.sampled_from(names), st.sampled_from(SOURCES))
    dests = st.one_of(st.sampled_from(queues), st.sampled_from(queues), st.sampled_from(QUEUES))
    queue_bindings = draw(
        st.lists(st.tuples(dests, sources, binding_keys, binding_args()), min_size=2, max_size=10)
    )
    exchange_bindings = draw(
        st.lists(
            st.tuples(st.sampled_from(names), sources, binding_keys, binding_args()), max_size=5
        )
    )
    removals = draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("unbind"), st.integers(0, 14)),
                st.tuples(st.just("unbind"), st.integers(0, 14)),
                st.tuples(st.just("delete_queue"), st.sampled_from(QUEUES)),
                st.tuples(st.just("delete_exchange"), st.sampled_from([*EXCHANGES, "amq.direct"])),
            ),
            max_size=3,
        )
    )
    bound = queue_bindings + exchange_bindings
    patterns = st.sampled_from([k for _, _, k, _ in bound])
    keys = st.one_of(routing_keys, patterns, patterns.flatmap(instance_of))
    messages = draw(st.lists(st.tuples(keys, message_headers(bound)), min_size=8, max_size=20))
    return Scenario(exchanges, queues, queue_bindings, exchange_bindings, removals, messages)


# -- the broker side -------------------------------------------------------------


class Mirror:
    """Sends each operation to the broker; applies it to the model on -ok."""

    def __init__(self, site: LocalSite, vhost: str) -> None:
        self.site = site
        self.vhost = vhost
        self.model = Topology(vhost)
        self.conn = pika.BlockingConnection(pika.URLParameters(site.rabbit.amqp_url(vhost)))
        self.ch = self._channel()

    def _channel(self) -> Any:
        ch = self.conn.channel()
        ch.confirm_delivery()
        return ch

    def attempt(self, broker_op: Callable[[Any], object], model_op: Callable[[], None]) -> bool:
        try:
            broker_op(self.ch)
        except pika.exceptions.ChannelClosedByBroker:
            self.ch = self._channel()
            return False
        model_op()
        return True

    def declare(self, x: ExchangeSpec) -> None:
        args = {"alternate-exchange": x.ae} if x.ae else {}
        self.attempt(
            lambda ch: ch.exchange_declare(
                x.name, x.type, auto_delete=x.auto_delete, internal=x.internal, arguments=args
            ),
            lambda: self.model.declare_exchange(
                x.name, x.type, wire(args), x.internal, auto_delete=x.auto_delete
            ),
        )

    def declare_queue(self, q: str) -> None:
        self.attempt(lambda ch: ch.queue_declare(q), lambda: self.model.declare_queue(q, {}))

    def bind_queue(self, q: str, x: str, key: str, args: dict[str, Any]) -> bool:
        return self.attempt(
            lambda ch: ch.queue_bind(q, x, key, args),
            lambda: self.model.bind_queue(q, x, key, wire(args)),
        )

    def bind_exchange(self, dest: str, src: str, key: str, args: dict[str, Any]) -> bool:
        return self.attempt(
            lambda ch: ch.exchange_bind(dest, src, key, args),
            lambda: self.model.bind_exchange(dest, src, key, wire(args)),
        )

    def unbind(self, kind: str, dest: str, src: str, key: str, args: dict[str, Any]) -> None:
        if kind == "queue":
            self.attempt(
                lambda ch: ch.queue_unbind(dest, src, key, args),
                lambda: self.model.unbind_queue(dest, src, key, wire(args)),
            )
        else:
            self.attempt(
                lambda ch: ch.exchange_unbind(dest, src, key, args),
                lambda: self.model.unbind_exchange(dest, src, key, wire(args)),
            )

    def delete_queue(self, q: str) -> None:
        self.attempt(lambda ch: ch.queue_delete(q), lambda: self.model.delete_queue(q))

    def delete_exchange(self, x: str) -> None:
        self.attempt(lambda ch: ch.exchange_delete(x), lambda: self.model.delete_exchange(x))

    def publish(self, i: int, exchange: str, key: str, headers: dict[str, Any] | None) -> None:
        props = pika.BasicProperties(message_id=str(i), headers=headers)
        self.attempt(lambda ch: ch.basic_publish(exchange, key, b"m", props), lambda: None)

    def delivered(self) -> dict[str, list[int]]:
        """Every message id in every queue of the vhost, drained."""
        got: dict[str, list[int]] = {}
        for q in self.site.rabbit.api("GET", f"queues/{quote(self.vhost, safe='')}"):
            ids = got.setdefault(q["name"], [])
            while True:
                method, props, _ = self.ch.basic_get(q["name"], auto_ack=True)
                if method is None:
                    break
                ids.append(int(props.message_id) if props.message_id else -1)
        return got

    def definitions(self) -> dict[str, Any]:
        defs: dict[str, Any] = self.site.rabbit.api(
            "GET", f"definitions/{quote(self.vhost, safe='')}"
        )
        return defs

    def close(self) -> None:
        if self.conn.is_open:
            self.conn.close()


@contextmanager
def mirror(site: LocalSite) -> Iterator[Mirror]:
    vhost = f"diff-{uuid.uuid4().hex[:12]}"
    site.rabbit.add_vhost(vhost)
    m = Mirror(site, vhost)
    try:
        yield m
    finally:
        m.close()
        site.rabbit.api("DELETE", f"vhosts/{quote(vhost, safe='')}")


def build(m: Mirror, s: Scenario) -> None:
    for spec in s.exchanges:
        m.declare(spec)
    for q in s.queues:
        m.declare_queue(q)
    made: list[tuple[str, str, str, str, dict[str, Any]]] = []
    for q, src, key, args in s.queue_bindings:
        if m.bind_queue(q, src, key, args):
            made.append(("queue", q, src, key, args))
    for dest, src, key, args in s.exchange_bindings:
        if m.bind_exchange(dest, src, key, args):
            made.append(("exchange", dest, src, key, args))
    for op, arg in s.removals:
        if op == "delete_queue":
            m.delete_queue(arg)
        elif op == "delete_exchange":
            m.delete_exchange(arg)
        elif made:
            m.unbind(*made[arg % len(made)])


def exported_faithfully(value: object, nested: bool = False) -> bool:
    """Whether a binding argument survives the definitions export: decimals
    never do; nested byte strings, timestamps and voids lose their type."""
    if isinstance(value, Decimal):
        return False
    if nested and (isinstance(value, bytes | datetime.datetime) or value is None):
        return False
    if isinstance(value, dict):
        return all(exported_faithfully(v, True) for v in value.values())
    if isinstance(value, list):
        return all(exported_faithfully(v, True) for v in value)
    return True


def check(
    m: Mirror,
    messages: list[tuple[str, str, dict[str, Any] | None]],
    *,
    events: bool = False,
    not_exported: frozenset[str] = frozenset(),
) -> None:
    """Publish each message, then compare the broker's queues with both
    models (the definitions one only for exchanges not in ``not_exported``)."""
    from_defs = Topology.from_definitions(m.vhost, m.definitions())
    for i, (exchange, key, headers) in enumerate(messages):
        m.publish(i, exchange, key, headers)
    got = m.delivered()
    for name, ids in got.items():
        assert len(ids) == len(set(ids)), f"{name} got a message twice: {ids}"
    for i, (exchange, key, headers) in enumerate(messages):
        actual = frozenset(q for q, ids in got.items() if i in ids)
        h = wire(headers)
        where = f"message {i}: publish({exchange!r}, {key!r}, {headers!r})"
        assert m.model.route(exchange, key, h) == actual, where + " (mutator-built model)"
        if exchange not in not_exported:
            assert from_defs.route(exchange, key, h) == actual, where + " (definitions model)"
        x = m.model.exchanges.get(exchange)
        if events:
            event(f"{x.type if x else 'missing'} exchange, routed to {min(len(actual), 2)}+ queues")


# -- tests ---------------------------------------------------------------------------


@settings(
    max_examples=60,
    deadline=None,
    # each example talks to a broker: no "explain" phase (minutes on a failure)
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(scenario=scenarios())
def test_route_equals_where_rabbitmq_delivers(site_a: LocalSite, scenario: Scenario) -> None:
    with mirror(site_a) as m:
        build(m, scenario)
        args = [b[3] for b in scenario.queue_bindings + scenario.exchange_bindings]
        lossy = not all(exported_faithfully(a) for a in args)
        check(
            m,
            scenario.publishes(),
            events=True,
            not_exported=frozenset(TARGETS) if lossy else frozenset(),
        )


def test_every_feature_at_once_mutators_and_definitions_agree(site_a: LocalSite) -> None:
    """One hand-built topology with every rule in it, checked both ways."""
    with mirror(site_a) as m:
        for spec in [
            ExchangeSpec("ae", "fanout", True, False, None),
            ExchangeSpec("t", "topic", False, False, "ae"),
            ExchangeSpec("h", "headers", False, False, "ae"),
            ExchangeSpec("d", "direct", False, False, None),
            ExchangeSpec("f", "fanout", False, True, "t"),
            ExchangeSpec("hop", "direct", False, False, "ae"),
            ExchangeSpec("void", "fanout", False, False, None),
        ]:
            m.declare(spec)
        for q in ["orders", "audit", "dead", "t.q", "a.b"]:
            m.declare_queue(q)
        assert m.bind_queue("dead", "ae", "", {})
        assert m.bind_queue("orders", "t", "orders.#", {})
        assert m.bind_queue("t.q", "t", "*.*.eu", {})
        assert m.bind_queue("audit", "h", "", {"x-match": "any", "audit": None, "n": 1})
        assert m.bind_queue("audit", "h", "", {"x-match": "all-with-x", "x-k": "v"})
        assert m.bind_queue("a.b", "d", "k", {})
        assert m.bind_exchange("h", "t", "orders.#", {})
        assert m.bind_exchange("t", "h", "", {"route": "topic"})
        assert m.bind_exchange("d", "f", "", {})
        assert m.bind_exchange("t", "t", "#", {})
        assert m.bind_exchange("void", "hop", "k", {})
        messages: list[tuple[str, str, dict[str, Any] | None]] = [
            ("t", "orders.new.eu", {"n": 1}),
            ("t", "orders.new.eu", {"n": 2}),
            ("t", "other", None),
            ("t", "x.y.eu", None),
            ("h", "", {"route": "topic"}),
            ("h", "orders.x", {"route": "topic"}),
            ("h", "", {"x-k": "v"}),
            ("h", "", {"audit": 0}),
            ("h", "", {}),
            ("f", "k", None),
            ("f", "zzz", None),
            ("f", "zzz", {"CC": ["k"]}),
            ("d", "nope", {"BCC": ["k"], "CC": ["zzz"]}),
            ("", "a.b", {"CC": ["orders", "ghost"], "BCC": ["audit"]}),
            ("", "orders", {"CC": "not-an-array"}),
            ("ae", "", None),
            ("ghost", "", None),
            ("amq.topic", "orders.x", None),
            ("hop", "k", None),  # bound to an exchange that routes nowhere: no AE
            ("hop", "j", None),  # no destination at all: the AE
        ]
        check(m, messages)
        m.unbind("queue", "a.b", "d", "k", {})  # f auto-deletes? no: f's binding is to d
        assert "f" in m.model.exchanges
        m.unbind("exchange", "d", "f", "", {})  # f's last binding: auto-deleted
        assert "f" not in m.model.exchanges
        ex = {x["name"] for x in site_a.rabbit.api("GET", f"exchanges/{quote(m.vhost)}")}
        assert "f" not in ex and "d" in ex
        check(m, messages)


def test_integers_equal_floats_and_policy_alternate_exchange(site_a: LocalSite) -> None:
    """Two rules pika cannot exercise: a double header against a long binding
    value (management API publish), and an alternate exchange set by policy."""
    with mirror(site_a) as m:
        vh = quote(m.vhost, safe="")
        m.declare(ExchangeSpec("h", "headers", False, False, None))
        m.declare(ExchangeSpec("pae", "fanout", False, False, None))
        m.declare_queue("q")
        m.declare_queue("caught")
        assert m.bind_queue("q", "h", "", {"n": 1})
        assert m.bind_queue("caught", "pae", "", {})
        site_a.rabbit.api(
            "PUT",
            f"policies/{vh}/ae",
            {
                "pattern": "^h$",
                "apply-to": "exchanges",
                "definition": {"alternate-exchange": "pae"},
            },
        )
        t = Topology.from_definitions(m.vhost, m.definitions())
        assert t.alternate_exchange("h") == "pae"
        for n, expected in [(1.0, {"q"}), (1.5, {"caught"}), (1, {"q"})]:
            body = {
                "properties": {"headers": {"n": n}},
                "routing_key": "",
                "payload": "p",
                "payload_encoding": "string",
            }
            routed = site_a.rabbit.api("POST", f"exchanges/{vh}/h/publish", body)["routed"]
            assert routed is True
            assert t.route("h", "", {"n": n}) == expected
        got = m.delivered()
        assert (len(got["q"]), len(got["caught"])) == (2, 1)


def pika_sends(value: object) -> bool:
    """Whether ``value`` reaches pamqp as itself (pika cannot send floats,
    normalises decimals and sends bytes as the ``x`` type)."""
    try:
        back = wire({"k": value})
    except pika.exceptions.UnsupportedAMQPFieldException:
        return False
    return back is not None and tagged(back["k"]) == tagged(value)


def test_the_unit_test_tables_hold_on_the_broker(site_a: LocalSite) -> None:
    """Every topic and headers expectation of tests/unit/plugin/topology/test_topology.py, replayed
    on RabbitMQ: one exchange and one queue per case, all in one vhost."""
    cases: list[tuple[Any, ...]] = [
        ("topic", pattern, {}, key, None, expected) for pattern, key, expected in TOPIC_CASES
    ]
    cases += [
        ("headers", "", args, "", headers, expected) for args, headers, expected in HEADERS_CASES
    ]
    cases += [
        ("headers", "", {"k": bv}, "", {"k": hv}, expected)
        for bv, hv, expected in VALUE_CASES
        if isinstance(hv, bytes) or pika_sends(hv)
    ]
    with mirror(site_a) as m:
        publishes = []
        not_exported = set()
        checked = 0
        for i, (kind, pattern, args, key, headers, expected) in enumerate(cases):
            m.declare(ExchangeSpec(f"e{i}", kind, False, False, None))
            m.declare_queue(f"q{i}")
            sendable = [v for v in (*args.values(), *(headers or {}).values()) if v is not None]
            faithful = m.bind_queue(f"q{i}", f"e{i}", pattern, args) and all(
                isinstance(v, bytes) or pika_sends(v) for v in sendable
            )
            publishes.append((f"e{i}", key, headers))
            if not exported_faithfully(args):
                not_exported.add(f"e{i}")
            if faithful:
                checked += 1
                assert (m.model.route(f"e{i}", key, wire(headers)) == {f"q{i}"}) is expected, cases[
                    i
                ]
        check(m, publishes, not_exported=frozenset(not_exported))
        assert checked > 0.8 * len(cases)


@pytest.mark.parametrize("exchange", ["nope", "ae"])
def test_missing_and_internal_exchanges_refuse_the_publish(
    site_a: LocalSite, exchange: str
) -> None:
    with mirror(site_a) as m:
        m.declare(ExchangeSpec("ae", "fanout", True, False, None))
        m.declare_queue("q")
        assert m.bind_queue("q", "ae", "", {})
        props = pika.BasicProperties(message_id="0")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
            m.ch.basic_publish(exchange, "", b"m", props)
        assert info.value.reply_code == (404 if exchange == "nope" else 403)
        assert m.model.route(exchange, "", None) == frozenset()
