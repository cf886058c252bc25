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

from bridge import HostPort, TlsConfig
from plugin._errors import ConfigError

from ._checks import (
    NO_TLS,
    OPTIONAL_SECTIONS,
    PEER_KEYS,
    REQUIRED,
    SCHEMA,
    site_name_check,
    url_check,
)
from ._values import PeerConfig, ReconcileConfig, SiteConfig

__all__ = ["load_config"]


def load_config(path: str, overrides: tuple[str, ...] = ()) -> SiteConfig:
    """Read ``path``, apply ``SECTION.KEY=VALUE`` overrides, validate, freeze.

    Override values are TOML values when they parse as one (``5``, ``"x"``)
    and plain strings otherwise (``127.0.0.1:5673``).
    """
    raw = _read_file(path)
    for item in overrides:
        section, key, value = _parse_override(path, item)
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(path, section, "expected a [section] table")
        if section == "peers":
            name, dot, key = key.partition(".")
            if not dot:
                raise ConfigError(path, None, f"override {item!r} is not peers.NAME.KEY=VALUE")
            table = table.setdefault(name, {})
            if not isinstance(table, dict):
                raise ConfigError(path, f"peers.{name}", "expected a [peers.NAME] table")
        table[key] = value
    peers = _peers(path, raw)
    v = _validated(path, {k: t for k, t in raw.items() if k != "peers"})
    tls = _tls_config(path, "tls", v["tls"]) if "tls" in v else None
    client_tls = _tls_config(path, "client_tls", v["client_tls"]) if "client_tls" in v else None
    listen_amqps = v["listen"]["amqps"]
    if listen_amqps is not None and client_tls is None:
        raise ConfigError(path, "listen.amqps", "requires a [client_tls] section (cert, key)")
    if client_tls is not None and listen_amqps is None:
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
            listen_amqp=v["listen"]["amqp"],
            listen_bridge=v["listen"]["bridge"],
            listen_admin=v["listen"]["admin"],
            max_client_connections=v["listen"]["max_connections"],
            copy_tags=v["configsync"]["copy_tags"] if "configsync" in v else (),
            **_admin(path, v),
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


def _validated_section(path: str, section: str, given: Mapping[str, Any]) -> dict[str, Any]:
    keys = SCHEMA[section]
    for key in given:
        if key not in keys:
            raise ConfigError(path, f"{section}.{key}", f"unknown key (known: {', '.join(keys)})")
    values: dict[str, Any] = {}
    for key, (typ, default, convert) in keys.items():
        dotted = f"{section}.{key}"
        if key not in given:
            if default is REQUIRED:
                raise ConfigError(path, dotted, "required key is missing")
            values[key] = default if default is None else convert(default)
            continue
        value = given[key]
        if not isinstance(value, typ):
            raise ConfigError(path, dotted, f"expected {typ.__name__}, got {type(value).__name__}")
        try:
            values[key] = convert(value)
        except ValueError as e:
            raise ConfigError(path, dotted, str(e)) from e
    return values


def _validated(path: str, raw: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    for section in raw:
        if section not in SCHEMA:
            raise ConfigError(path, section, f"unknown section (known: {', '.join(SCHEMA)})")
        if not isinstance(raw[section], dict):
            raise ConfigError(path, section, "expected a [section] table")
    return {
        section: _validated_section(path, section, raw.get(section) or {})
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


def _admin(path: str, v: Mapping[str, Mapping[str, Any]]) -> dict[str, str | None]:
    """``[admin]``'s credentials; off loopback the endpoint must have some."""
    a = v.get("admin", {"user": None, "password": None, "token": None})
    if (a["user"] is None) != (a["password"] is None):
        raise ConfigError(path, "admin", "user and password go together")
    host = v["listen"]["admin"].host
    loopback = host in ("localhost", "::1") or host.startswith("127.")
    if not loopback and a["user"] is None and a["token"] is None:
        raise ConfigError(
            path,
            "listen.admin",
            f"{host} is not loopback, and the endpoint can promote and demote: set [admin] "
            "user and password (HTTP basic) or token (a bearer token), or listen on 127.0.0.1",
        )
    return {"admin_user": a["user"], "admin_password": a["password"], "admin_token": a["token"]}


def _checked(cfg: SiteConfig) -> SiteConfig:
    if cfg.reconcile.interval_seconds is not None and cfg.peer_store_dsn is None:
        raise ConfigError(
            cfg.path, "reconcile.interval", f"needs {cfg.peer_store_key} (the standby's store)"
        )
    return cfg


def _peers(path: str, raw: Mapping[str, Any]) -> tuple[PeerConfig, ...]:
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
