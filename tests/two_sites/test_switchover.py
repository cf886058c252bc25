"""A controlled switchover between two live sites, and back, under a
publishing workload: nothing confirmed is lost, nothing is doubled. There
by the CLI, back by ``POST /vpns/VPN/switchover`` (the node runs it)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from subprocess import CompletedProcess
from typing import Any
from urllib.parse import quote

from plugin.devtools import LocalSite
from tests.support.two_sites import (
    IN_SCOPE,
    VPN,
    Publisher,
    admin_call,
    assert_same_state,
    cli_status,
    queues_of,
    setup_vpn,
    until,
    vpn_status,
)
from tests.two_sites.test_failover import Sites, admin_active, broker_contents, sites  # noqa: F401


class Switchover(threading.Thread):
    def __init__(self, run: Callable[[], CompletedProcess[str]]) -> None:
        super().__init__(name="switchover", daemon=True)
        self._run = run
        self.result: CompletedProcess[str] | None = None

    def run(self) -> None:
        self.result = self._run()


def _admin(site: LocalSite, path: str, body: bytes | None = None) -> Any:
    code, text = admin_call(site.admin_port, path, "GET" if body is None else "POST", body=body)
    assert code in (200, 202), text
    return json.loads(text)


def over_http(site: LocalSite) -> CompletedProcess[str]:
    """``POST /vpns/VPN/switchover`` on ``site``'s admin endpoint, followed
    to its end through ``/requests/ID``; as a CLI run would have ended."""
    started = _admin(site, f"/vpns/{quote(VPN, safe='')}/switchover", b"{}")
    deadline = time.monotonic() + 170
    while time.monotonic() < deadline:
        got = _admin(site, started["href"])
        if got["state"] == "done":
            return CompletedProcess(["POST"], 0, "\n".join(got["result"]["lines"]), "")
        if got["state"] == "failed":
            return CompletedProcess(["POST"], 1, "", str(got["error"]))
        time.sleep(0.2)
    raise AssertionError(f"request {started['request']} still running")


def switch(run: Callable[[], CompletedProcess[str]], publisher: Publisher) -> CompletedProcess[str]:
    """Run the switchover while ``publisher`` publishes; the old active
    closes the publisher's connection (320) on the way."""
    until(lambda: len(publisher.confirmed) >= 300, "publishing under way")
    thread = Switchover(run)
    thread.start()
    thread.join(180)
    assert thread.result is not None, "switchover still running"
    publisher.join()
    return thread.result


def test_switchover_and_back_under_load_lose_and_double_nothing(
    sites: Sites,  # noqa: F811 - the fixture imported above
) -> None:
    setup_vpn(sites.a.site)
    done = sites.cli_a("vpn", "enable", VPN, "--role", "active", "--queues", r"orders\..*")
    assert done.returncode == 0, done.stderr
    sites.a.start()
    sites.b.start()
    until(lambda: vpn_status(sites.b).get("bridge") == "connected", "B to follow A")
    confirmed: set[int] = set()

    first = Publisher(sites.a.site, range(1, 100_001), window=100).start()
    over = switch(lambda: sites.cli_b("switchover", VPN), first)
    assert over.returncode == 0, over.stderr
    assert "drained to index" in over.stdout and "promoted to active at epoch 2" in over.stdout
    assert first.error is not None and "switchover to site 'b'" in first.error
    assert not first.nacked
    confirmed |= first.confirmed
    assert admin_active(sites.b.site) == 200 and admin_active(sites.a.site) == 503
    until(lambda: vpn_status(sites.a).get("bridge") == "connected", "A to follow B")

    second = Publisher(sites.b.site, range(200_001, 300_001), window=100).start()
    # and back through the admin endpoint: site A's node runs the steps
    back = switch(lambda: over_http(sites.a.site), second)
    assert back.returncode == 0, back.stderr
    assert "promoted to active at epoch 3" in back.stdout
    assert not second.nacked
    confirmed |= second.confirmed
    until(lambda: vpn_status(sites.b).get("bridge") == "connected", "B to follow A again")

    status = cli_status(sites.a)
    assert (status["role"], status["epoch"]) == ("active", 3)
    assert [(e["epoch"], e["site"]) for e in status["epochs"]][-2:] == [(2, "b"), (3, "a")]
    for queue in IN_SCOPE:
        got = broker_contents(sites.a.site, queue)
        assert len(got) == len(set(got)), f"{queue}: a message twice"
        assert got == sorted(got), f"{queue}: out of publish order"
        lost = {n for n in confirmed if queue in queues_of(n)} - set(got)
        assert not lost, f"{queue}: confirmed and lost: {sorted(lost)[:9]}"
    assert_same_state(sites.a, sites.b)
