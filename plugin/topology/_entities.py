"""A vhost's entities as frozen values, and how RabbitMQ's definitions
export describes them.

:class:`~plugin.topology._topology.Topology` holds these values and routes
over them. A value never changes once made (its argument table is frozen
too), so a binding's identity (:attr:`Binding.identity`, as RabbitMQ
compares it for an unbind) is stable. The definitions export
(``GET /api/definitions``) is read item by item with its types checked:
anything that is not what RabbitMQ exports is an :class:`ExportError`
naming the item, never a half-loaded topology.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from types import MappingProxyType
from typing import Any

from plugin._errors import PluginError

from ._routing import tagged

__all__ = [
    "Binding",
    "ExportError",
    "DestinationKind",
    "Exchange",
    "ExchangeType",
    "Policy",
    "Queue",
    "binding_from_json",
    "definition_field",
    "definition_items",
    "frozen_args",
    "policy_from_json",
]

NO_ARGS: Mapping[str, object] = MappingProxyType({})


class ExportError(PluginError):
    """The management API's definitions JSON is not what RabbitMQ exports."""


class ExchangeType(StrEnum):
    DIRECT = "direct"
    FANOUT = "fanout"
    TOPIC = "topic"
    HEADERS = "headers"


class DestinationKind(StrEnum):
    QUEUE = "queue"
    EXCHANGE = "exchange"


def frozen_args(arguments: Mapping[str, object] | None) -> Mapping[str, object]:
    return NO_ARGS if not arguments else MappingProxyType(dict(arguments))


@dataclass(frozen=True, slots=True)
class Exchange:
    """One exchange. ``type`` is a plain string so plugin types survive a load."""

    name: str
    type: str
    arguments: Mapping[str, object] = field(default_factory=lambda: NO_ARGS, hash=False)
    internal: bool = False
    auto_delete: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", frozen_args(self.arguments))


@dataclass(frozen=True, slots=True)
class Queue:
    name: str
    arguments: Mapping[str, object] = field(default_factory=lambda: NO_ARGS, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", frozen_args(self.arguments))


@dataclass(frozen=True, slots=True)
class Binding:
    """A binding. Its identity, as in RabbitMQ, includes the arguments:
    two headers bindings between the same pair differing only in arguments
    are two bindings."""

    source: str
    destination: str
    destination_kind: DestinationKind
    routing_key: str
    arguments: Mapping[str, object] = field(default_factory=lambda: NO_ARGS, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", frozen_args(self.arguments))

    @property
    def identity(self) -> tuple[object, ...]:
        """What RabbitMQ compares to find the binding an unbind names: the
        argument table sorted by key (``rabbit_binding:binding_action/3``)."""
        args = tuple(sorted((k, tagged(v)) for k, v in self.arguments.items()))
        return (self.source, self.destination_kind, self.destination, self.routing_key, args)


@dataclass(frozen=True, slots=True)
class Policy:
    """A (user) policy; ``alternate-exchange`` affects routing, and
    ``dead-letter-exchange`` / ``dead-letter-routing-key`` where a rejected
    message goes.

    Operator policies can set neither, so they are not modelled.
    """

    name: str
    pattern: str
    definition: Mapping[str, object] = field(default_factory=lambda: NO_ARGS, hash=False)
    priority: int = 0
    apply_to: str = "all"

    def __post_init__(self) -> None:
        object.__setattr__(self, "definition", frozen_args(self.definition))

    def applies_to_exchange(self, name: str) -> bool:
        """``rabbit_policy:matches/2``: ``apply-to`` exchanges|all, and the
        pattern is *searched* (``re:run``, unanchored) in the name."""
        if self.apply_to not in ("exchanges", "all"):
            return False
        regex = _policy_regex(self.pattern)
        return regex is not None and regex.search(name) is not None

    def applies_to_queue(self, name: str) -> bool:
        """As :meth:`applies_to_exchange`, for ``apply-to`` queues|all."""
        if self.apply_to not in ("queues", "all"):
            return False
        regex = _policy_regex(self.pattern)
        return regex is not None and regex.search(name) is not None


@lru_cache(maxsize=256)
def _policy_regex(pattern: str) -> re.Pattern[str] | None:
    try:
        return re.compile(pattern)
    except re.error:
        return None  # RabbitMQ validated it as PCRE; Python cannot read it


# ---------------------------------------------------------------------------
# The definitions export


def definition_items(
    definitions: Mapping[str, Any], key: str, vhost: str
) -> Iterator[Mapping[str, Any]]:
    items = definitions.get(key, [])
    if not isinstance(items, list):
        raise ExportError(f"definitions: {key!r} must be a list")
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ExportError(f"definitions: {key}[{i}] must be an object")
        if item.get("vhost", vhost) == vhost:
            yield item


def definition_field(
    item: Mapping[str, Any], kind: str, name: str, typ: type, *default: Any
) -> Any:
    if name not in item:
        if default:
            return default[0]
        raise ExportError(f"definitions: {kind} item {_label(item)} lacks {name!r}")
    value = item[name]
    if typ is dict and value == []:
        value = {}  # RabbitMQ exports an empty argument table as [] in some versions
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ExportError(
            f"definitions: {kind} item {_label(item)}: {name!r} must be {typ.__name__}"
        )
    return value


def _label(item: Mapping[str, Any]) -> str:
    return repr(item.get("name", item.get("source", "?")))


def binding_from_json(item: Mapping[str, Any]) -> Binding:
    kind = definition_field(item, "bindings", "destination_type", str)
    if kind not in (DestinationKind.QUEUE, DestinationKind.EXCHANGE):
        raise ExportError(
            f"definitions: bindings item {_label(item)}: destination_type {kind!r} "
            "is neither 'queue' nor 'exchange'"
        )
    arguments = {
        k: None if v == "undefined" else v
        for k, v in definition_field(item, "bindings", "arguments", dict, {}).items()
    }
    return Binding(
        definition_field(item, "bindings", "source", str),
        definition_field(item, "bindings", "destination", str),
        DestinationKind(kind),
        definition_field(item, "bindings", "routing_key", str, ""),
        arguments,
    )


def policy_from_json(item: Mapping[str, Any]) -> Policy:
    return Policy(
        name=definition_field(item, "policies", "name", str),
        pattern=definition_field(item, "policies", "pattern", str),
        definition=definition_field(item, "policies", "definition", dict, {}),
        priority=definition_field(item, "policies", "priority", int, 0),
        apply_to=definition_field(item, "policies", "apply-to", str, "all"),
    )
