"""The plugin's error taxonomy.

One root, :class:`PluginError`, split by what the caller should do: a
:class:`ConfigError` or :class:`UsageError` means the admin must change what
they typed (exit status 2); a :class:`StateError` means the request was well
formed but conflicts with the site's current state (exit status 1).
"""

from __future__ import annotations


class PluginError(Exception):
    """Root of every error raised by the ``plugin`` package."""


class UsageError(PluginError):
    """A command-line argument or a value the admin supplied is invalid."""


class ConfigError(UsageError):
    """The site configuration file is unreadable or invalid.

    Always names the file and, when one is at fault, the dotted key
    (``broker.amqp_url``) so the admin can go straight to the line.
    """

    def __init__(self, path: str, key: str | None, problem: str) -> None:
        self.path = path
        self.key = key
        self.problem = problem
        where = f"{path}: {key}" if key else path
        super().__init__(f"{where}: {problem}")


class StateError(PluginError):
    """The request conflicts with the current replication state."""


class StoreUnavailable(PluginError):
    """The site's PostgreSQL could not be reached or refused the login."""
