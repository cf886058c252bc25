"""The README's mutual-TLS walkthrough runs as written: certificates made
with `vpnrepl tls init`, two sites on a sandbox of local servers, a sync VPN, a client
publishing through the listener, both sites agreeing, metrics on /metrics.

The only change made to the text is where the sandbox lives (a directory of
this test's instead of ``/tmp/vpnrepl-try``)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import suppress
from pathlib import Path

from tests import REPO

ROOT = REPO
SANDBOX = "/tmp/vpnrepl-try"


def walkthrough() -> str:
    text = (ROOT / "README.md").read_text()
    part = text.split("<!-- walkthrough -->", 1)[1].split("<!-- /walkthrough -->", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", part, re.S)
    assert blocks, "the README's walkthrough has no sh block"
    return "\n".join(blocks)


def test_the_readme_walkthrough_works_as_written() -> None:
    # reachable by the postgres user, as /tmp/vpnrepl-try is (pytest's are not)
    base = Path(tempfile.mkdtemp(prefix="vpnrepl-try-"))
    base.chmod(0o755)
    where = base / "try"
    script = walkthrough()
    assert SANDBOX in script
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    try:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script.replace(SANDBOX, str(where))],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        _clean_up(where, env)
        shutil.rmtree(base, ignore_errors=True)
    out = done.stdout
    assert done.returncode == 0, f"{out[-3000:]}\n{done.stderr[-3000:]}"
    assert "1000 messages published and confirmed" in out
    rows = re.findall(
        r"^orders\s+(\w+)\s+1\s+sync\s+eligible\s+connected\s+(\d+)\s+(\d+)\s", out, re.M
    )
    # the queue's declare through the listener is an event too: 1001 entries
    assert rows == [("active", "1001", "1001"), ("standby", "0", "1001")], out
    assert out.count("orders.created: 1000 replicated live") == 2
    assert 'vpnrepl_replication_lag_events{vpn="orders"} 0.0' in out
    assert out.count("vpnrepl_node_leads{") == 2 and 'vpnrepl_node_leads{site="a"' in out
    assert re.search(r"published and confirmed again \d+ s after the kill", out), out
    assert "stopped (4 servers) and removed" in out
    assert not where.exists()


def _clean_up(where: Path, env: dict[str, str]) -> None:
    """After a failure: the nodes the script started, then the sandbox."""
    for pidfile in (where / f"{node}.pid" for node in ("a1", "a2", "b1", "b2")):
        with suppress(OSError, ValueError, ProcessLookupError):
            os.kill(int(pidfile.read_text()), signal.SIGTERM)
    if (where / "sandbox.env").exists():
        subprocess.run(
            ["vpnrepl", "sandbox", "stop", str(where)], env=env, check=False, timeout=120
        )
