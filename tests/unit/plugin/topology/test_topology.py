"""Unit tests of the topology model, the routing engine and the replication
scope: no servers. The rules are RabbitMQ 3.10.8's (see plugin/topology/_topology.py);
tests/site/test_routing_differential.py checks the same engine against a broker."""

from __future__ import annotations

import datetime
import time
from decimal import Decimal

import pytest
from hypothesis import given, strategies as st

from bridge import TopicFilter, VpnSettings
from plugin import UsageError
from plugin.topology import (
    Binding,
    DestinationKind,
    Exchange,
    ExportError,
    Policy,
    Queue,
    ReplicationScope,
    Topology,
    topic_matches,
)


def topo(*queues: str) -> Topology:
    t = Topology("v")
    for q in queues:
        t.declare_queue(q)
    return t


# -- the model ---------------------------------------------------------------


def test_predeclared_exchanges_exist():
    t = Topology()
    assert {
        "",
        "amq.direct",
        "amq.fanout",
        "amq.topic",
        "amq.headers",
        "amq.match",
        "amq.rabbitmq.trace",
    } <= set(t.exchanges)
    assert t.exchanges["amq.match"].type == "headers"
    assert t.exchanges["amq.rabbitmq.trace"].internal


def test_value_objects_are_frozen_and_hashable():
    x = Exchange("x", "topic", {"alternate-exchange": "ae"})
    with pytest.raises(AttributeError):
        x.name = "y"  # type: ignore[misc]
    with pytest.raises(TypeError):
        x.arguments["k"] = 1  # type: ignore[index]
    assert hash(x) == hash(Exchange("x", "topic", {"alternate-exchange": "ae"}))
    assert hash(Queue("q", {"x-max-length": 5})) == hash(Queue("q"))
    b = Binding("x", "q", DestinationKind.QUEUE, "k", {"a": [1, {"b": None}]})
    assert b == Binding("x", "q", DestinationKind.QUEUE, "k", {"a": [1, {"b": None}]})
    assert hash(b) == hash(Binding("x", "q", DestinationKind.QUEUE, "k", {}))


def test_binding_identity_includes_typed_arguments():
    def ident(args):
        return Binding("x", "q", DestinationKind.QUEUE, "", args).identity

    assert ident({"a": 1, "b": 2}) == ident({"b": 2, "a": 1})  # sorted like RabbitMQ
    assert ident({"a": 1}) != ident({"a": True})
    assert ident({"a": 1}) != ident({"a": 1.0})
    assert ident({"a": "s"}) != ident({"a": bytearray(b"s")})


def test_redeclare_keeps_the_first_declaration():
    t = topo()
    t.declare_exchange("x", "direct", {"alternate-exchange": "a"})
    t.declare_exchange("x", "direct", {"alternate-exchange": "b", "other": 1})
    assert t.exchanges["x"].arguments == {"alternate-exchange": "a"}
    t.declare_queue("q", {"x-max-length": 1})
    t.declare_queue("q", {})
    assert t.queues["q"].arguments == {"x-max-length": 1}


def test_delete_exchange_removes_bindings_both_ways():
    t = topo("q")
    t.declare_exchange("a", "fanout")
    t.declare_exchange("b", "fanout")
    t.bind_exchange("b", "a", "")
    t.bind_queue("q", "b", "")
    t.bind_exchange("a", "amq.fanout", "")
    assert t.route("amq.fanout", "", None) == {"q"}
    t.delete_exchange("b")
    assert "b" not in t.exchanges
    assert [(b.source, b.destination) for b in t.bindings()] == [("amq.fanout", "a")]
    t.declare_exchange("b", "fanout")  # re-created: the old bindings are gone
    assert t.route("amq.fanout", "", None) == frozenset()
    t.delete_exchange("a")
    assert list(t.bindings()) == []


def test_delete_queue_removes_its_bindings():
    t = topo("q", "r")
    t.bind_queue("q", "amq.direct", "k")
    t.bind_queue("r", "amq.direct", "k")
    t.delete_queue("q")
    assert t.route("amq.direct", "k", None) == {"r"}
    t.declare_queue("q")  # a new queue of the same name is not bound
    assert t.route("amq.direct", "k", None) == {"r"}


def test_deleting_unknown_things_and_the_default_exchange_is_a_noop():
    t = topo()
    t.delete_exchange("nope")
    t.delete_queue("nope")
    t.unbind_queue("q", "amq.direct", "k")
    t.delete_exchange("")
    assert "" in t.exchanges


def test_unbind_matches_arguments_exactly():
    t = topo("q")
    t.bind_queue("q", "amq.headers", "", {"x-match": "any", "a": 1})
    t.bind_queue("q", "amq.headers", "", {"x-match": "any", "b": 2})
    t.unbind_queue("q", "amq.headers", "", {"x-match": "any", "a": True})  # not the same
    assert len(list(t.bindings())) == 2
    t.unbind_queue("q", "amq.headers", "", {"a": 1, "x-match": "any"})
    assert t.route("amq.headers", "", {"a": 1}) == frozenset()
    assert t.route("amq.headers", "", {"b": 2}) == {"q"}


def test_duplicate_bind_is_one_binding():
    t = topo("q")
    t.bind_queue("q", "amq.direct", "k")
    t.bind_queue("q", "amq.direct", "k")
    t.unbind_queue("q", "amq.direct", "k")
    assert t.route("amq.direct", "k", None) == frozenset()


def test_bind_queue_records_the_queue_a_bind_ok_proved():
    t = topo()
    t.bind_queue("q", "amq.direct", "k")
    assert "q" in t.queues
    assert t.route("amq.direct", "k", None) == {"q"}


def test_unbind_exchange():
    t = topo("q")
    t.declare_exchange("x", "fanout")
    t.bind_queue("q", "x", "")
    t.bind_exchange("x", "amq.direct", "k")
    assert t.route("amq.direct", "k", None) == {"q"}
    t.unbind_exchange("x", "amq.direct", "k")
    assert t.route("amq.direct", "k", None) == frozenset()


def test_auto_delete_exchange_goes_with_its_last_source_binding():
    t = topo("q", "r")
    t.declare_exchange("ad", "fanout", auto_delete=True)
    assert "ad" in t.exchanges  # never bound: stays
    t.bind_queue("q", "ad", "")
    t.bind_queue("r", "ad", "")
    t.unbind_queue("q", "ad", "")
    assert "ad" in t.exchanges
    t.delete_queue("r")  # removing its last binding through the destination
    assert "ad" not in t.exchanges


def test_auto_delete_cascades_and_ignores_unknown_unbinds():
    t = topo("q")
    t.declare_exchange("top", "fanout", auto_delete=True)
    t.declare_exchange("mid", "fanout", auto_delete=True)
    t.bind_exchange("mid", "top", "")
    t.bind_queue("q", "mid", "")
    t.unbind_queue("q", "mid", "other-key")  # no such binding: nothing happens
    assert {"top", "mid"} <= set(t.exchanges)
    t.delete_queue("q")  # mid loses its last binding, and with it top
    assert "mid" not in t.exchanges and "top" not in t.exchanges


def test_binding_to_unknown_exchange_routes_nowhere_until_declared():
    t = topo("q")
    t.bind_exchange("later", "amq.fanout", "")
    t.declare_exchange("ae", "fanout")
    t.bind_queue("q", "ae", "")
    t.declare_exchange("x", "fanout", {"alternate-exchange": "ae"})
    t.bind_exchange("later", "x", "")
    assert t.route("x", "", None) == {"q"}  # dangling binding: x has no destination
    t.declare_exchange("later", "fanout")
    assert t.route("x", "", None) == frozenset()  # now it has one, so no AE


# -- default, direct, fanout -------------------------------------------------


def test_default_exchange_routes_to_the_queue_named_by_the_key():
    t = topo("q", "a.b", "")
    assert t.route("", "q", None) == {"q"}
    assert t.route("", "a.b", None) == {"a.b"}
    assert t.route("", "", None) == {""}
    assert t.route("", "missing", None) == frozenset()


def test_default_exchange_honours_cc_and_bcc():
    t = topo("q", "r", "s")
    assert t.route("", "q", {"CC": ["r", "missing"], "BCC": ["s", "q"]}) == {"q", "r", "s"}


def test_missing_and_internal_exchanges_route_nothing():
    t = topo("q")
    t.declare_exchange("i", "fanout", internal=True)
    t.bind_queue("q", "i", "")
    assert t.route("nope", "q", None) == frozenset()
    assert t.route("i", "", None) == frozenset()
    assert t.route("amq.rabbitmq.trace", "#", None) == frozenset()


def test_internal_exchange_is_reachable_through_bindings_and_ae():
    t = topo("q")
    t.declare_exchange("i", "fanout", internal=True)
    t.bind_queue("q", "i", "")
    t.declare_exchange("x", "direct", {"alternate-exchange": "i"})
    assert t.route("x", "any", None) == {"q"}
    t.bind_exchange("i", "amq.fanout", "")
    assert t.route("amq.fanout", "", None) == {"q"}


def test_direct_matches_exact_keys_only():
    t = topo("q", "r")
    t.bind_queue("q", "amq.direct", "a.b")
    t.bind_queue("r", "amq.direct", "")
    assert t.route("amq.direct", "a.b", None) == {"q"}
    assert t.route("amq.direct", "a.*", None) == frozenset()
    assert t.route("amq.direct", "A.B", None) == frozenset()
    assert t.route("amq.direct", "", None) == {"r"}


def test_direct_with_cc_bcc():
    t = topo("q", "r", "s")
    t.bind_queue("q", "amq.direct", "k1")
    t.bind_queue("r", "amq.direct", "k2")
    t.bind_queue("s", "amq.direct", "k3")
    assert t.route("amq.direct", "none", {"CC": ["k1"], "BCC": ["k3"]}) == {"q", "s"}
    assert t.route("amq.direct", "k2", {"CC": ["k2", "k2"]}) == {"r"}


def test_fanout_ignores_keys():
    t = topo("q", "r")
    t.bind_queue("q", "amq.fanout", "whatever")
    t.bind_queue("r", "amq.fanout", "")
    assert t.route("amq.fanout", "x.y", None) == {"q", "r"}


def test_cc_bcc_element_types_and_refusal():
    t = topo("q", "r")
    t.bind_queue("q", "amq.direct", "k")
    t.bind_queue("r", "amq.direct", "r")
    # only longstr elements count; pamqp gives str (bytes when not UTF-8)
    assert t.route("amq.direct", "x", {"CC": [1, bytearray(b"k"), None, ["k"]]}) == frozenset()
    assert t.route("amq.direct", "x", {"CC": [b"k"]}) == {"q"}
    # a CC/BCC that is not an array: the broker refuses the message
    assert t.route("amq.direct", "k", {"CC": "r"}) == frozenset()
    assert t.route("amq.direct", "k", {"BCC": None}) == frozenset()
    assert t.route("", "q", {"CC": {}}) == frozenset()
    # header names are case sensitive
    assert t.route("amq.direct", "k", {"cc": ["r"]}) == {"q"}


# -- topic ------------------------------------------------------------------

TOPIC_CASES = [
    # (pattern, key, match)
    ("a.b", "a.b", True),
    ("a.b", "a.b.c", False),
    ("*", "a", True),
    ("*", "", False),  # "" is zero words
    ("*", ".", False),  # "." is two empty words
    ("*.*", ".", True),
    ("*", "a.b", False),
    ("#", "", True),
    ("#", "a.b.c", True),
    ("#", ".", True),
    ("", "", True),
    ("", "a", False),
    ("a.#", "a", True),
    ("a.#", "a.b.c", True),
    ("a.#", "ab", False),
    ("#.a", "a", True),
    ("#.a", "x.y.a", True),
    ("a.#.b", "a.b", True),
    ("a.#.b", "a.x.y.b", True),
    ("a.#.b", "a.x.y", False),
    ("a.*.b", "a.b", False),
    ("a.*.b", "a..b", True),
    ("a.", "a.", True),  # an empty last word
    ("a.", "a", False),
    (".a", ".a", True),
    ("a.*", "a.", True),
    ("#.#", "", True),
    ("#.#", "a.b", True),
    ("#.*", "", False),
    ("#.*", "a", True),
    ("*.#", "a", True),
    ("*.#.*", "a", False),
    ("*.#.*", "a.b", True),
    ("a*", "a*", True),  # not a wildcard inside a word
    ("a*", "ab", False),
    ("a.#", "a.#", True),
    ("*", "*", True),
    ("a", "a\u00e9.b", False),
    ("*.b", "\u00e9.b", True),
    ("#.x.#.y", "x.y", True),
    ("#.x.#.y", "q.x.r.s.y", True),
    ("#.x.#.y", "q.x.r.s.y.z", False),
]


@pytest.mark.parametrize(("pattern", "key", "expected"), TOPIC_CASES)
def test_topic_exchange(pattern, key, expected):
    t = topo("q")
    t.bind_queue("q", "amq.topic", pattern)
    assert (t.route("amq.topic", key, None) == {"q"}) is expected
    assert topic_matches(pattern, key) is expected


def test_topic_many_bindings_and_cc():
    t = topo("q1", "q2", "q3", "q4")
    t.bind_queue("q1", "amq.topic", "stock.*.nyse")
    t.bind_queue("q2", "amq.topic", "stock.#")
    t.bind_queue("q3", "amq.topic", "#.nyse")
    t.bind_queue("q4", "amq.topic", "bond.*")
    assert t.route("amq.topic", "stock.ibm.nyse", None) == {"q1", "q2", "q3"}
    assert t.route("amq.topic", "stock", None) == {"q2"}
    assert t.route("amq.topic", "x", {"CC": ["bond.y"], "BCC": ["z.nyse"]}) == {"q3", "q4"}


def test_topic_hashes_stay_fast():
    t = topo("q")
    t.bind_queue("q", "amq.topic", ".".join(["#"] * 12 + ["x"]))
    key = ".".join(["a"] * 120)
    start = time.perf_counter()
    assert t.route("amq.topic", key, None) == frozenset()
    assert topic_matches(".".join(["#", "a"] * 8 + ["x"]), key) is False
    assert time.perf_counter() - start < 1.0


_word = st.sampled_from(["a", "b", "", "ab"])
_pattern_word = st.sampled_from(["a", "b", "", "*", "#"])


def _reference_match(pattern: list[str], key: list[str]) -> bool:
    if not pattern:
        return not key
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_reference_match(rest, key[i:]) for i in range(len(key) + 1))
    if not key:
        return False
    return (head == "*" or head == key[0]) and _reference_match(rest, key[1:])


def _split(s: str) -> list[str]:
    return s.split(".") if s else []


@given(st.lists(_pattern_word, max_size=5), st.lists(_word, max_size=5), st.booleans())
def test_topic_trie_and_regex_agree_with_a_reference(pattern_words, key_words, empty):
    pattern = ".".join(pattern_words)
    key = "" if empty else ".".join(key_words)
    expected = _reference_match(_split(pattern), _split(key))
    t = topo("q")
    t.bind_queue("q", "amq.topic", pattern)
    assert (t.route("amq.topic", key, None) == {"q"}) is expected
    assert topic_matches(pattern, key) is expected


# -- headers ----------------------------------------------------------------


def headers_topo(args):
    t = topo("q")
    t.bind_queue("q", "amq.headers", "ignored", args)
    return t


HEADERS_CASES = [
    # all is the default; a binding without arguments matches everything
    ({}, None, True),
    ({}, {"a": 1}, True),
    ({"x-match": "any"}, {"a": 1}, False),
    ({"a": 1}, {"a": 1, "b": 2}, True),
    ({"a": 1, "b": 2}, {"a": 1}, False),
    ({"x-match": "all", "a": 1, "b": 2}, {"a": 1, "b": 3}, False),
    ({"x-match": "any", "a": 1, "b": 2}, {"a": 1, "b": 3}, True),
    ({"x-match": "any", "a": 1, "b": 2}, {"c": 1}, False),
    ({"x-match": "any", "a": 1}, None, False),
    ({"a": 1}, None, False),
    # an unknown x-match value means all (the broker refuses it at bind)
    ({"x-match": "bogus", "a": 1, "b": 2}, {"a": 1}, False),
    ({"x-match": "bogus", "a": 1}, {"a": 1}, True),
    # x- arguments are ignored unless -with-x
    ({"x-foo": "bar"}, {}, True),
    ({"x-match": "any", "x-foo": "bar"}, {"x-foo": "bar"}, False),
    ({"x-match": "any-with-x", "x-foo": "bar"}, {"x-foo": "bar"}, True),
    ({"x-match": "all-with-x", "x-foo": "bar", "a": 1}, {"a": 1}, False),
    ({"x-match": "all-with-x", "x-foo": "bar", "a": 1}, {"a": 1, "x-foo": "bar"}, True),
    ({"x-match": "all-with-x"}, {"x-match": "any"}, True),  # x-match never compared
    ({"x-match": "any-with-x"}, {"x-match": "any-with-x"}, False),
    ({"X-Foo": 1}, {}, False),  # only lower-case x- is special
    # void means presence
    ({"a": None}, {"a": "anything"}, True),
    ({"a": None}, {"a": None}, True),
    ({"a": None}, {"b": 1}, False),
    ({"x-match": "any", "a": None, "b": 1}, {"a": 0}, True),
    ({"a": "v"}, {"a": None}, False),
]


@pytest.mark.parametrize(("args", "headers", "expected"), HEADERS_CASES)
def test_headers_exchange(args, headers, expected):
    assert (headers_topo(args).route("amq.headers", "k", headers) == {"q"}) is expected


VALUE_CASES = [
    (1, 1, True),
    (1, 1.0, True),  # Erlang 1 == 1.0
    (2**40, 2**40, True),
    (1, True, False),  # booleans are atoms
    (True, True, True),
    (False, 0, False),
    ("abc", "abc", True),
    ("abc", bytearray(b"abc"), True),  # S and x are both binaries
    ("abc", b"abc", True),
    ("\u00e9", "\u00e9".encode(), True),
    ("abc", "ABC", False),
    ("1", 1, False),
    (Decimal("1.25"), Decimal("1.25"), True),
    (Decimal("1.2"), Decimal("1.20"), False),  # scale is part of the value
    (Decimal("1"), 1, False),
    (1577836800, datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC), True),
    (
        datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC),
        datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC),
        True,
    ),
    ({"a": 1}, {"a": 1}, True),
    ({"a": 1}, {"a": 1.0}, False),  # nested values keep their type
    ({"a": 1, "b": 2}, {"b": 2, "a": 1}, False),  # nested tables keep wire order
    ([1, "x"], [1, "x"], True),
    (["x"], [bytearray(b"x")], False),
    ({}, [], True),  # [] == [] in Erlang
    ([], [], True),
    ([1], {"a": 1}, False),
    ("abc", None, False),
]


@pytest.mark.parametrize(("binding_value", "header_value", "expected"), VALUE_CASES)
def test_headers_value_comparison(binding_value, header_value, expected):
    t = headers_topo({"k": binding_value})
    assert (t.route("amq.headers", "", {"k": header_value}) == {"q"}) is expected


def test_headers_exchange_does_not_see_bcc_but_sees_cc():
    t = topo("q", "r")
    t.bind_queue("q", "amq.headers", "", {"BCC": None})
    t.bind_queue("r", "amq.headers", "", {"CC": None})
    assert t.route("amq.headers", "", {"BCC": ["x"], "CC": ["y"]}) == {"r"}


def test_two_headers_bindings_to_one_queue_deliver_once():
    t = topo("q")
    t.bind_queue("q", "amq.headers", "", {"a": 1})
    t.bind_queue("q", "amq.headers", "", {"x-match": "any", "b": 1})
    assert t.route("amq.headers", "", {"a": 1, "b": 1}) == {"q"}


def test_headers_results_are_not_cached_across_headers():
    t = topo("q")
    t.bind_queue("q", "amq.headers", "", {"a": 1})
    t.bind_exchange("amq.headers", "amq.direct", "k")
    assert t.route("amq.direct", "k", {"a": 1}) == {"q"}
    assert t.route("amq.direct", "k", {"a": 2}) == frozenset()
    assert t.route("amq.direct", "k", {"a": 1}) == {"q"}


# -- exchange-to-exchange and alternate exchanges -----------------------------


def test_exchange_to_exchange_chain_uses_the_same_keys():
    t = topo("q")
    t.declare_exchange("t2", "topic")
    t.bind_exchange("t2", "amq.direct", "a.b")
    t.bind_queue("q", "t2", "a.*")
    assert t.route("amq.direct", "a.b", None) == {"q"}
    assert t.route("amq.direct", "a.c", None) == frozenset()


def test_exchange_cycles_terminate_and_deliver_once():
    t = topo("q")
    for name in ("a", "b", "c"):
        t.declare_exchange(name, "fanout")
    t.bind_exchange("b", "a", "")
    t.bind_exchange("c", "b", "")
    t.bind_exchange("a", "c", "")
    t.bind_exchange("a", "a", "")
    t.bind_queue("q", "c", "")
    t.bind_queue("q", "a", "")
    assert t.route("a", "", None) == {"q"}
    assert t.route("b", "", None) == {"q"}


def test_ae_used_only_when_the_exchange_itself_has_no_destination():
    t = topo("q", "ae-q")
    t.declare_exchange("ae", "fanout")
    t.bind_queue("ae-q", "ae", "")
    t.declare_exchange("x", "direct", {"alternate-exchange": "ae"})
    t.bind_queue("q", "x", "k")
    assert t.route("x", "k", None) == {"q"}
    assert t.route("x", "other", None) == {"ae-q"}


def test_binding_to_an_exchange_that_routes_nowhere_suppresses_the_ae():
    t = topo("ae-q")
    t.declare_exchange("ae", "fanout")
    t.bind_queue("ae-q", "ae", "")
    t.declare_exchange("x", "direct", {"alternate-exchange": "ae"})
    t.declare_exchange("empty", "direct")
    t.bind_exchange("empty", "x", "k")
    assert t.route("x", "k", None) == frozenset()
    assert t.route("x", "j", None) == {"ae-q"}


def test_ae_applies_per_exchange_along_a_chain():
    t = topo("ae-q")
    t.declare_exchange("ae", "fanout")
    t.bind_queue("ae-q", "ae", "")
    t.declare_exchange("inner", "direct", {"alternate-exchange": "ae"})
    t.bind_exchange("inner", "amq.fanout", "")
    # amq.fanout found a destination (inner); inner found none, so inner's AE
    assert t.route("amq.fanout", "nothing-bound", None) == {"ae-q"}


def test_ae_chains_and_loops():
    t = topo("end")
    t.declare_exchange("a", "direct", {"alternate-exchange": "b"})
    t.declare_exchange("b", "direct", {"alternate-exchange": "c"})
    t.declare_exchange("c", "direct", {"alternate-exchange": "a"})
    assert t.route("a", "k", None) == frozenset()  # loop ends
    t.bind_queue("end", "c", "k")
    assert t.route("a", "k", None) == {"end"}
    assert t.route("b", "k", None) == {"end"}
    t.declare_exchange("self", "direct", {"alternate-exchange": "self"})
    assert t.route("self", "k", None) == frozenset()


def test_missing_ae_and_non_string_ae():
    t = topo("q")
    t.declare_exchange("x", "direct", {"alternate-exchange": "missing"})
    assert t.route("x", "k", None) == frozenset()
    t.declare_exchange("missing", "fanout")
    t.bind_queue("q", "missing", "")
    assert t.route("x", "k", None) == {"q"}
    t.declare_exchange("y", "direct", {"alternate-exchange": 5})
    assert t.route("y", "k", None) == frozenset()


def test_ae_seen_earlier_is_not_walked_again():
    t = topo("q")
    t.declare_exchange("ae", "direct")
    t.bind_queue("q", "ae", "k")
    t.declare_exchange("x", "fanout")
    t.declare_exchange("y", "direct", {"alternate-exchange": "ae"})
    t.bind_exchange("ae", "x", "")
    t.bind_exchange("y", "x", "")
    assert t.route("x", "k", None) == {"q"}


def test_headers_exchange_ae():
    t = topo("q", "ae-q")
    t.declare_exchange("ae", "fanout")
    t.bind_queue("ae-q", "ae", "")
    t.declare_exchange("h", "headers", {"alternate-exchange": "ae"})
    t.bind_queue("q", "h", "", {"a": 1})
    assert t.route("h", "", {"a": 1}) == {"q"}
    assert t.route("h", "", {"a": 2}) == {"ae-q"}


def test_cc_reaches_through_exchange_bindings():
    t = topo("q")
    t.declare_exchange("d2", "direct")
    t.bind_exchange("d2", "amq.fanout", "")
    t.bind_queue("q", "d2", "cc-key")
    assert t.route("amq.fanout", "k", {"CC": ["cc-key"]}) == {"q"}
    assert t.route("amq.fanout", "k", None) == frozenset()


def test_policy_supplies_the_ae_when_the_argument_does_not():
    t = topo("pq", "aq")
    for name in ("pol-ae", "arg-ae"):
        t.declare_exchange(name, "fanout")
    t.bind_queue("pq", "pol-ae", "")
    t.bind_queue("aq", "arg-ae", "")
    t.declare_exchange("orders.in", "direct")
    t.declare_exchange("orders.arg", "direct", {"alternate-exchange": "arg-ae"})
    t.set_policies(
        [
            Policy("low", "^orders", {"alternate-exchange": "nope"}, priority=1),
            Policy("high", "^orders", {"alternate-exchange": "pol-ae"}, priority=5),
            Policy("queues-only", ".*", {"alternate-exchange": "nope"}, 9, "queues"),
        ]
    )
    assert t.alternate_exchange("orders.in") == "pol-ae"
    assert t.route("orders.in", "k", None) == {"pq"}
    assert t.route("orders.arg", "k", None) == {"aq"}
    # the top policy without an AE hides lower ones
    t.set_policies(
        [
            Policy("top", "in$", {"max-length": 1}, priority=10, apply_to="all"),
            Policy("low", "^orders", {"alternate-exchange": "pol-ae"}, priority=1),
        ]
    )
    assert t.route("orders.in", "k", None) == frozenset()
    t.set_policies([Policy("bad", "(", {"alternate-exchange": "pol-ae"})])
    assert t.route("orders.in", "k", None) == frozenset()


def test_plugin_exchange_types_route_like_fanout():
    t = topo("q")
    t.declare_exchange("h", "x-consistent-hash")
    t.bind_queue("q", "h", "10")
    assert t.route("h", "anything", None) == {"q"}


def test_the_route_cache_is_invalidated_by_every_mutation():
    t = topo("q")
    t.declare_exchange("x", "direct")
    assert t.route("x", "k", None) == frozenset()
    t.bind_queue("q", "x", "k")
    assert t.route("x", "k", None) == {"q"}
    t.declare_queue("r")
    t.bind_queue("r", "x", "k")
    assert t.route("x", "k", None) == {"q", "r"}
    t.delete_queue("r")
    assert t.route("x", "k", None) == {"q"}
    t.delete_exchange("x")
    assert t.route("x", "k", None) == frozenset()
    t.declare_queue("k")
    assert t.route("", "k", None) == {"k"}
    t.delete_queue("k")
    assert t.route("", "k", None) == frozenset()


# -- from_definitions -----------------------------------------------------------

DEFINITIONS = {
    "rabbit_version": "3.10.8",
    "queues": [
        {"name": "q1", "durable": True, "auto_delete": False, "arguments": {"x-max-length": 9}},
        {"name": "q2", "durable": True, "auto_delete": False, "arguments": {}},
        {"name": "elsewhere", "vhost": "other", "arguments": {}},
    ],
    "exchanges": [
        {
            "name": "t",
            "type": "topic",
            "durable": True,
            "auto_delete": False,
            "internal": False,
            "arguments": {"alternate-exchange": "ae"},
        },
        {"name": "ae", "type": "fanout", "internal": True, "arguments": {}},
        {"name": "h", "type": "headers", "arguments": []},
    ],
    "bindings": [
        {
            "source": "t",
            "destination": "q1",
            "destination_type": "queue",
            "routing_key": "a.#",
            "arguments": {},
        },
        {
            "source": "ae",
            "destination": "q2",
            "destination_type": "queue",
            "routing_key": "",
            "arguments": {},
        },
        {
            "source": "h",
            "destination": "t",
            "destination_type": "exchange",
            "routing_key": "a.b",
            "arguments": {"x-match": "any", "present": "undefined", "n": 1},
        },
    ],
    "policies": [
        {
            "vhost": "v",
            "name": "p",
            "pattern": "^h$",
            "apply-to": "exchanges",
            "definition": {"alternate-exchange": "ae"},
            "priority": 0,
        }
    ],
}


def test_from_definitions():
    t = Topology.from_definitions("v", DEFINITIONS)
    assert set(t.queues) == {"q1", "q2"}
    assert t.queues["q1"].arguments == {"x-max-length": 9}
    assert t.exchanges["ae"].internal
    assert t.exchanges["h"].arguments == {}
    assert t.route("t", "a.x", None) == {"q1"}
    assert t.route("t", "b", None) == {"q2"}
    assert t.route("ae", "", None) == frozenset()  # internal
    # "undefined" is how the export writes a void argument: presence
    assert t.route("h", "a.b", {"present": 0}) == {"q1"}
    assert t.route("h", "a.b", {"n": 1.0}) == {"q1"}
    assert t.route("h", "a.b", {"other": 1}) == {"q2"}  # policy AE of h


def test_from_definitions_whole_broker_export_filters_by_vhost():
    t = Topology.from_definitions(
        "other",
        {
            "queues": [
                {"name": "mine", "vhost": "other", "arguments": {}},
                {"name": "theirs", "vhost": "v", "arguments": {}},
            ]
        },
    )
    assert set(t.queues) == {"mine"}
    assert t.route("", "mine", None) == {"mine"}


@pytest.mark.parametrize(
    ("definitions", "message"),
    [
        ([], "expected a JSON object"),
        ({"queues": {}}, "'queues' must be a list"),
        ({"queues": ["q"]}, r"queues\[0\] must be an object"),
        ({"queues": [{"arguments": {}}]}, "lacks 'name'"),
        ({"exchanges": [{"name": "x"}]}, "lacks 'type'"),
        ({"exchanges": [{"name": "x", "type": "direct", "internal": "no"}]}, "'internal'"),
        (
            {"bindings": [{"source": "a", "destination": "b", "destination_type": "topic"}]},
            "neither 'queue' nor 'exchange'",
        ),
        (
            {"policies": [{"name": "p", "pattern": ".*", "definition": {}, "priority": True}]},
            "'priority' must be int",
        ),
    ],
)
def test_from_definitions_rejects_malformed_input(definitions, message):
    with pytest.raises(ExportError, match=message):
        Topology.from_definitions("v", definitions)


# -- replication scope -------------------------------------------------------------

QS = frozenset({"orders.1", "orders.2", "audit", "amq.gen-x"})


def test_scope_without_filters_is_everything():
    scope = ReplicationScope()
    assert scope.everything
    assert scope.in_scope("any", "key", QS) is QS


def test_scope_queue_regexes_are_searched():
    scope = ReplicationScope(("^orders\\.\\d", "^aud$"))
    assert scope.in_scope("x", "k", QS) == {"orders.1", "orders.2"}
    assert scope.in_scope("x", "k", QS) == {"orders.1", "orders.2"}  # memoised
    assert scope.in_scope("x", "k", frozenset({"orders.1"})) == {"orders.1"}
    assert scope.in_scope("x", "k", frozenset()) == frozenset()


def test_scope_topic_filters_take_every_routed_queue():
    scope = ReplicationScope(topic_filters=(TopicFilter("amq.topic", "orders.#"),))
    assert scope.in_scope("amq.topic", "orders.eu.new", QS) == QS
    assert scope.in_scope("amq.topic", "orders.eu.new", QS) == QS
    assert scope.in_scope("amq.topic", "audit.x", QS) == frozenset()
    assert scope.in_scope("other", "orders.eu", QS) == frozenset()


def test_scope_union_of_both_filters():
    scope = ReplicationScope(
        ("audit",),
        (TopicFilter("ex", "*.urgent"), TopicFilter("ex", "")),
    )
    assert scope.in_scope("ex", "a.urgent", QS) == QS
    assert scope.in_scope("ex", "", QS) == QS
    assert scope.in_scope("ex", "a.b", QS) == {"audit"}
    assert scope.in_scope("", "audit", QS) == {"audit"}


def test_scope_from_settings_and_bad_regex():
    settings = VpnSettings.from_args("v", "active", queues=("o.*",), topics=("amq.topic:a.*",))
    scope = ReplicationScope.of(settings)
    assert scope.in_scope("amq.topic", "a.b", frozenset({"x"})) == {"x"}
    assert scope.in_scope("amq.topic", "b", frozenset({"x", "orders"})) == {"orders"}
    assert scope == ReplicationScope(("o.*",), (TopicFilter("amq.topic", "a.*"),))
    with pytest.raises(UsageError, match="not a valid regex"):
        ReplicationScope(("(",))
    hash(scope)


# -- cost ------------------------------------------------------------------------------


def test_route_and_scope_are_cheap_on_the_hot_path():
    t = topo(*[f"q{i}" for i in range(200)])
    for i in range(200):
        t.bind_queue(f"q{i}", "amq.topic", f"orders.{i % 20}.#")
        t.bind_queue(f"q{i}", "amq.direct", f"k{i}")
    scope = ReplicationScope(("q1.*",))
    keys = [f"orders.{i % 20}.eu" for i in range(100)]
    for k in keys:
        t.route("amq.topic", k, None)
    n = 20_000
    start = time.perf_counter()
    for i in range(n):
        k = keys[i % 100]
        scope.in_scope("amq.topic", k, t.route("amq.topic", k, {"h": 1}))
    per_call = (time.perf_counter() - start) / n
    assert per_call < 20e-6, f"{per_call * 1e6:.1f} µs per publish"


def test_generation_counts_effective_mutations():
    t = topo()
    g = t.generation
    t.declare_queue("q")
    assert t.generation > g
    g = t.generation
    t.declare_queue("q")  # a re-declare changes nothing
    t.delete_exchange("missing")
    t.route("", "q", None)
    assert t.generation == g
    t.bind_queue("q", "amq.direct", "k")
    assert t.generation > g


def test_dead_letter_settings_come_from_arguments_else_the_queues_policy_key_by_key() -> None:
    t = Topology("v")
    t.declare_queue("plain", {})
    t.declare_queue("args", {"x-dead-letter-exchange": "dlx-a"})
    t.declare_queue("mixed", {"x-dead-letter-routing-key": "rk-a"})
    t.declare_queue("other", {})
    t.set_policies(
        [
            Policy("low", "^(mixed|args)$", {"dead-letter-exchange": "dlx-low"}, priority=1),
            Policy(
                "high",
                "^mixed$",
                {"dead-letter-exchange": "dlx-p", "dead-letter-routing-key": "rk-p"},
                priority=5,
                apply_to="queues",
            ),
            Policy("xs", "^other$", {"dead-letter-exchange": "x"}, apply_to="exchanges"),
        ]
    )
    assert t.dead_letter("plain") is None
    assert t.dead_letter("args") == ("dlx-a", None)  # the argument wins over the policy
    assert t.dead_letter("mixed") == ("dlx-p", "rk-a")  # each key on its own
    assert t.dead_letter("other") is None
    assert t.dead_letter("unknown") is None


def test_the_depth_replication_would_hold_is_read_per_queue_type() -> None:
    """A classic queue's transient messages never replicate; a quorum
    queue and a stream report their count in ``messages`` alone."""
    from plugin.topology import replicable_depth

    assert replicable_depth({"type": "classic", "messages": 9, "messages_persistent": 7}) == 7
    assert replicable_depth({"messages": 9, "messages_persistent": 7}) == 7  # before types
    assert replicable_depth({"type": "quorum", "messages": 9, "messages_persistent": 0}) == 9
    assert replicable_depth({"type": "stream", "messages": 40}) == 40
    assert replicable_depth({"type": "classic"}) == 0
