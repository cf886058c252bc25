"""The status page at ``/`` on the admin endpoint, rendered by a real
headless Chromium (Debian's ``chromium``, installed by ``./run``) against a
running two-site harness: the active site's VPN, its peer's bridge state and
applied index, the lag chart, per-queue live counts against the broker's.

The screenshot goes to ``$VPNREPL_SCREENSHOT_DIR`` when that is set (else
the test's temporary directory)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import psycopg

from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.two_sites import (
    VPN,
    Publisher,
    assert_same_state,
    enable,
    setup_vpn,
    until,
    vpn_status,
)


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "Debian's chromium is not installed: `./run test` installs it"
    return found


def _browse(url: str, profile: Path, *args: str) -> str:
    done = subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",  # root in a container has no user namespace for it
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=8000",  # the page's scripts fetch and render
            *args,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class _Fields(HTMLParser):
    """``data-field`` cells (per VPN card, per queue row) of the rendered DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.vpn = ""
        self.queue = ""
        self.fields: dict[tuple[str, str, str], str] = {}
        self.attrs: dict[tuple[str, str, str], dict[str, str]] = {}
        self._open: tuple[str, str, str] | None = None
        self.site = ""
        self._site = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "data-vpn" in a:
            self.vpn, self.queue = a["data-vpn"], ""
        if "data-queue" in a:
            self.queue = a["data-queue"]
        if a.get("id") == "site":
            self._site = True
        if "data-field" in a:
            key = (self.vpn, self.queue, a["data-field"])
            self._open, self.fields[key], self.attrs[key] = key, "", a

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "svg"):
            self._open = None
        if tag == "span":
            self._site = False

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self.fields[self._open] += data
        if self._site:
            self.site += data


def test_the_status_page_shows_the_sites_vpn_bridge_and_applied_index(
    vpnrepl_a: Vpnrepl, node_a: NodeProcess, node_b: NodeProcess, tmp_path: Path
) -> None:
    setup_vpn(node_a.site)
    enable(vpnrepl_a, "--mode", "sync")
    node_a.start()
    node_b.start()
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "the bridge to connect")
    published = Publisher(node_a.site, range(1, 301)).run()
    assert published.error is None and len(published.confirmed) == 300
    assert_same_state(node_a, node_b)
    # a few lag samples for the chart (one every 2 s)
    until(lambda: len(_history(node_a)) >= 3, "three lag samples", 30)
    status = vpn_status(node_a)
    url = f"http://127.0.0.1:{node_a.site.admin_port}/"

    dom = _browse(url, tmp_path / "profile", "--dump-dom")
    assert 'data-loaded="yes"' in dom, dom[:2000]
    page = _Fields()
    page.feed(dom)
    assert page.site == "a"
    f = page.fields
    assert f[(VPN, "", "role")] == "active"
    assert f[(VPN, "", "epoch")] == str(status["epoch"])
    assert f[(VPN, "", "mode")].startswith("sync (timeout ")
    assert f[(VPN, "", "sync_eligible")] == "yes"
    assert f[(VPN, "", "bridge")] == "connected"  # its peer, the standby
    assert f[(VPN, "", "applied_index")] == str(status["applied_index"]) != "0"
    assert f[(VPN, "", "ledger_index")] == str(status["ledger_index"])
    assert f[(VPN, "", "lag")] == "0 events, 0 s"
    assert f[(VPN, "", "in_doubt_txns")] == "0"
    assert f[(VPN, "", "reconcile")] == "never"

    # a reconcile run that left differences is on the page at its next refresh
    with psycopg.connect(node_a.site.pg.dsn(), autocommit=True) as db:
        db.execute(
            "INSERT INTO reconcile_run (vpn, started_at, outcome, method, missing_on_standby,"
            " differs) VALUES (%s, now(), 'differ', 'pushdown', 2, 1)",
            (VPN,),
        )
    page = _Fields()
    page.feed(_browse(url, tmp_path / "profile", "--dump-dom"))
    assert page.fields[(VPN, "", "reconcile")].startswith("3 differences")
    assert int(page.attrs[(VPN, "", "lag_chart")]["data-points"]) >= 3
    for queue, n in status["queues"].items():
        assert f[(VPN, queue, "live")] == str(n)
        assert re.fullmatch(r"\d+", f[(VPN, queue, "broker")])  # stats lag: a number
    assert f[(VPN, "orders.q1", "live")] == "240"  # every fifth goes to q2 only

    shots = Path(os.environ.get("VPNREPL_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    shot = shots / "status-page.png"
    shot.unlink(missing_ok=True)
    _browse(url, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1100,900")
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:4] == b"\x89PNG"


def _history(node: NodeProcess) -> list[list[float]]:
    import json

    samples: list[list[float]] = json.loads(node.get("/status/history"))["vpns"].get(VPN, [])
    return samples
