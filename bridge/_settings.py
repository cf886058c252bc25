"""The settings the replication core is given, as validated value objects.

Per VPN: role, mode, sync timeout and policy, scope (:class:`VpnSettings`);
per site: the addresses and TLS material of links (:class:`HostPort`,
:class:`TlsConfig`). ``plugin`` builds them from the site's file and the
admin's command line; every layer reads them. A VPN (a RabbitMQ vhost)
replicates the union of its ``--queues`` regexes (searched in the name with
:func:`re.search`, as RabbitMQ searches a policy's pattern) and its
``--topics`` ``EXCHANGE:PATTERN`` filters; with neither, every queue, as an
operator who enables a VPN expects (docs/behaviour.md, "The admin's commands").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = [
    "DEFAULT_SYNC_TIMEOUT_MS",
    "HostPort",
    "InvalidSettings",
    "Mode",
    "Role",
    "SyncTimeoutPolicy",
    "TlsConfig",
    "TopicFilter",
    "VpnSettings",
    "redact_url",
]

_E = TypeVar("_E", bound=StrEnum)

DEFAULT_SYNC_TIMEOUT_MS = 2000
MAX_SYNC_TIMEOUT_MS = 3_600_000


class InvalidSettings(ValueError):
    """A setting the admin gave is invalid; the message names the option
    (``--mode``, ``--topics``), so the command line can answer with it."""


class Role(StrEnum):
    ACTIVE = "active"
    STANDBY = "standby"


class Mode(StrEnum):
    SYNC = "sync"
    ASYNC = "async"


class SyncTimeoutPolicy(StrEnum):
    DEGRADE = "degrade"
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class TopicFilter:
    """``EXCHANGE:PATTERN``: publishes to EXCHANGE whose key matches PATTERN."""

    exchange: str
    pattern: str

    @classmethod
    def parse(cls, text: str) -> TopicFilter:
        exchange, sep, pattern = text.partition(":")
        if not sep or not pattern:
            raise InvalidSettings(f"--topics {text!r}: expected EXCHANGE:PATTERN")
        if any(w not in ("*", "#") and ("*" in w or "#" in w) for w in pattern.split(".")):
            raise InvalidSettings(f"--topics {text!r}: '*' and '#' must stand alone between dots")
        return cls(exchange, pattern)

    def __str__(self) -> str:
        return f"{self.exchange}:{self.pattern}"


@dataclass(frozen=True, slots=True)
class VpnSettings:
    """What ``vpnrepl vpn enable`` stores for one VPN."""

    name: str
    role: Role
    mode: Mode = Mode.ASYNC
    sync_timeout_ms: int = DEFAULT_SYNC_TIMEOUT_MS
    on_sync_timeout: SyncTimeoutPolicy = SyncTimeoutPolicy.DEGRADE
    queue_patterns: tuple[str, ...] = ()
    topic_filters: tuple[TopicFilter, ...] = ()
    #: consumers see the ``x-vpnrepl-id`` header (tracing); by default the
    #: listener removes it from every message it hands a client
    expose_id: bool = False

    @classmethod
    def from_args(
        cls,
        name: str,
        role: str,
        mode: str = Mode.ASYNC,
        sync_timeout_ms: int = DEFAULT_SYNC_TIMEOUT_MS,
        on_sync_timeout: str = SyncTimeoutPolicy.DEGRADE,
        queues: tuple[str, ...] = (),
        topics: tuple[str, ...] = (),
        expose_id: bool = False,
    ) -> VpnSettings:
        """Validate admin input; every fault names the option at fault."""
        if not name or len(name.encode()) > 255:
            raise InvalidSettings("VPN name must be 1..255 bytes")
        if not 1 <= sync_timeout_ms <= MAX_SYNC_TIMEOUT_MS:
            raise InvalidSettings(f"--sync-timeout-ms must be 1..{MAX_SYNC_TIMEOUT_MS}")
        for regex in queues:
            try:
                re.compile(regex)
            except re.error as e:
                raise InvalidSettings(f"--queues {regex!r}: not a valid regex: {e}") from e
        return cls(
            name=name,
            role=_enum(Role, role, "--role"),
            mode=_enum(Mode, mode, "--mode"),
            sync_timeout_ms=sync_timeout_ms,
            on_sync_timeout=_enum(SyncTimeoutPolicy, on_sync_timeout, "--on-sync-timeout"),
            queue_patterns=tuple(queues),
            topic_filters=tuple(TopicFilter.parse(t) for t in topics),
            expose_id=expose_id,
        )


def _enum(kind: type[_E], value: str, option: str) -> _E:
    try:
        return kind(value)
    except ValueError as e:
        allowed = "|".join(m.value for m in kind)
        raise InvalidSettings(f"{option} {value!r}: expected {allowed}") from e


@dataclass(frozen=True, slots=True)
class HostPort:
    """A ``host:port`` listen or connect address."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> HostPort:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host or not port_text.isdigit():
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        port = int(port_text)
        if not 0 <= port <= 65535:
            raise ValueError(f"port {port} is outside 0..65535")
        return cls(host.strip("[]"), port)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS material of one server or link (``[tls]`` for the bridge,
    ``[client_tls]`` for AMQPS clients); mutual TLS when ``ca`` is set."""

    cert: Path
    key: Path
    ca: Path | None


def redact_url(url: str) -> str:
    """``url`` with its passwords replaced, fit for a log line: the one in
    the authority and any ``password`` (or ``passwd``, ``sslpassword``)
    query parameter, as libpq and AMQP URLs allow."""
    parts = urlsplit(url)
    if parts.query:
        query = [
            (k, "***" if k.lower() in _SECRET_PARAMETERS else v)
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        ]
        parts = parts._replace(query=urlencode(query, safe="*"))
    if parts.password is not None:
        netloc = f"{parts.username}:***@{parts.hostname}"
        if parts.port is not None:
            netloc += f":{parts.port}"
        parts = parts._replace(netloc=netloc)
    return urlunsplit(parts)


#: query parameters that carry a secret
_SECRET_PARAMETERS = frozenset({"password", "passwd", "sslpassword"})
