"""One ``vpnrepl node`` process, as the demo, the tests and the benchmarks
run it for a local site.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import suppress
from pathlib import Path
from typing import Any

from ._localsites import LocalSite
from ._processes import HarnessError

__all__ = ["LocalNode"]


class LocalNode:
    """One ``vpnrepl node`` process for a :class:`LocalSite` (its config file
    written by :meth:`LocalSite.write_config`), as the demo, the tests and the
    benchmarks run it: output to ``log``, in a session of its own (a Ctrl-C
    on the terminal is for the caller to pass on), healthy once its admin
    endpoint answers ``/health``."""

    def __init__(
        self,
        site: LocalSite,
        config: Path,
        log: Path,
        name: str | None = None,
        code: Path | None = None,
        node: str | None = None,
        admin_port: int | None = None,
    ) -> None:
        """``code``: a directory holding another release's packages to run
        instead of these (an upgrade test's previous release); ``node``:
        the ``[nodes.NAME]`` table to run as (``node --name``), whose admin
        endpoint is on ``admin_port`` (default: the site's)."""
        self.site = site
        self.config = config
        self.log = log
        self.name = name or node or site.name
        self.code = code
        self.node = node
        self.admin_port = admin_port or site.admin_port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = 60.0, failpoint: str | None = None) -> None:
        """Start the node and wait until it is healthy; ``failpoint`` arms a
        crash at that step (``txn/_failpoints.py``)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("VPNREPL_FAILPOINT", None)
        if failpoint is not None:
            env["VPNREPL_FAILPOINT"] = failpoint
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(  # noqa: S603 - our own package
                [sys.executable, "-m", "plugin", "--config", str(self.config), "node"]
                + (["--name", self.node] if self.node is not None else []),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.code,  # ``-m plugin`` imports from there first
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise HarnessError(
                    f"node {self.name} exited {self.proc.returncode}:\n{self.tail()}"
                )
            with suppress(OSError):
                if self.get("/health") == "ok\n":
                    return
            if time.monotonic() > deadline:
                raise HarnessError(f"node {self.name} not healthy in {timeout:g} s:\n{self.tail()}")
            time.sleep(0.1)

    def get(self, path: str) -> str:
        """GET ``path`` of the node's admin endpoint."""
        url = f"http://127.0.0.1:{self.admin_port}{path}"
        with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - loopback
            return str(resp.read().decode())

    def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.get("/status"))
        return doc

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        """The node's output so far ("" if it was never started)."""
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (a clean stop); SIGKILL if it is not gone within
        ``timeout``. Returns the exit status (0 if it never ran)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return int(self.proc.returncode)

    def kill(self) -> None:
        """SIGKILL the node, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
