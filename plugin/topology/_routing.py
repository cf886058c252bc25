"""RabbitMQ 3.10's per-exchange-type routing rules, and the field-value
comparisons they rest on, without I/O.

:class:`~plugin.topology._topology.Topology` walks exchanges and asks each
one's router (:data:`ROUTERS`, built lazily per exchange from its bindings)
for destinations. The invariant is the topology's: a router answers what
the broker's own exchange type would (the rules: docs/behaviour.md, "How
the listener routes"; checked against a live node by
``tests/site/test_routing_differential.py``). Header values are compared as
Erlang's ``==`` compares what pamqp decoded (:func:`value`).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from decimal import Decimal
from functools import lru_cache
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._entities import Binding, DestinationKind

__all__ = [
    "Refused",
    "Router",
    "header_routes",
    "normalised_headers",
    "pattern_words",
    "router_for",
    "tagged",
    "topic_matches",
]

_NO_ARGS: Mapping[str, object] = MappingProxyType({})


# ---------------------------------------------------------------------------
# Field values: Erlang == on what pamqp decoded


_VOID = object()  # a compiled headers-binding entry that only needs presence
_X_MATCH = frozenset({"all", "any", "all-with-x", "any-with-x"})


def _decimal_parts(value: Decimal) -> tuple[int, int] | str:
    sign, digits, exponent = value.as_tuple()
    if not isinstance(exponent, int):
        return str(value)  # NaN/Infinity: no AMQP encoding, compares with itself only
    if exponent > 0:
        return (0, int(value))
    unscaled = int("".join(map(str, digits)) or "0")
    return (-exponent, -unscaled if sign else unscaled)


def _timestamp(value: datetime.datetime) -> int:
    """The integer a ``T`` field carried. pamqp divides values above
    0xFFFFFFFF by 1000; a fractional result can only come from there."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.UTC)
    seconds = value.timestamp()
    return int(seconds) if seconds.is_integer() else round(seconds * 1000)


def tagged(value: object) -> tuple[str, object]:
    """A nested value with its type class, as Erlang compares ``{Type, V}``.

    pamqp decodes ``S`` to ``str`` (``bytes`` when not UTF-8) and ``x`` to
    ``bytearray``, so the two string types stay apart. Integer and float
    widths are lost in decoding; they compare as one class each.
    """
    if isinstance(value, str):
        return ("longstr", value.encode("utf-8", "surrogateescape"))
    if isinstance(value, bytearray | memoryview):
        return ("binary", bytes(value))
    if isinstance(value, bytes):
        return ("longstr", value)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", value)
    if isinstance(value, Decimal):
        return ("decimal", _decimal_parts(value))
    if isinstance(value, datetime.datetime):
        return ("timestamp", _timestamp(value))
    if value is None:
        return ("void", None)
    if isinstance(value, Mapping):
        return ("table", _table(value))
    if isinstance(value, list | tuple):
        return ("array", _array(value))
    return ("unknown", repr(value))


def _table(value: Mapping[Any, object]) -> tuple[object, ...]:
    return tuple((k, *tagged(v)) for k, v in value.items())


def _array(value: Iterable[object]) -> tuple[object, ...]:
    return tuple(tagged(v) for v in value)


def _value(value: object) -> object:
    """A top-level header or binding value in the form Erlang ``==`` sees.

    The type tag is dropped, so ``S``/``x`` strings become bytes, integers
    and floats stay numbers (``1 == 1.0``), a timestamp is its integer;
    booleans and decimals are tagged so they equal only their own kind. A
    table is a list of 3-tuples and an array of 2-tuples, so the empty table
    equals the empty array, as ``[] == []`` does in Erlang.
    """
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int | float):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, Decimal):
        return ("decimal", _decimal_parts(value))
    if isinstance(value, datetime.datetime):
        return _timestamp(value)
    if value is None:
        return None
    if isinstance(value, Mapping):
        return _table(value)
    if isinstance(value, list | tuple):
        return _array(value)
    return ("unknown", repr(value))


# ---------------------------------------------------------------------------
# Topic patterns


def _words(key: str) -> tuple[str, ...]:
    """``rabbit_exchange_type_topic:split_topic_key/1``: ``""`` is no word."""
    return tuple(key.split(".")) if key else ()


@lru_cache(maxsize=4096)
def pattern_words(pattern: str) -> tuple[str, ...]:
    """A binding pattern's words, runs of ``#`` collapsed (``#.#`` matches
    exactly what ``#`` matches)."""
    out: list[str] = []
    for word in _words(pattern):
        if not (word == "#" and out and out[-1] == "#"):
            out.append(word)
    return tuple(out)


def _hash_closure(states: set[int], pattern: tuple[str, ...]) -> set[int]:
    """Add the states reached by letting each ``#`` match zero words."""
    todo = list(states)
    while todo:
        i = todo.pop()
        if i < len(pattern) and pattern[i] == "#" and i + 1 not in states:
            states.add(i + 1)
            todo.append(i + 1)
    return states


def topic_matches(pattern: str, routing_key: str) -> bool:
    """Whether a topic binding with ``pattern`` matches ``routing_key``.

    A set-of-positions walk over the pattern, one step per key word, so
    ``#.a.#.a.#`` against a long key costs words x pattern steps, never the
    exponential backtracking a regex would.
    """
    words = pattern_words(pattern)
    end = len(words)
    states = _hash_closure({0}, words)
    for word in _words(routing_key):
        step: set[int] = set()
        for i in states:
            if i < end:
                p = words[i]
                if p == "#":
                    step.add(i)
                elif p == "*" or p == word:
                    step.add(i + 1)
        if not step:
            return False
        states = _hash_closure(step, words)
    return end in states


# ---------------------------------------------------------------------------
# Per-exchange routing indexes

_Dest = tuple["DestinationKind", str]


class _TrieNode:
    __slots__ = ("children", "dests")

    def __init__(self) -> None:
        self.children: dict[str, _TrieNode] = {}
        self.dests: list[_Dest] = []


class Router:
    """What one exchange's type does with a message, plus its AE."""

    __slots__ = ("alternate", "uses_headers")

    def __init__(self, alternate: str | None) -> None:
        self.alternate = alternate
        self.uses_headers = False

    def match(self, keys: tuple[str, ...], headers: Mapping[str, object]) -> Iterable[_Dest]:
        raise NotImplementedError


class _FanoutRouter(Router):
    __slots__ = ("dests",)

    def __init__(self, alternate: str | None, bindings: Iterable[Binding]) -> None:
        super().__init__(alternate)
        self.dests = tuple({(b.destination_kind, b.destination) for b in bindings})

    def match(self, keys: tuple[str, ...], headers: Mapping[str, object]) -> Iterable[_Dest]:
        return self.dests


class _DirectRouter(Router):
    __slots__ = ("by_key",)

    def __init__(self, alternate: str | None, bindings: Iterable[Binding]) -> None:
        super().__init__(alternate)
        self.by_key: dict[str, set[_Dest]] = {}
        for b in bindings:
            self.by_key.setdefault(b.routing_key, set()).add((b.destination_kind, b.destination))

    def match(self, keys: tuple[str, ...], headers: Mapping[str, object]) -> Iterable[_Dest]:
        if len(keys) == 1:
            return self.by_key.get(keys[0], ())
        return [d for k in dict.fromkeys(keys) for d in self.by_key.get(k, ())]


class _TopicRouter(Router):
    """The broker's trie walk (``trie_match/4``). A (node, word index) state
    already visited is skipped: that only drops duplicates, but bounds the
    walk by nodes x words where ``#.#.#`` would otherwise explode."""

    __slots__ = ("root",)

    def __init__(self, alternate: str | None, bindings: Iterable[Binding]) -> None:
        super().__init__(alternate)
        self.root = _TrieNode()
        for b in bindings:
            node = self.root
            for word in _words(b.routing_key):
                node = node.children.setdefault(word, _TrieNode())
            node.dests.append((b.destination_kind, b.destination))

    def match(self, keys: tuple[str, ...], headers: Mapping[str, object]) -> Iterable[_Dest]:
        out: list[_Dest] = []
        for key in keys:
            self._walk(self.root, _words(key), 0, out, set())
        return out

    def _walk(
        self,
        node: _TrieNode,
        words: tuple[str, ...],
        i: int,
        out: list[_Dest],
        seen: set[tuple[int, int]],
    ) -> None:
        state = (id(node), i)
        if state in seen:
            return
        seen.add(state)
        children = node.children
        if i == len(words):
            out.extend(node.dests)
        else:
            child = children.get(words[i])
            if child is not None:
                self._walk(child, words, i + 1, out, seen)
            child = children.get("*")
            if child is not None:
                self._walk(child, words, i + 1, out, seen)
        hash_child = children.get("#")
        if hash_child is not None:
            for j in range(i, len(words) + 1):
                self._walk(hash_child, words, j, out, seen)


class _HeadersRouter(Router):
    __slots__ = ("specs",)

    def __init__(self, alternate: str | None, bindings: Iterable[Binding]) -> None:
        super().__init__(alternate)
        self.uses_headers = True
        self.specs = tuple(
            (*_headers_spec(b.arguments), (b.destination_kind, b.destination)) for b in bindings
        )

    def match(self, keys: tuple[str, ...], headers: Mapping[str, object]) -> Iterable[_Dest]:
        return [
            dest
            for match_all, entries, dest in self.specs
            if _headers_match(match_all, entries, headers)
        ]


def _headers_spec(arguments: Mapping[str, object]) -> tuple[bool, tuple[tuple[str, object], ...]]:
    """Compile a headers binding: (match all?, the (key, value) pairs compared)."""
    x_match = arguments.get("x-match")
    mode = x_match if isinstance(x_match, str) and x_match in _X_MATCH else "all"
    with_x = mode.endswith("-with-x")
    entries = tuple(
        (k, _VOID if v is None else _value(v))
        for k, v in arguments.items()
        if k != "x-match" and (with_x or not k.startswith("x-"))
    )
    return mode.startswith("all"), entries


def _headers_match(
    match_all: bool, entries: tuple[tuple[str, object], ...], headers: Mapping[str, object]
) -> bool:
    if match_all:
        for key, want in entries:
            if key not in headers or (want is not _VOID and headers[key] != want):
                return False
        return True
    for key, want in entries:
        if key in headers and (want is _VOID or headers[key] == want):
            return True
    return False


_ROUTERS: dict[str, type[_FanoutRouter | _DirectRouter | _TopicRouter | _HeadersRouter]] = {
    "direct": _DirectRouter,
    "fanout": _FanoutRouter,
    "topic": _TopicRouter,
    "headers": _HeadersRouter,
}


def router_for(exchange_type: str, alternate: str | None, bindings: Iterable[Binding]) -> Router:
    """The router of an exchange of ``exchange_type`` with ``bindings``;
    types other than the four built-in ones (plugins) route like fanout, a
    superset."""
    return _ROUTERS.get(exchange_type, _FanoutRouter)(alternate, bindings)


class Refused(Exception):
    """The broker would refuse the publish itself (bad CC/BCC header)."""


def header_routes(headers: Mapping[str, object]) -> tuple[str, ...]:
    """``rabbit_basic:header_routes/1``: longstr elements of CC then BCC."""
    routes: list[str] = []
    for name in ("CC", "BCC"):
        if name not in headers:
            continue
        value = headers[name]
        if not isinstance(value, list | tuple):
            raise Refused(name)
        for item in value:
            if isinstance(item, str):
                routes.append(item)
            elif type(item) is bytes:  # a longstr pamqp could not decode as UTF-8
                routes.append(item.decode("utf-8", "surrogateescape"))
    return tuple(routes)


def normalised_headers(headers: Mapping[str, object] | None) -> Mapping[str, object]:
    if not headers:
        return _NO_ARGS
    return {k: _value(v) for k, v in headers.items() if k != "BCC"}
