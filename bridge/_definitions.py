"""A VPN's definitions as a standby holds them: the active's last listing,
and the topology changes streamed after it.

A listing comes with the active's durable ledger index when it was read,
``L``: every change the listener made before ``L`` is in it, every later one
comes as a :class:`~bridge.TopologyChanged` entry above ``L``. So the VPN's
topology is the listing with the changes above ``L`` applied in index order
(:func:`merge_definitions`), whatever order listing and stream arrive in;
replaying a change the listing shows is harmless, each change setting one
object's state outright (docs/behaviour.md, "Topology in the stream"). No
I/O: the store reads the rows (:mod:`bridge.store._topology`), config-sync
imports the result (:mod:`bridge.broker._configsync`).
"""

from __future__ import annotations

import datetime
import decimal
import json
from collections.abc import Iterable, Mapping
from typing import Any

from ._events import TopologyChanged

__all__ = [
    "DefinitionsError",
    "binding_item",
    "streamed_deletions",
    "exchange_item",
    "merge_definitions",
    "name_item",
    "queue_item",
]

#: exchanges every vhost has: a binding may name them without their declare
_BUILT_IN_PREFIX = "amq."


class DefinitionsError(ValueError):
    """A stored listing or topology item that is not what it must be."""


def _canonical(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _jsonable(value: object) -> Any:
    """An AMQP field-table value as the management API shows it in JSON."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, datetime.datetime):
        return int(value.timestamp())
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value)


def _arguments(arguments: Mapping[str, object]) -> dict[str, Any]:
    return {str(k): _jsonable(v) for k, v in arguments.items()}


def queue_item(
    name: str, arguments: Mapping[str, object], *, durable: bool, auto_delete: bool
) -> str:
    """A declared queue, as the definitions export has it."""
    return _canonical(
        {"name": name, "durable": durable, "auto_delete": auto_delete,
         "arguments": _arguments(arguments)}
    )  # fmt: skip


def exchange_item(
    name: str,
    exchange_type: str,
    arguments: Mapping[str, object],
    *,
    durable: bool,
    auto_delete: bool,
    internal: bool,
) -> str:
    """A declared exchange, as the definitions export has it."""
    return _canonical(
        {"name": name, "type": exchange_type, "durable": durable, "auto_delete": auto_delete,
         "internal": internal, "arguments": _arguments(arguments)}
    )  # fmt: skip


def binding_item(
    source: str,
    destination: str,
    destination_type: str,
    routing_key: str,
    arguments: Mapping[str, object],
) -> str:
    """A binding (``destination_type`` ``queue`` or ``exchange``)."""
    return _canonical(
        {"source": source, "destination": destination, "destination_type": destination_type,
         "routing_key": routing_key, "arguments": _arguments(arguments)}
    )  # fmt: skip


def name_item(name: str) -> str:
    """What a delete names."""
    return _canonical({"name": name})


def _binding_key(b: Mapping[str, Any]) -> tuple[str, str, str, str, str]:
    return (
        str(b.get("source", "")),
        str(b.get("destination_type", "")),
        str(b.get("destination", "")),
        str(b.get("routing_key", "")),
        _canonical(b.get("arguments") or {}),
    )


def _item(change: TopologyChanged) -> dict[str, Any]:
    try:
        item = json.loads(change.item)
    except ValueError as e:
        raise DefinitionsError(f"a {change.op} item is not JSON: {e}") from e
    if not isinstance(item, dict):
        raise DefinitionsError(f"a {change.op} item is not a JSON object")
    binding = change.op in ("bind", "unbind")
    need = ("source", "destination", "destination_type") if binding else ("name",)
    for key in need:
        if not isinstance(item.get(key), str):
            raise DefinitionsError(f"a {change.op} item has no {key!r}")
    return item


class _Topology:
    """The three lists of a definitions document, keyed for changes."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self.queues = {str(q.get("name")): dict(q) for q in _records(doc, "queues")}
        self.exchanges = {str(x.get("name")): dict(x) for x in _records(doc, "exchanges")}
        self.bindings = {_binding_key(b): dict(b) for b in _records(doc, "bindings")}

    def apply(self, change: TopologyChanged) -> None:
        item = _item(change)
        op = change.op
        if op == "queue.declare":
            self.queues[item["name"]] = item
        elif op == "exchange.declare":
            self.exchanges[item["name"]] = item
        elif op == "queue.delete":
            self.queues.pop(item["name"], None)
            self._unbind_all("queue", item["name"])
        elif op == "exchange.delete":
            self.exchanges.pop(item["name"], None)
            self._unbind_all("exchange", item["name"])
        elif op == "bind":
            self.bindings[_binding_key(item)] = item
        elif op == "unbind":
            self.bindings.pop(_binding_key(item), None)
        else:
            raise DefinitionsError(f"unknown topology operation {op!r}")

    def _unbind_all(self, kind: str, name: str) -> None:
        for key, b in list(self.bindings.items()):
            as_destination = b.get("destination_type") == kind and b.get("destination") == name
            if as_destination or (kind == "exchange" and b.get("source") == name):
                del self.bindings[key]

    def _exists(self, kind: str, name: str) -> bool:
        if kind == "queue":
            return name in self.queues
        return name == "" or name.startswith(_BUILT_IN_PREFIX) or name in self.exchanges

    def lists(self) -> dict[str, list[dict[str, Any]]]:
        """Sorted lists; a binding whose ends are gone is left out (the
        broker would refuse it)."""
        bindings = [
            b
            for key, b in sorted(self.bindings.items())
            if self._exists("exchange", key[0]) and self._exists(key[1], key[2])
        ]
        return {
            "queues": [self.queues[n] for n in sorted(self.queues)],
            "exchanges": [self.exchanges[n] for n in sorted(self.exchanges)],
            "bindings": bindings,
        }


def _records(doc: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    found = doc.get(key, [])
    if not isinstance(found, list) or not all(isinstance(r, Mapping) for r in found):
        raise DefinitionsError(f"the stored definitions' {key!r} is not a list of objects")
    return found


def merge_definitions(
    listing: Mapping[str, Any] | None, changes: Iterable[TopologyChanged]
) -> dict[str, Any]:
    """The listing with ``changes`` (those above its index, in index order)
    applied: a whole definitions document (every other key of the listing,
    users and permissions included, as it was)."""
    doc = dict(listing or {})
    topology = _Topology(doc)
    for change in changes:
        topology.apply(change)
    doc.update(topology.lists())
    return doc


def streamed_deletions(
    changes: Iterable[TopologyChanged], now: Mapping[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """The deletes and unbinds among ``changes`` whose object ``now`` (a
    definitions document) does not hold again: ``(op, item)`` in order, for
    the standby's broker to carry out (config-sync adds and updates only)."""
    topology = _Topology(now)
    out: list[tuple[str, dict[str, Any]]] = []
    for change in changes:
        if change.op == "queue.delete":
            item = _item(change)
            if item["name"] not in topology.queues:
                out.append((change.op, item))
        elif change.op == "exchange.delete":
            item = _item(change)
            if item["name"] not in topology.exchanges:
                out.append((change.op, item))
        elif change.op == "unbind":
            item = _item(change)
            if _binding_key(item) not in topology.bindings:
                out.append((change.op, item))
    return out
