"""Ports and processes of the local servers: free ports on 127.0.0.1 that no
system server uses, a process and all its descendants (SIGKILLed at once,
as a crash would), waiting for a process to exit, and the error a local
server that fails raises (with the tail of its log).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

from plugin._errors import PluginError

__all__ = [
    "HarnessError",
    "free_port",
    "kill_tree",
    "log_tail",
    "process_tree",
    "stat_fields",
    "wait_dead",
]

# RabbitMQ's CLI tools take distribution ports 35672-35682 and the system node
# 25672; never hand those out.
_RESERVED_PORTS = {25672, *range(35672, 35683), 5672, 15672, 5432, 4369}
_handed_out: set[int] = set()


class HarnessError(PluginError):
    """A local server failed to start, stop or answer."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on and we have not handed out."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _RESERVED_PORTS and port not in _handed_out and port < 60000:
            _handed_out.add(port)
            return port


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stat_fields(stat: Path) -> list[str]:
    """The fields of a ``/proc/PID/stat`` after the command name (state,
    parent pid, ...; the name may hold spaces and parentheses)."""
    return stat.read_text().rsplit(")", 1)[1].split()


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_fields(stat)
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, found = [pid], []
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants at once (a crash, not a shutdown)."""
    for p in process_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_dead(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            pass
        time.sleep(0.05)
    raise HarnessError(f"process {pid} did not exit within {timeout:.0f} s")
