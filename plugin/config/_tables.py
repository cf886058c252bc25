"""The file's named tables: ``[peers.NAME]`` (the sites this one
replicates with) and ``[nodes.NAME]`` (this site's node processes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bridge import HostPort
from plugin._errors import ConfigError

from ._checks import NODE_KEYS, PEER_KEYS, site_name_check, url_check, validated_table
from ._values import NodeConfig, PeerConfig

__all__ = ["RESERVED_NODE_NAMES", "node_tables", "peer_tables"]

#: holders of the site's lease that are no node: the CLI acting alone, and
#: the one node of a ``[listen]`` site
RESERVED_NODE_NAMES = ("cli", "node")


def peer_tables(path: str, raw: Mapping[str, Any]) -> tuple[PeerConfig, ...]:
    """``[peers.NAME]`` tables, in name order."""
    tables = raw.get("peers", {})
    if not isinstance(tables, dict):
        raise ConfigError(path, "peers", "expected [peers.NAME] tables")
    out = []
    for name in sorted(tables):
        try:
            site_name_check(name)
        except ValueError as e:
            raise ConfigError(path, f"peers.{name}", f"peer site name: {e}") from e
        out.append(_peer_table(path, name, tables[name]))
    return tuple(out)


def _peer_table(path: str, name: str, table: object) -> PeerConfig:
    where = f"peers.{name}"
    if not isinstance(table, dict):
        raise ConfigError(path, where, "expected a [peers.NAME] table")
    for key in table:
        if key not in PEER_KEYS:
            raise ConfigError(
                path, f"{where}.{key}", f"unknown key (known: {', '.join(PEER_KEYS)})"
            )
    bridge = table.get("bridge", [])
    addresses = [bridge] if isinstance(bridge, str) else bridge
    if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
        raise ConfigError(path, f"{where}.bridge", "expected an address or a list of addresses")
    try:
        parsed = tuple(HostPort.parse(a) for a in addresses)
    except ValueError as e:
        raise ConfigError(path, f"{where}.bridge", str(e)) from e
    dsn = table.get("store_dsn")
    if dsn is not None:
        if not isinstance(dsn, str):
            raise ConfigError(path, f"{where}.store_dsn", f"expected str, got {type(dsn).__name__}")
        try:
            url_check("postgresql", "postgres")(dsn)
        except ValueError as e:
            raise ConfigError(path, f"{where}.store_dsn", str(e)) from e
    return PeerConfig(name, parsed, dsn)


def node_tables(path: str, raw: Mapping[str, Any]) -> tuple[NodeConfig, ...]:
    """``[nodes.NAME]`` tables, in name order: each names its own listen
    addresses, and no two nodes are reached at the same address."""
    tables = raw.get("nodes", {})
    if not isinstance(tables, dict):
        raise ConfigError(path, "nodes", "expected [nodes.NAME] tables")
    out: list[NodeConfig] = []
    for name in sorted(tables):
        where = f"nodes.{name}"
        try:
            site_name_check(name)
        except ValueError as e:
            raise ConfigError(path, where, f"node name: {e}") from e
        if name in RESERVED_NODE_NAMES:
            raise ConfigError(
                path, where, f"node name: {name!r} names a holder of the site's lease already"
            )
        if not isinstance(tables[name], dict):
            raise ConfigError(path, where, "expected a [nodes.NAME] table")
        v = validated_table(path, where, tables[name], NODE_KEYS)
        out.append(
            NodeConfig(
                name, v["amqp"], v["bridge"], v["admin"], v["amqps"], v["host"],
                v["max_connections"],
            )
        )  # fmt: skip
    if len(out) > 1:
        _reachable_apart(path, out)
    return tuple(out)


def _reachable_apart(path: str, nodes: list[NodeConfig]) -> None:
    """With several nodes, each must be reachable by the others: a node
    listening on every address names its ``host``, and no two nodes are
    reached at one address."""
    seen: dict[HostPort, str] = {}
    for node in nodes:
        where = f"nodes.{node.name}"
        listens = (node.amqp, node.bridge, node.admin, node.amqps)
        for listen in (a for a in listens if a is not None):
            if node.host is None and listen.host in ("0.0.0.0", "::", ""):  # noqa: S104
                raise ConfigError(
                    path,
                    f"{where}.host",
                    f"{listen} listens on every address: name the host the site's other "
                    "nodes reach this node at",
                )
            at = node.reach(listen)
            if at in seen:
                raise ConfigError(path, where, f"{at} is also node {seen[at]!r}'s address")
            seen[at] = node.name
