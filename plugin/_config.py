"""Site configuration: one TOML file per site, merged with CLI overrides.

Everything about reading the file lives in :func:`load_config`, which either
returns a frozen :class:`SiteConfig` or raises one :class:`ConfigError` naming
the file and the dotted key. An unknown key is an error, not a warning: a typo
such as ``amqp_ulr`` would otherwise silently fall back to a default and point
the node at the wrong broker.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bridge import MAX_SEGMENTS, HostPort, TlsConfig

from ._errors import ConfigError

__all__ = ["PeerConfig", "ReconcileConfig", "SiteConfig", "load_config"]

#: Debian's PostgreSQL JDBC driver (package libpostgresql-jdbc-java)
DEFAULT_JDBC_JAR = "/usr/share/java/postgresql.jar"


@dataclass(frozen=True, slots=True)
class ReconcileConfig:
    """``[reconcile]``: how ``vpnrepl reconcile`` runs, and whether (and how
    often) the node runs it on its own."""

    #: the node runs it for each active VPN about this often (None: never)
    interval_seconds: int | None = None
    #: scheduled runs repair what they find
    repair: bool = False
    #: ``pushdown`` (segment hashes computed in PostgreSQL) or ``jdbc``
    #: (rows read by Spark's JDBC source, hashed by Spark)
    method: str = "pushdown"
    #: the Spark master
    master: str = "local[*]"
    segments: int = 1024
    jdbc_jar: str = DEFAULT_JDBC_JAR
    #: seconds between the two broker-drift readings: more than the
    #: broker's ``collect_statistics_interval`` (5 s by default)
    drift_interval: int = 6


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """``[peers.NAME]`` (or the single ``[peer]`` with ``name``): a site this
    one replicates with, by the name its certificate and Hello carry."""

    name: str
    #: that site's bridge addresses (its nodes), dialled in this order
    bridge: tuple[HostPort, ...] = ()
    #: its database (switchover, reconciliation)
    store_dsn: str | None = None


@dataclass(frozen=True, slots=True)
class SiteConfig:
    """A validated site configuration."""

    path: str
    site_name: str
    #: ``broker.amqp_url``: the site's RabbitMQ nodes (one, or a cluster's),
    #: all with the same scheme and user; the listener spreads clients over
    #: them and the node's own connections move to the next when one fails
    amqp_urls: tuple[str, ...]
    #: ``broker.management_url``: the same nodes' management API
    management_urls: tuple[str, ...]
    listen_amqp: HostPort
    listen_bridge: HostPort
    listen_admin: HostPort
    store_dsn: str
    peer_bridge: HostPort | None
    tls: TlsConfig | None
    #: acknowledged ledger entries are kept this long before pruning, so a
    #: standby that reconnects within it catches up by replay, not checkpoint
    ledger_retain_seconds: int = 300
    #: past this many bytes of events the ledger is pruned even where the
    #: standby has not acknowledged it (0: no bound; ``bridge.ledger._bound``)
    ledger_max_bytes: int = 8 << 30
    #: how often that bound is checked
    ledger_check_seconds: int = 30
    #: how often the node re-reads each VPN's definitions from the broker
    topology_refresh_seconds: int = 30
    #: an OTLP/HTTP traces endpoint for the transaction spans (None: off)
    otlp_traces_url: str | None = None
    #: where AMQPS clients connect (None: no TLS listener); needs client_tls
    listen_amqps: HostPort | None = None
    #: the AMQPS listener's certificate, key and, for client certificates, CA
    client_tls: TlsConfig | None = None
    #: the CA that signed the broker's certificate, for an ``amqps://`` amqp_url
    #: (None: the system's trusted CAs)
    broker_ca: Path | None = None
    #: the peer site's database (switchover asks the active's node through
    #: it; reconciliation reads it): a role with read access is enough for
    #: reconciliation, switchover also writes operator requests
    peer_store_dsn: str | None = None
    reconcile: ReconcileConfig = ReconcileConfig()
    #: ``listen.max_connections``: client connections served at once
    max_client_connections: int = 10_000
    #: ``[configsync] copy_tags``: the user tags config-sync copies
    copy_tags: tuple[str, ...] = ()
    #: ``[admin] user`` / ``password`` / ``token``: the admin endpoint's
    #: credentials (None: none, allowed on loopback only)
    admin_user: str | None = None
    admin_password: str | None = None
    admin_token: str | None = None
    #: the peer sites, by name (``[peers.NAME]``); this release replicates
    #: with one
    peers: tuple[PeerConfig, ...] = ()
    #: ``[insecure] plaintext_bridge``: the bridge without TLS (no peer is
    #: authenticated); shown in every start's log, status and metrics. With
    #: ``[tls]`` too the pair is moving to TLS: the bridge takes and dials
    #: either (TLS first)
    plaintext_bridge: bool = False
    #: the ``--set`` overrides the file was read with (SIGHUP reads it again)
    overrides: tuple[str, ...] = ()

    @property
    def amqp_url(self) -> str:
        """The first broker node's URL: its scheme and user are every node's."""
        return self.amqp_urls[0]

    @property
    def management_url(self) -> str:
        return self.management_urls[0]

    @property
    def peer(self) -> PeerConfig | None:
        """The peer site, if one is configured."""
        return self.peers[0] if self.peers else None

    @property
    def peer_store_key(self) -> str:
        """The dotted key of the peer's ``store_dsn``, for errors."""
        return f"peers.{self.peer.name}.store_dsn" if self.peer else "peers.NAME.store_dsn"

    @property
    def bridge_authenticated(self) -> bool:
        """Peers prove their site name with a certificate (mutual TLS), and
        no plain TCP link is admitted."""
        return self.tls is not None and self.tls.ca is not None and not self.plaintext_bridge

    @property
    def bridge_moving(self) -> bool:
        """``[tls]`` and the opt-out together: the pair moves to TLS."""
        return self.tls is not None and self.plaintext_bridge


_REQUIRED = object()


def _url(*schemes: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in schemes or not parts.hostname:
            raise ValueError(f"expected a {' or '.join(schemes)} URL with a host")
        return value

    return check


def _urls(*schemes: str) -> Callable[[object], tuple[str, ...]]:
    """A URL, or a list of them (a RabbitMQ cluster's nodes): one scheme and
    one user across the list, no node twice."""
    one = _url(*schemes)

    def check(value: object) -> tuple[str, ...]:
        if isinstance(value, str):
            return (one(value),)
        if not isinstance(value, list) or not value:
            raise ValueError(f"expected an {' or '.join(schemes)} URL, or a list of them")
        urls: list[str] = []
        for n, item in enumerate(value, start=1):
            try:
                if not isinstance(item, str):
                    raise ValueError(f"expected a URL string, got {type(item).__name__}")
                parts, first = urlsplit(one(item)), urlsplit(urls[0] if urls else item)
                if parts.scheme != first.scheme:
                    raise ValueError(f"{parts.scheme}:// where item 1 is {first.scheme}://")
                if (parts.username, parts.password) != (first.username, first.password):
                    raise ValueError("another user or password than item 1's")
                node = (parts.hostname, parts.port)
                if any((urlsplit(u).hostname, urlsplit(u).port) == node for u in urls):
                    raise ValueError(f"{parts.hostname}:{parts.port} is named twice")
            except ValueError as e:
                raise ValueError(f"item {n}: {e}") from None
            urls.append(item)
        return tuple(urls)

    return check


def _site_name(value: str) -> str:
    if not value or not all(c.isalnum() or c in "-_." for c in value):
        raise ValueError("expected letters, digits, '-', '_' or '.'")
    return value


def _non_negative(value: int) -> int:
    if value < 0:
        raise ValueError("expected a number >= 0")
    return value


def _positive(value: int) -> int:
    if value < 1:
        raise ValueError("expected a number >= 1")
    return value


def _interval(value: int) -> int:
    if value < 10:
        raise ValueError("expected a number of seconds >= 10")
    return value


def _segments(value: int) -> int:
    if not 1 <= value <= MAX_SEGMENTS:
        raise ValueError(f"expected 1 to {MAX_SEGMENTS}")
    return value


def _method(value: str) -> str:
    if value not in ("pushdown", "jdbc"):
        raise ValueError("expected 'pushdown' or 'jdbc'")
    return value


def _spark_master(value: str) -> str:
    if not value.startswith(("local", "spark://", "yarn", "k8s://", "mesos://")):
        raise ValueError(
            "expected a Spark master URL (local[N], spark://HOST:PORT, yarn, k8s://...)"
        )
    return value


def _nonempty(value: str) -> str:
    if not value:
        raise ValueError("expected a non-empty string")
    return value


def _token(value: str) -> str:
    if len(value) < 16:
        raise ValueError("expected a token of 16 characters or more")
    return value


def _tag_list(value: list[Any]) -> tuple[str, ...]:
    if not all(isinstance(t, str) and t and "," not in t for t in value):
        raise ValueError('expected a list of RabbitMQ user tags, such as ["monitoring"]')
    return tuple(value)


def _file(value: str) -> str:
    if not value:
        raise ValueError("expected a file path")
    return value


# section -> key -> (type, default or _REQUIRED, converter)
_SCHEMA: dict[str, dict[str, tuple[type, object, Callable[[Any], Any]]]] = {
    "site": {"name": (str, _REQUIRED, _site_name)},
    "broker": {
        "amqp_url": (object, _REQUIRED, _urls("amqp", "amqps")),
        "management_url": (object, _REQUIRED, _urls("http", "https")),
        "topology_refresh_seconds": (int, 30, _positive),
        "ca": (str, None, _file),
    },
    "listen": {
        "amqp": (str, _REQUIRED, HostPort.parse),
        "amqps": (str, None, HostPort.parse),
        "bridge": (str, _REQUIRED, HostPort.parse),
        "admin": (str, "127.0.0.1:9480", HostPort.parse),
        "max_connections": (int, 10_000, _positive),
    },
    "store": {"dsn": (str, _REQUIRED, _url("postgresql", "postgres"))},
    "peer": {
        "name": (str, _REQUIRED, _site_name),
        "bridge": (str, None, HostPort.parse),
        "store_dsn": (str, None, _url("postgresql", "postgres")),
    },
    "insecure": {"plaintext_bridge": (bool, False, bool)},
    "configsync": {"copy_tags": (list, [], _tag_list)},
    "admin": {
        "user": (str, None, _nonempty),
        "password": (str, None, _nonempty),
        "token": (str, None, _token),
    },
    "replication": {
        "ledger_retain_seconds": (int, 300, _non_negative),
        "ledger_max_bytes": (int, 8 << 30, _non_negative),
        "ledger_check_seconds": (int, 30, _positive),
    },
    "telemetry": {"otlp_traces_url": (str, None, _url("http", "https"))},
    "reconcile": {
        "interval": (int, None, _interval),
        "repair": (bool, False, bool),
        "method": (str, "pushdown", _method),
        "master": (str, "local[*]", _spark_master),
        "segments": (int, 1024, _segments),
        "jdbc_jar": (str, DEFAULT_JDBC_JAR, _file),
        "drift_interval": (int, 6, _positive),
    },
    "tls": {
        "cert": (str, _REQUIRED, _file),
        "key": (str, _REQUIRED, _file),
        "ca": (str, _REQUIRED, _file),
    },
    "client_tls": {
        "cert": (str, _REQUIRED, _file),
        "key": (str, _REQUIRED, _file),
        "ca": (str, None, _file),
    },
}
_OPTIONAL_SECTIONS = {
    "peer", "tls", "client_tls", "replication", "telemetry", "reconcile", "insecure",
    "configsync", "admin",
}  # fmt: skip
#: ``[peers.NAME]``: the keys of each peer's table (``bridge``: one address
#: or a list, checked by :func:`_peer_table`)
_PEER_KEYS = ("bridge", "store_dsn")
_NO_TLS = (
    "the bridge is mutual TLS between named sites: set tls.cert, tls.key and tls.ca "
    "(`vpnrepl tls init DIR --sites A,B` makes them), or [insecure] plaintext_bridge = true"
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
    keys = _SCHEMA[section]
    for key in given:
        if key not in keys:
            raise ConfigError(path, f"{section}.{key}", f"unknown key (known: {', '.join(keys)})")
    values: dict[str, Any] = {}
    for key, (typ, default, convert) in keys.items():
        dotted = f"{section}.{key}"
        if key not in given:
            if default is _REQUIRED:
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
        if section not in _SCHEMA:
            raise ConfigError(path, section, f"unknown section (known: {', '.join(_SCHEMA)})")
        if not isinstance(raw[section], dict):
            raise ConfigError(path, section, "expected a [section] table")
    return {
        section: _validated_section(path, section, raw.get(section) or {})
        for section in _SCHEMA
        if section in raw or section not in _OPTIONAL_SECTIONS
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


def _plaintext_bridge(path: str, v: Mapping[str, Mapping[str, Any]], tls: TlsConfig | None) -> bool:
    """``[insecure] plaintext_bridge``: required when there is no ``[tls]``;
    beside one, the bridge takes and dials both while the pair moves to TLS
    (README "Moving a plaintext pair to mutual TLS")."""
    plaintext = bool(v["insecure"]["plaintext_bridge"]) if "insecure" in v else False
    if tls is None and not plaintext:
        raise ConfigError(path, "tls", _NO_TLS)
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
            _site_name(name)
        except ValueError as e:
            raise ConfigError(path, f"peers.{name}", f"peer site name: {e}") from e
        out.append(_peer_table(path, name, tables[name]))
    return tuple(out)


def _peer_table(path: str, name: str, table: object) -> PeerConfig:
    where = f"peers.{name}"
    if not isinstance(table, dict):
        raise ConfigError(path, where, "expected a [peers.NAME] table")
    for key in table:
        if key not in _PEER_KEYS:
            raise ConfigError(
                path, f"{where}.{key}", f"unknown key (known: {', '.join(_PEER_KEYS)})"
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
            _url("postgresql", "postgres")(dsn)
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
