"""The topology of one VPN and RabbitMQ 3.10's routing, reproduced without I/O.

The listener asks :meth:`Topology.route` for every persistent publish which
queues the broker will put the message in, and the ledger records that set:
the standby materialises exactly those copies after a promotion. So route()
answers what RabbitMQ 3.10.8 itself would for the topology held, never a
guess. The rules, and what the model cannot reproduce (:func:`tagged`):
docs/behaviour.md, "How the listener routes";
``tests/site/test_routing_differential.py`` checks them against a live node.

Cost: per publish a lookup in a result cache keyed by (exchange, routing
keys), cleared by every mutation; a miss walks per-exchange indexes (a dict
for direct, a trie for topic) built lazily, rebuilt only when that
exchange's bindings change. A walk through a headers exchange depends on the
headers and is never cached.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

from ._entities import (
    NO_ARGS,
    Binding,
    DestinationKind,
    Exchange,
    ExchangeType,
    ExportError,
    Policy,
    Queue,
    binding_from_json,
    definition_field,
    definition_items,
    frozen_args,
    policy_from_json,
)
from ._routing import (
    Refused,
    Router,
    header_routes,
    normalised_headers,
    router_for,
)

__all__ = ["Topology"]

_EMPTY: frozenset[str] = frozenset()
_ROUTE_CACHE_LIMIT = 65_536

_PREDECLARED = (
    Exchange("", ExchangeType.DIRECT),
    Exchange("amq.direct", ExchangeType.DIRECT),
    Exchange("amq.fanout", ExchangeType.FANOUT),
    Exchange("amq.topic", ExchangeType.TOPIC),
    Exchange("amq.headers", ExchangeType.HEADERS),
    Exchange("amq.match", ExchangeType.HEADERS),
    Exchange("amq.rabbitmq.trace", ExchangeType.TOPIC, internal=True),
)

_BindingId = tuple[object, ...]
_Dest = tuple[DestinationKind, str]


_DEAD_LETTER_MEMO_LIMIT = 4096


class Topology:
    """Exchanges, queues, bindings and policies of one vhost, and its routing.

    Mutators mirror what the listener sees *after* the broker's ``-ok``, so
    they never fail: a re-declare keeps the existing entity (the broker does
    too; it only checks equivalence), deleting something unknown is a no-op,
    and a binding whose endpoint the model does not know is kept but routes
    nowhere until that endpoint is declared. A queue named in a bind-ok is
    known to exist, so :meth:`bind_queue` records it.
    """

    def __init__(self, vhost: str = "/") -> None:
        self.vhost = vhost
        self._exchanges: dict[str, Exchange] = {x.name: x for x in _PREDECLARED}
        self._queues: dict[str, Queue] = {}
        self._by_source: dict[str, dict[_BindingId, Binding]] = {}
        self._by_destination: dict[_Dest, set[_BindingId]] = {}
        self._policies: tuple[Policy, ...] = ()
        self._routers: dict[str, Router] = {}
        self._cache: dict[tuple[str, str, tuple[str, ...]], frozenset[str]] = {}
        #: dead_letter's answers (asked once per delivery): valid until a change
        self._dead_letters: dict[str, tuple[str, str | None] | None] = {}
        self._generation = 0

    # -- views --------------------------------------------------------------

    @property
    def generation(self) -> int:
        """Bumped by every mutation that changed something: a holder of a
        definitions snapshot taken at generation N knows whether the wire
        changed the model since."""
        return self._generation

    @property
    def exchanges(self) -> Mapping[str, Exchange]:
        return MappingProxyType(self._exchanges)

    @property
    def queues(self) -> Mapping[str, Queue]:
        return MappingProxyType(self._queues)

    @property
    def policies(self) -> tuple[Policy, ...]:
        return self._policies

    def bindings(self) -> Iterator[Binding]:
        for by_id in self._by_source.values():
            yield from by_id.values()

    def alternate_exchange(self, exchange: str) -> str | None:
        """The AE RabbitMQ would use for ``exchange`` (argument, else policy)."""
        x = self._exchanges.get(exchange)
        if x is None:
            return None
        if "alternate-exchange" in x.arguments:
            value = x.arguments["alternate-exchange"]
            return value if isinstance(value, str) else None
        policy = self._policy_for(x.name)
        if policy is None:
            return None
        value = policy.definition.get("alternate-exchange")
        return value if isinstance(value, str) else None

    def keeps_consumed(self, queue: str) -> bool:
        """Whether ``queue`` keeps what its consumers ack: a stream queue
        (``x-queue-type: stream``), an append-only log read from an offset,
        whose messages only its retention removes."""
        q = self._queues.get(queue)
        return q is not None and q.arguments.get("x-queue-type") == "stream"

    def dead_letter(self, queue: str) -> tuple[str, str | None] | None:
        """Where RabbitMQ sends a message rejected (or nacked) without
        requeue from ``queue``: its dead-letter exchange and routing key
        (None: the message's own), or None when it is dropped. Each of the
        two keys comes from the queue's ``x-`` argument, else the policy."""
        if queue in self._dead_letters:
            return self._dead_letters[queue]
        found = self._dead_letter(queue)
        if len(self._dead_letters) >= _DEAD_LETTER_MEMO_LIMIT:
            self._dead_letters.clear()
        self._dead_letters[queue] = found
        return found

    def _dead_letter(self, queue: str) -> tuple[str, str | None] | None:
        q = self._queues.get(queue)
        if q is None:
            return None
        policy = self._policy_for(queue, queues=True)
        found: list[object] = []
        for key in ("dead-letter-exchange", "dead-letter-routing-key"):
            value = q.arguments.get(f"x-{key}")
            if value is None and policy is not None:
                value = policy.definition.get(key)
            found.append(value)
        exchange, routing_key = found
        if not isinstance(exchange, str):
            return None
        return exchange, routing_key if isinstance(routing_key, str) else None

    def _policy_for(self, name: str, *, queues: bool = False) -> Policy | None:
        """The one policy RabbitMQ applies to an exchange (or a queue):
        highest priority; ties are in an order RabbitMQ does not define,
        here by name."""
        best: Policy | None = None
        for p in self._policies:
            applies = p.applies_to_queue(name) if queues else p.applies_to_exchange(name)
            if applies and (best is None or (-p.priority, p.name) < (-best.priority, best.name)):
                best = p
        return best

    # -- mutators -------------------------------------------------------------

    def declare_exchange(
        self,
        name: str,
        type: str,
        arguments: Mapping[str, object] | None = None,
        internal: bool = False,
        *,
        auto_delete: bool = False,
    ) -> None:
        if name in self._exchanges:
            return
        self._exchanges[name] = Exchange(name, type, frozen_args(arguments), internal, auto_delete)
        self._changed(name)

    def delete_exchange(self, name: str) -> None:
        """Also removes its bindings either way; the default exchange stays."""
        if name == "" or name not in self._exchanges:
            return
        self._remove_exchange(name)

    def declare_queue(self, name: str, arguments: Mapping[str, object] | None = None) -> None:
        if name in self._queues:
            return
        self._queues[name] = Queue(name, frozen_args(arguments))
        self._touch()

    def delete_queue(self, name: str) -> None:
        if self._queues.pop(name, None) is None:
            return
        self._touch()
        self._remove_bindings_to((DestinationKind.QUEUE, name))

    def bind_queue(
        self,
        queue: str,
        exchange: str,
        routing_key: str,
        arguments: Mapping[str, object] | None = None,
    ) -> None:
        self.declare_queue(queue)
        self._add(
            Binding(exchange, queue, DestinationKind.QUEUE, routing_key, frozen_args(arguments))
        )

    def unbind_queue(
        self,
        queue: str,
        exchange: str,
        routing_key: str,
        arguments: Mapping[str, object] | None = None,
    ) -> None:
        self._remove(
            Binding(exchange, queue, DestinationKind.QUEUE, routing_key, frozen_args(arguments))
        )

    def bind_exchange(
        self,
        destination: str,
        source: str,
        routing_key: str,
        arguments: Mapping[str, object] | None = None,
    ) -> None:
        self._add(
            Binding(
                source, destination, DestinationKind.EXCHANGE, routing_key, frozen_args(arguments)
            )
        )

    def unbind_exchange(
        self,
        destination: str,
        source: str,
        routing_key: str,
        arguments: Mapping[str, object] | None = None,
    ) -> None:
        self._remove(
            Binding(
                source, destination, DestinationKind.EXCHANGE, routing_key, frozen_args(arguments)
            )
        )

    def set_policies(self, policies: Iterable[Policy]) -> None:
        self._policies = tuple(policies)
        self._routers.clear()
        self._touch()

    def _touch(self) -> None:
        self._cache.clear()
        self._dead_letters.clear()
        self._generation += 1

    def _changed(self, exchange: str) -> None:
        self._routers.pop(exchange, None)
        self._touch()

    def _add(self, b: Binding) -> None:
        ident = b.identity
        by_id = self._by_source.setdefault(b.source, {})
        if ident in by_id:
            return
        by_id[ident] = b
        self._by_destination.setdefault((b.destination_kind, b.destination), set()).add(ident)
        self._changed(b.source)

    def _remove(self, b: Binding) -> None:
        ident = b.identity
        by_id = self._by_source.get(b.source)
        if by_id is None or by_id.pop(ident, None) is None:
            return  # the broker unbinds nothing and auto-deletes nothing either
        self._forget_destination(b, ident)
        if not by_id:
            del self._by_source[b.source]
        self._changed(b.source)
        self._maybe_auto_delete(b.source)

    def _forget_destination(self, b: Binding, ident: _BindingId) -> None:
        dest = (b.destination_kind, b.destination)
        idents = self._by_destination.get(dest)
        if idents is not None:
            idents.discard(ident)
            if not idents:
                del self._by_destination[dest]

    def _remove_bindings_to(self, dest: _Dest) -> None:
        sources: set[str] = set()
        for ident in self._by_destination.pop(dest, set()):
            source = ident[0]
            assert isinstance(source, str)  # noqa: S101 - identity layout
            by_id = self._by_source.get(source)
            if by_id is not None and by_id.pop(ident, None) is not None:
                sources.add(source)
                if not by_id:
                    del self._by_source[source]
                self._changed(source)
        for source in sorted(sources):
            self._maybe_auto_delete(source)

    def _maybe_auto_delete(self, name: str) -> None:
        x = self._exchanges.get(name)
        if x is not None and x.auto_delete and name not in self._by_source:
            self._remove_exchange(name)

    def _remove_exchange(self, name: str) -> None:
        del self._exchanges[name]
        for b in list(self._by_source.pop(name, {}).values()):
            self._forget_destination(b, b.identity)
        self._changed(name)
        self._remove_bindings_to((DestinationKind.EXCHANGE, name))

    # -- loading --------------------------------------------------------------

    @classmethod
    def from_definitions(cls, vhost: str, definitions: Mapping[str, Any]) -> Topology:
        """Build from ``GET /api/definitions/{vhost}`` (or the whole-broker
        ``GET /api/definitions``, whose items carry ``vhost``; other vhosts'
        items are skipped).

        The export is lossy and this loader undoes what it can: a void
        binding argument is exported as the string ``"undefined"`` and is read
        back as void (a literal ``"undefined"`` string argument cannot be told
        apart); ``x`` byte strings arrive as strings and timestamps as
        integers, which compare the same at the top level; decimals arrive
        mangled as floats and cannot be restored.
        """
        if not isinstance(definitions, Mapping):
            raise ExportError("definitions: expected a JSON object")
        topology = cls(vhost)
        for item in definition_items(definitions, "exchanges", vhost):
            topology.declare_exchange(
                definition_field(item, "exchanges", "name", str),
                definition_field(item, "exchanges", "type", str),
                definition_field(item, "exchanges", "arguments", dict, {}),
                definition_field(item, "exchanges", "internal", bool, False),
                auto_delete=definition_field(item, "exchanges", "auto_delete", bool, False),
            )
        for item in definition_items(definitions, "queues", vhost):
            topology.declare_queue(
                definition_field(item, "queues", "name", str),
                definition_field(item, "queues", "arguments", dict, {}),
            )
        for item in definition_items(definitions, "bindings", vhost):
            topology._add(binding_from_json(item))
        topology.set_policies(
            policy_from_json(p) for p in definition_items(definitions, "policies", vhost)
        )
        return topology

    # -- routing --------------------------------------------------------------

    def route(
        self, exchange: str, routing_key: str, headers: Mapping[str, object] | None = None
    ) -> frozenset[str]:
        """The queues RabbitMQ 3.10 delivers this publish to (see module doc)."""
        extra: tuple[str, ...] = ()
        if headers and ("CC" in headers or "BCC" in headers):
            try:
                extra = header_routes(headers)
            except Refused:
                return _EMPTY
        cache_key = (exchange, routing_key, extra)
        hit = self._cache.get(cache_key)
        if hit is not None:
            return hit
        x = self._exchanges.get(exchange)
        if x is None or x.internal:
            return _EMPTY
        keys = (routing_key, *extra)
        if exchange == "":
            result = frozenset(k for k in keys if k in self._queues)
            cacheable = True
        else:
            result, cacheable = self._walk(x, keys, headers)
        if cacheable:
            if len(self._cache) >= _ROUTE_CACHE_LIMIT:
                del self._cache[next(iter(self._cache))]
            self._cache[cache_key] = result
        return result

    def _walk(
        self, start: Exchange, keys: tuple[str, ...], headers: Mapping[str, object] | None
    ) -> tuple[frozenset[str], bool]:
        """``rabbit_exchange:route1/3``; returns (queues, cacheable)."""
        queues: set[str] = set()
        seen = {start.name}
        work = [start]
        norm: Mapping[str, object] | None = None
        cacheable = True
        while work:
            router = self._router(work.pop())
            if router.uses_headers:
                cacheable = False
                if norm is None:
                    norm = normalised_headers(headers)
            found = False
            for kind, name in router.match(keys, NO_ARGS if norm is None else norm):
                if kind is DestinationKind.QUEUE:
                    if name in self._queues:
                        queues.add(name)
                        found = True
                elif name in self._exchanges:
                    found = True
                    if name not in seen:
                        seen.add(name)
                        work.append(self._exchanges[name])
            ae = router.alternate
            if not found and ae is not None and ae not in seen:
                seen.add(ae)
                if ae in self._exchanges:
                    work.append(self._exchanges[ae])
        return frozenset(queues), cacheable

    def _router(self, x: Exchange) -> Router:
        router = self._routers.get(x.name)
        if router is None:
            bindings = self._by_source.get(x.name, {}).values()
            router = router_for(x.type, self.alternate_exchange(x.name), bindings)
            self._routers[x.name] = router
        return router
