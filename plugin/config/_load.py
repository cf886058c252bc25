"""Site configuration: one TOML file per site, merged with CLI overrides.

Everything about reading the file lives in :func:`load_config`, which either
returns a frozen :class:`SiteConfig` or raises one :class:`ConfigError` naming
the file and the dotted key. An unknown key is an error, not a warning: a typo
such as ``amqp_ulr`` would otherwise silently fall back to a default and point
the node at the wrong broker.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bridge import TlsConfig
from plugin._errors import ConfigError

from ._checks import (
    NO_TLS,
    OPTIONAL_SECTIONS,
    SCHEMA,
    validated_table,
)
from ._tables import node_tables, peer_tables
from ._values import NodeConfig, PeerConfig, ReconcileConfig, SiteConfig

__all__ = ["load_config"]


def load_config(path: str, overrides: tuple[str, ...] = (), node: str | None = None) -> SiteConfig:
    """Read ``path``, apply ``SECTION.KEY=VALUE`` overrides, validate, freeze.

    Override values are TOML values when they parse as one (``5``, ``"x"``)
    and plain strings otherwise (``127.0.0.1:5673``). ``node`` is the node
    this process runs as (``node --name``): its ``[nodes.NAME]`` table gives
    the listen addresses; without it, the first node's (a command that only
    reaches the site through its database or listener).
    """
    raw = _read_file(path)
    for item in overrides:
        section, key, value = _parse_override(path, item)
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(path, section, "expected a [section] table")
        if section in ("peers", "nodes"):
            name, dot, key = key.partition(".")
            if not dot:
                raise ConfigError(path, None, f"override {item!r} is not {section}.NAME.KEY=VALUE")
            table = table.setdefault(name, {})
            if not isinstance(table, dict):
                raise ConfigError(path, f"{section}.{name}", f"expected a [{section}.NAME] table")
        table[key] = value
    peers = peer_tables(path, raw)
    nodes = node_tables(path, raw)
    v = _validated(path, {k: t for k, t in raw.items() if k not in ("peers", "nodes")})
    listen = _listen(path, v, nodes, node)
    if "application_name" in urlsplit(v["store"]["dsn"]).query:
        raise ConfigError(
            path,
            "store.dsn",
            "application_name is the node's to set (a node that takes the site's lease ends "
            "the sessions of the one before by it): remove it",
        )
    tls = _tls_config(path, "tls", v["tls"]) if "tls" in v else None
    client_tls = _tls_config(path, "client_tls", v["client_tls"]) if "client_tls" in v else None
    listen_amqps = listen["amqps"]
    if listen_amqps is not None and client_tls is None:
        raise ConfigError(path, listen["@amqps"], "requires a [client_tls] section (cert, key)")
    if client_tls is not None and not any(
        a is not None for a in [listen_amqps, *(n.amqps for n in nodes)]
    ):
        raise ConfigError(path, "client_tls", "is only used with listen.amqps, which is not set")
    if v["broker"]["ca"] is not None and urlsplit(v["broker"]["amqp_url"][0]).scheme != "amqps":
        raise ConfigError(path, "broker.ca", "is only used with an amqps:// broker.amqp_url")
    plaintext = _plaintext_bridge(path, v, tls)
    peers = _all_peers(path, v, peers)
    peer = peers[0] if peers else None
    return _checked(
        SiteConfig(
            path=path,
            site_name=v["site"]["name"],
            amqp_urls=v["broker"]["amqp_url"],
            management_urls=v["broker"]["management_url"],
            listen_amqp=listen["amqp"],
            listen_bridge=listen["bridge"],
            listen_admin=listen["admin"],
            max_client_connections=listen["max_connections"],
            copy_tags=v["configsync"]["copy_tags"] if "configsync" in v else (),
            **_admin(path, v, listen, nodes),
            store_dsn=v["store"]["dsn"],
            peer_bridge=peer.bridge[0] if peer is not None and peer.bridge else None,
            peer_store_dsn=peer.store_dsn if peer is not None else None,
            peers=peers,
            plaintext_bridge=plaintext,
            overrides=tuple(overrides),
            tls=tls,
            ledger_retain_seconds=(
                v["replication"]["ledger_retain_seconds"] if "replication" in v else 300
            ),
            ledger_max_bytes=v["replication"]["ledger_max_bytes"]
            if "replication" in v
            else 8 << 30,
            ledger_check_seconds=(
                v["replication"]["ledger_check_seconds"] if "replication" in v else 30
            ),
            topology_refresh_seconds=v["broker"]["topology_refresh_seconds"],
            otlp_traces_url=v["telemetry"]["otlp_traces_url"] if "telemetry" in v else None,
            listen_amqps=listen_amqps,
            client_tls=client_tls,
            broker_ca=_existing_file(path, "broker.ca", v["broker"]["ca"]),
            reconcile=_reconcile(path, v),
            node_name=listen["@name"],
            nodes=nodes,
            lease_seconds=v["site"]["lease_seconds"],
        )
    )


def _parse_override(path: str, item: str) -> tuple[str, str, object]:
    """``SECTION.KEY=VALUE`` (``peers.NAME.KEY=VALUE`` for a peer's table:
    the key comes back as ``NAME.KEY``)."""
    dotted, sep, raw = item.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(path, None, f"override {item!r} is not SECTION.KEY=VALUE")
    try:
        value: object = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as e:
        raise ConfigError(path, None, "file not found") from e
    except OSError as e:
        raise ConfigError(path, None, f"cannot read: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(path, None, f"not valid TOML: {e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(path, None, f"not UTF-8 text (byte {e.start}): TOML is UTF-8") from e


def _validated(path: str, raw: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    for section in raw:
        if section not in SCHEMA:
            raise ConfigError(path, section, f"unknown section (known: {', '.join(SCHEMA)})")
        if not isinstance(raw[section], dict):
            raise ConfigError(path, section, "expected a [section] table")
    return {
        section: validated_table(path, section, raw.get(section) or {}, SCHEMA[section])
        for section in SCHEMA
        if section in raw or section not in OPTIONAL_SECTIONS
    }


def _existing_file(path: str, dotted: str, value: str | None) -> Path | None:
    """A file key's value resolved against the config file's directory; it
    must exist now, so a typo stops the command rather than the handshake."""
    if value is None:
        return None
    file = Path(path).resolve().parent / value
    if not file.is_file():
        raise ConfigError(path, dotted, f"file not found: {file}")
    return file


def _tls_config(path: str, section: str, values: Mapping[str, str | None]) -> TlsConfig:
    files = {key: _existing_file(path, f"{section}.{key}", value) for key, value in values.items()}
    cert, key_file = files["cert"], files["key"]
    assert cert is not None and key_file is not None  # noqa: S101 - required keys
    return TlsConfig(cert=cert, key=key_file, ca=files["ca"])


def _plaintext_bridge(path: str, v: Mapping[str, Mapping[str, Any]], tls: TlsConfig | None) -> bool:
    """``[insecure] plaintext_bridge``: required when there is no ``[tls]``;
    beside one, the bridge takes and dials both while the pair moves to TLS
    (README "Moving a plaintext pair to mutual TLS")."""
    plaintext = bool(v["insecure"]["plaintext_bridge"]) if "insecure" in v else False
    if tls is None and not plaintext:
        raise ConfigError(path, "tls", NO_TLS)
    return plaintext


def _all_peers(
    path: str, v: Mapping[str, Mapping[str, Any]], peers: tuple[PeerConfig, ...]
) -> tuple[PeerConfig, ...]:
    """``[peers.NAME]`` tables, or the one ``[peer]`` (read as
    ``[peers.<name>]``); one peer site at most in this release."""
    if "peer" in v:
        p = v["peer"]
        if peers:
            raise ConfigError(path, "peer", "both [peer] and [peers.NAME]: keep one of them")
        bridge = (p["bridge"],) if p["bridge"] is not None else ()
        peers = (PeerConfig(p["name"], bridge, p["store_dsn"]),)
    if len(peers) > 1:
        raise ConfigError(
            path, "peers", f"names {len(peers)} peer sites; this release replicates with one"
        )
    if any(p.name == v["site"]["name"] for p in peers):
        raise ConfigError(path, "peers", "names this site itself")
    return peers


def _listen(
    path: str,
    v: Mapping[str, Mapping[str, Any]],
    nodes: tuple[NodeConfig, ...],
    name: str | None,
) -> dict[str, Any]:
    """The listen addresses this process uses: ``[listen]``'s, or the
    ``[nodes.NAME]`` table of the node it runs as. ``@name`` is the node's
    name, ``@amqps`` the dotted key its AMQPS address came from."""
    if nodes and "listen" in v:
        raise ConfigError(path, "listen", "both [listen] and [nodes.NAME]: keep one of them")
    if not nodes:
        if "listen" not in v:
            raise ConfigError(
                path, "listen", "missing: a site has [listen] (one node) or [nodes.NAME] tables"
            )
        return {**v["listen"], "@name": name or "", "@amqps": "listen.amqps"}
    if name is None:
        chosen = nodes[0]
    elif (found := next((n for n in nodes if n.name == name), None)) is not None:
        chosen = found
    else:
        known = ", ".join(n.name for n in nodes)
        raise ConfigError(path, f"nodes.{name}", f"no such node table (known: {known})")
    return {
        "amqp": chosen.amqp,
        "amqps": chosen.amqps,
        "bridge": chosen.bridge,
        "admin": chosen.admin,
        "max_connections": chosen.max_connections,
        "@name": chosen.name if name is not None else "",
        "@amqps": f"nodes.{chosen.name}.amqps",
    }


def _admin(
    path: str,
    v: Mapping[str, Mapping[str, Any]],
    listen: Mapping[str, Any],
    nodes: tuple[NodeConfig, ...],
) -> dict[str, str | None]:
    """``[admin]``'s credentials; off loopback the endpoint must have some."""
    a = v.get("admin", {"user": None, "password": None, "token": None})
    if (a["user"] is None) != (a["password"] is None):
        raise ConfigError(path, "admin", "user and password go together")
    where = [(f"nodes.{n.name}.admin", n.admin) for n in nodes] or [
        ("listen.admin", listen["admin"])
    ]
    for key, admin in where:
        host = admin.host
        loopback = host in ("localhost", "::1") or host.startswith("127.")
        if not loopback and a["user"] is None and a["token"] is None:
            raise ConfigError(
                path,
                key,
                f"{host} is not loopback, and the endpoint can promote and demote: set [admin] "
                "user and password (HTTP basic) or token (a bearer token), or listen on "
                "127.0.0.1",
            )
    return {"admin_user": a["user"], "admin_password": a["password"], "admin_token": a["token"]}


def _checked(cfg: SiteConfig) -> SiteConfig:
    if cfg.reconcile.interval_seconds is not None and cfg.peer_store_dsn is None:
        raise ConfigError(
            cfg.path, "reconcile.interval", f"needs {cfg.peer_store_key} (the standby's store)"
        )
    return cfg


def _reconcile(path: str, v: Mapping[str, Mapping[str, Any]]) -> ReconcileConfig:
    if "reconcile" not in v:
        return ReconcileConfig()
    r = v["reconcile"]
    # (checked again against [peers.NAME] by load_config)
    return ReconcileConfig(
        interval_seconds=r["interval"],
        repair=r["repair"],
        method=r["method"],
        master=r["master"],
        segments=r["segments"],
        jdbc_jar=r["jdbc_jar"],
        drift_interval=r["drift_interval"],
    )
