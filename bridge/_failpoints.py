"""Test-only crash points: kill this process at a named step.

A node started with ``VPNREPL_FAILPOINT=<name>`` SIGKILLs itself the first
time it reaches :func:`failpoint` with that name — no cleanup, no graceful
close, exactly what a crash at that step leaves behind (a graceful close
would, e.g., roll back what a crash leaves in doubt). The variable is read
once, at import; unset (production), a failpoint costs one comparison.

Names are listed in :data:`FAILPOINTS`, and an unknown name in the variable
stops ``vpnrepl node`` at start (exit status 2, one line naming the known
ones), so a typo in a test cannot silently test nothing.
"""

from __future__ import annotations

import logging
import os
import signal

__all__ = ["FAILPOINTS", "UnknownFailpoint", "armed", "failpoint"]

log = logging.getLogger(__name__)

#: Every step a crash test can stop at, in protocol order.
FAILPOINTS: dict[str, str] = {
    # active (coordinator) side
    "coordinator.after-local-prepare": "the active's prepared row is committed",
    "coordinator.after-prepare": "both sites prepared; the broker commit is not sent",
    "coordinator.after-broker-commit": "the broker committed; no decision recorded",
    "coordinator.after-early-commit": "the standby committed early; commit-ok not sent",
    "coordinator.after-decision": "the decision is durable; commit-ok not sent",
    # standby (participant) side
    "participant.after-prepare": "the standby's prepared row is committed; no vote sent",
    "participant.after-early-commit": "the standby committed early; no answer sent",
    "participant.after-apply": "the standby applied the transaction; no ack sent",
    # promotion (the node or the CLI running `vpnrepl promote`)
    "promotion.after-begin": "the epoch is raised and the role active; nothing materialised",
    "promotion.mid-materialise": "about half the live messages are in the broker",
    "promotion.before-finish": "every live message is in the broker; not recorded done",
    # a promoted site's XA branch
    "xa.after-restore": "a rolled-back branch's held messages are back; the branch prepared",
}

_ENV = "VPNREPL_FAILPOINT"


class UnknownFailpoint(ValueError):
    """``VPNREPL_FAILPOINT`` names no failpoint (the node answers it as a
    usage error)."""


def _parse() -> tuple[str | None, UnknownFailpoint | None]:
    name = os.environ.get(_ENV) or None
    if name is not None and name not in FAILPOINTS:
        known = ", ".join(FAILPOINTS)
        return None, UnknownFailpoint(f"{_ENV}={name!r} is not a failpoint (known: {known})")
    return name, None


_ARMED, _ERROR = _parse()


def armed() -> str | None:
    """The failpoint this process will crash at, if any; raises
    :class:`UnknownFailpoint` for a name that is none (the node calls this
    first thing at start)."""
    if _ERROR is not None:
        raise _ERROR
    return _ARMED


def failpoint(name: str) -> None:
    """SIGKILL this process if ``name`` is the armed failpoint."""
    if _ARMED is not None and name == _ARMED:
        log.warning("failpoint %s reached: killing this process", name)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
