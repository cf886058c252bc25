"""The checks of single configuration values, and the schema of the
file's sections: what each key holds, its default and its check."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from bridge import MAX_SEGMENTS, HostPort
from plugin._errors import ConfigError

from ._values import DEFAULT_JDBC_JAR

REQUIRED = object()


def url_check(*schemes: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in schemes or not parts.hostname:
            raise ValueError(f"expected a {' or '.join(schemes)} URL with a host")
        return value

    return check


def _urls(*schemes: str) -> Callable[[object], tuple[str, ...]]:
    """A URL, or a list of them (a RabbitMQ cluster's nodes): one scheme and
    one user across the list, no node twice."""
    one = url_check(*schemes)

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


def site_name_check(value: str) -> str:
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


def lease_seconds_check(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value <= 600:
        raise ValueError("expected a number of seconds from 1 to 600")
    return float(value)


def _host(value: str) -> str:
    if not value or any(c.isspace() or c in "/@" for c in value):
        raise ValueError("expected a host name or address")
    return value.strip("[]")


def _file(value: str) -> str:
    if not value:
        raise ValueError("expected a file path")
    return value


# section -> key -> (type, default or REQUIRED, converter)
SCHEMA: dict[str, dict[str, tuple[type, object, Callable[[Any], Any]]]] = {
    "site": {
        "name": (str, REQUIRED, site_name_check),
        "lease_seconds": (object, 15.0, lease_seconds_check),
    },
    "broker": {
        "amqp_url": (object, REQUIRED, _urls("amqp", "amqps")),
        "management_url": (object, REQUIRED, _urls("http", "https")),
        "topology_refresh_seconds": (int, 30, _positive),
        "ca": (str, None, _file),
    },
    "listen": {
        "amqp": (str, REQUIRED, HostPort.parse),
        "amqps": (str, None, HostPort.parse),
        "bridge": (str, REQUIRED, HostPort.parse),
        "admin": (str, "127.0.0.1:9480", HostPort.parse),
        "max_connections": (int, 10_000, _positive),
    },
    "store": {"dsn": (str, REQUIRED, url_check("postgresql", "postgres"))},
    "peer": {
        "name": (str, REQUIRED, site_name_check),
        "bridge": (str, None, HostPort.parse),
        "store_dsn": (str, None, url_check("postgresql", "postgres")),
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
    "telemetry": {"otlp_traces_url": (str, None, url_check("http", "https"))},
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
        "cert": (str, REQUIRED, _file),
        "key": (str, REQUIRED, _file),
        "ca": (str, REQUIRED, _file),
    },
    "client_tls": {
        "cert": (str, REQUIRED, _file),
        "key": (str, REQUIRED, _file),
        "ca": (str, None, _file),
    },
}
#: each ``[nodes.NAME]`` table: ``[listen]``'s keys, and the host the
#: site's other nodes reach the node at
NODE_KEYS: dict[str, tuple[type, object, Callable[[Any], Any]]] = {
    "amqp": (str, REQUIRED, HostPort.parse),
    "amqps": (str, None, HostPort.parse),
    "bridge": (str, REQUIRED, HostPort.parse),
    "admin": (str, "127.0.0.1:9480", HostPort.parse),
    "max_connections": (int, 10_000, _positive),
    "host": (str, None, _host),
}
OPTIONAL_SECTIONS = {
    "listen", "peer", "tls", "client_tls", "replication", "telemetry", "reconcile", "insecure",
    "configsync", "admin",
}  # fmt: skip
#: ``[peers.NAME]``: the keys of each peer's table (``bridge``: one address
#: or a list, checked by :func:`_peer_table`)
PEER_KEYS = ("bridge", "store_dsn")
NO_TLS = (
    "the bridge is mutual TLS between named sites: set tls.cert, tls.key and tls.ca "
    "(`vpnrepl tls init DIR --sites A,B` makes them), or [insecure] plaintext_bridge = true"
)


def validated_table(
    path: str,
    section: str,
    given: Mapping[str, Any],
    keys: Mapping[str, tuple[type, object, Callable[[Any], Any]]],
) -> dict[str, Any]:
    """``given`` (the table ``section`` of the file) checked against
    ``keys``: every key known, every required one there, each value
    converted; a :class:`ConfigError` names the first that is not."""
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
