"""Where and as whom the node connects to a broker: an ``amqp://`` URL."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

__all__ = ["AmqpEndpoint"]


@dataclass(frozen=True, slots=True)
class AmqpEndpoint:
    """Where and as whom to connect, from an ``amqp://`` or ``amqps://`` URL.

    The URL's path (a virtual host) is not kept: the caller names the vhost.
    """

    host: str
    port: int
    tls: bool
    username: str
    password: str = field(repr=False)

    @classmethod
    def from_url(cls, url: str) -> AmqpEndpoint:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise ValueError(f"not an AMQP URL: {e}") from e
        if parts.scheme not in ("amqp", "amqps"):
            raise ValueError(f"an AMQP URL starts with amqp:// or amqps://, got {parts.scheme!r}")
        tls = parts.scheme == "amqps"
        return cls(
            host=parts.hostname or "localhost",
            port=port or (5671 if tls else 5672),
            tls=tls,
            username=unquote(parts.username) if parts.username is not None else "guest",
            password=unquote(parts.password) if parts.password is not None else "guest",
        )

    def __str__(self) -> str:
        return f"{'amqps' if self.tls else 'amqp'}://{self.username}@{self.host}:{self.port}"
