"""Two sites under faults: unchanged pika clients on the active while nodes
are SIGKILLed, the standby stays away past the ledger retention, sync mode
times out, and the bridge runs over (mutual) TLS. Messages are numbered (see
:mod:`tests.support.two_sites`).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pika
import pika.exceptions
import psycopg
import pytest

from bridge import Published, decode_event
from plugin.devtools import LocalSite
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.fix_tls import Pki
from tests.fix_two_sites import TwoNodes
from tests.support.two_sites import (
    IN_SCOPE,
    VPN,
    ConsumerThread,
    Publisher,
    assert_same_state,
    broker_depths,
    caught_up,
    cli_status,
    consume_mixed,
    enable,
    expected_rows,
    live_caught_up,
    live_numbers,
    number,
    publish_one,
    scalar,
    setup_vpn,
    until,
    vpn_status,
)

# ---------------------------------------------------------------- 1. steady state


def test_ten_thousand_messages_and_mixed_acks_mirror_byte_for_byte(two_nodes: TwoNodes) -> None:
    site_a, _, _, node_a, node_b = two_nodes.replicating()

    publisher = Publisher(site_a, range(1, 10_001)).run()
    assert publisher.error is None and not publisher.nacked
    assert len(publisher.confirmed) == 10_000
    # 40% of each in-scope queue leaves it, through the mix of settlements.
    q1 = consume_mixed(site_a, "orders.q1", remove=3_200)
    q2 = consume_mixed(site_a, "orders.q2", remove=4_000)
    assert q1.requeued and q1.redelivered and q2.requeued

    expected = expected_rows(range(1, 10_001))
    expected -= {(n, "orders.q1") for n in q1.removed}
    expected -= {(n, "orders.q2") for n in q2.removed}
    rows = assert_same_state(node_a, node_b)
    assert {(number(bytes(r[6])), r[0]) for r in rows} == expected
    counts = {q: sum(1 for _, qq in expected if qq == q) for q in IN_SCOPE}
    assert counts == {"orders.q1": 8_000 - len(q1.removed), "orders.q2": 10_000 - len(q2.removed)}
    assert vpn_status(node_a)["queues"] == vpn_status(node_b)["queues"] == counts
    assert broker_depths(site_a) == counts  # the replicated state is the broker's
    assert node_b.stop() == 0 and node_a.stop() == 0


# ---------------------------------------------------------------- 2. standby killed


def test_standby_killed_mid_stream_resyncs_from_its_applied_index(two_nodes: TwoNodes) -> None:
    site_a, site_b, _, node_a, node_b = two_nodes.replicating()

    # Mid-stream whatever the load: the publisher stops at 4,000 until B is
    # killed (it cannot finish first), and publishes the rest while B is down.
    publisher = Publisher(site_a, range(1, 8_001), window=100, hold_at=4_000).start()
    consumer = ConsumerThread(site_a, "orders.q1", remove=2_500)
    consumer.start()
    until(lambda: vpn_status(node_b).get("applied_index", 0) >= 2_000, "B applying the stream")
    node_b.kill()
    assert not publisher.finished and publisher.settled <= 4_000
    killed_at = scalar(site_b, "SELECT applied_index FROM vpn_state WHERE vpn = %s", VPN)
    publisher.release()
    until(
        lambda: vpn_status(node_a)["ledger_index"] >= killed_at + 1_000,
        "A's ledger to move on while B is down",
    )
    node_b.start()
    publisher.join()
    removed = consumer.finish().removed
    assert publisher.error is None and len(publisher.confirmed) == 8_000

    rows = assert_same_state(node_a, node_b)
    expected = expected_rows(range(1, 8_001)) - {(n, "orders.q1") for n in removed}
    assert {(number(bytes(r[6])), r[0]) for r in rows} == expected
    # It resumed from its own applied index: a replay, no checkpoint.
    assert f"sync requested from index {killed_at + 1}\n" in node_b.log_text()
    assert f"from index {killed_at + 1}\n" in node_a.log_text()
    assert "checkpoint" not in node_a.log_text() + node_b.log_text()
    assert node_b.stop() == 0 and node_a.stop() == 0


# ---------------------------------------------------------------- 3. active killed


@pytest.mark.fault  # the fault suite's smoke run kills the active in sync mode by default
def test_active_killed_mid_stream_in_sync_mode_loses_nothing_confirmed(two_nodes: TwoNodes) -> None:
    site_a, site_b, _, node_a, node_b = two_nodes.replicating(
        "--mode", "sync", "--sync-timeout-ms", "30000", "--on-sync-timeout", "reject"
    )
    until(lambda: vpn_status(node_b).get("bridge") == "connected", "B connected")

    publisher = Publisher(site_a, range(1, 30_001), window=200).start()
    until(lambda: len(publisher.confirmed) >= 2_000, "2,000 confirms")
    node_a.kill()
    publisher.join()
    assert publisher.error is not None and "connection lost" in publisher.error
    confirmed = set(publisher.confirmed)
    assert 2_000 <= len(confirmed) < 30_000 and not publisher.nacked

    # Before A comes back: every confirmed message is on B, in each of its queues.
    on_b = live_numbers(site_b)
    missing = expected_rows(confirmed) - on_b
    assert not missing, f"{len(missing)} confirmed (message, queue) not on B: {sorted(missing)[:5]}"
    assert vpn_status(node_b)["unknown_acks"] == 0

    node_a.start()
    rows = assert_same_state(node_a, node_b)
    assert expected_rows(confirmed) <= {(number(bytes(r[6])), r[0]) for r in rows}
    assert node_b.stop() == 0 and node_a.stop() == 0


# ---------------------------------------------------------------- 4. retention


def test_standby_down_past_the_retention_gets_a_checkpoint(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
) -> None:
    setup_vpn(site_a)
    with open(vpnrepl_a.config, "a") as f:
        f.write("\n[replication]\nledger_retain_seconds = 0\n")
    enable(vpnrepl_a)
    node_a.start()
    node_b.start()
    oldest = "SELECT min(idx) FROM ledger WHERE vpn = 'orders'"

    assert Publisher(site_a, range(1, 2_001)).run().error is None
    removed = consume_mixed(site_a, "orders.q1", remove=500).removed
    assert_same_state(node_a, node_b)
    # With no retention the node prunes all it acknowledged, but for the last
    # acknowledged entry (the standby proves with it that it follows).
    last = vpn_status(node_a)["ledger_index"]
    until(lambda: scalar(site_a, oldest) == last, "A to prune the acknowledged ledger")

    node_b.kill()
    b_at = scalar(site_b, "SELECT applied_index FROM vpn_state WHERE vpn = %s", VPN)
    assert Publisher(site_a, range(2_001, 5_001)).run().error is None
    removed |= consume_mixed(site_a, "orders.q1", remove=500).removed
    # The node only prunes what the standby acknowledged, so one standby is
    # never really behind the retained ledger ...
    assert scalar(site_a, oldest) <= b_at
    # ... so simulate what a retention shorter than the outage would do (as
    # with a second standby acknowledging): drop the ledger prefix B has not
    # received, straight in A's database.
    live_caught_up(site_a)  # a checkpoint reflects the live state: keep what it lacks
    cut = vpn_status(node_a)["ledger_index"] - 100
    with psycopg.connect(site_a.pg.dsn(), autocommit=True) as db:
        pruned = db.execute("DELETE FROM ledger WHERE vpn = %s AND idx <= %s", (VPN, cut))
        assert pruned.rowcount > cut - b_at
    # B comes back while publishes go on: a checkpoint, then replay and live.
    publisher = Publisher(site_a, range(5_001, 8_001), window=100).start()
    node_b.start()
    assert publisher.join().error is None
    rows = assert_same_state(node_a, node_b)
    expected = expected_rows(range(1, 8_001)) - {(n, "orders.q1") for n in removed}
    assert {(number(bytes(r[6])), r[0]) for r in rows} == expected
    installed = [
        line for line in node_b.log_text().splitlines() if "installed a checkpoint" in line
    ]
    assert len(installed) == 1, installed
    at = int(installed[0].rsplit(" ", 1)[1])
    assert at >= cut
    assert "a checkpoint of" in node_a.log_text()

    # A standby that lost its state altogether (a new site B) is also behind
    # what the node itself pruned: it gets a checkpoint of the real thing.
    node_b.kill()
    site_b.rabbit.reset()
    site_b.pg.reset()
    assert Vpnrepl(node_b.config)("init").returncode == 0
    node_b.start()
    assert assert_same_state(node_a, node_b) == rows
    installed = [
        line for line in node_b.log_text().splitlines() if "installed a checkpoint" in line
    ]
    assert len(installed) == 2, installed
    assert node_b.stop() == 0 and node_a.stop() == 0


# ---------------------------------------------------------------- 5. sync timeouts


@pytest.mark.parametrize("policy", ["degrade", "reject"])
def test_sync_mode_with_the_standby_stopped(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
    policy: str,
) -> None:
    timeout_ms = 1500
    setup_vpn(site_a)
    enable(
        vpnrepl_a,
        "--mode",
        "sync",
        "--sync-timeout-ms",
        str(timeout_ms),
        "--on-sync-timeout",
        policy,
    )
    node_a.start()
    node_b.start()
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "B connected")
    publish_one(site_a, 1)
    assert (1, "orders.q1") in live_numbers(site_b)  # confirmed: the standby has it
    assert vpn_status(node_a)["sync_eligible"] is True

    assert node_b.stop() == 0
    until(lambda: vpn_status(node_a)["bridge"] == "disconnected", "A to see B gone")
    cli_while_down: dict[str, Any] = {}
    if policy == "degrade":
        # The first confirm waits out the timeout, then the VPN is degraded
        # and confirms go out once the message is durable on A alone.
        assert publish_one(site_a, 2) >= 0.9 * timeout_ms / 1000
        assert vpn_status(node_a)["sync_eligible"] is False
        for n in range(3, 8):
            publish_one(site_a, n)
        assert vpn_status(node_a)["sync_eligible"] is False
        # the node records eligibility in vpn_state every 0.5 s; the
        # publishes above may all have been confirmed within that
        cli_while_down = until(
            lambda: (found := cli_status(node_a))["sync_eligible"] is False and found,
            "vpnrepl status to show the VPN sync-ineligible",
            5,
        )
    else:
        for n in (2, 3):
            t0 = time.monotonic()
            with pytest.raises(pika.exceptions.NackError):
                publish_one(site_a, n)
            assert time.monotonic() - t0 >= 0.9 * timeout_ms / 1000
        assert vpn_status(node_a)["sync_eligible"] is True  # reject never degrades

    node_b.start()
    caught_up(node_a, node_b)
    until(lambda: vpn_status(node_a)["sync_eligible"] is True, "A sync-eligible again")
    publish_one(site_a, 8)  # confirmed again, through the standby
    assert (8, "orders.q1") in live_numbers(site_b)
    assert_same_state(node_a, node_b)
    if policy == "degrade":
        # `vpnrepl status --json` is the admin's view of the same VPN.
        assert cli_while_down["sync_eligible"] is False, (
            "vpnrepl status --json said sync_eligible=true while the node's /status said false"
        )
    assert node_b.stop() == 0 and node_a.stop() == 0


def test_sync_mode_does_not_degrade_while_the_standby_keeps_up(two_nodes: TwoNodes) -> None:
    """A publish stream that lasts longer than the sync timeout, with the
    standby up and acknowledging: no confirm may be released by the timeout
    policy (it would be a confirm the standby does not have yet)."""
    timeout_ms = 2000
    site_a, _, _, node_a, node_b = two_nodes.replicating(
        "--mode", "sync", "--sync-timeout-ms", str(timeout_ms)
    )
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "B connected")
    publisher = Publisher(site_a, range(1, 100_001), window=50).start()
    t0 = time.monotonic()
    until(lambda: time.monotonic() - t0 > 2.5 * timeout_ms / 1000, "a stream of 2.5 timeouts")
    publisher.stop()
    assert publisher.join().error is None and not publisher.nacked
    assert len(publisher.confirmed) > 1_000
    degraded = [x for x in node_a.log_text().splitlines() if "confirming without it" in x]
    assert not degraded, f"the VPN degraded with the standby up:\n{degraded[0]}"
    assert vpn_status(node_a)["sync_eligible"] is True
    assert_same_state(node_a, node_b)
    assert node_b.stop() == 0 and node_a.stop() == 0


def _ledger_index_of(site: LocalSite) -> dict[int, int]:
    """Each number's ledger index on ``site`` (its publish's entry)."""
    with psycopg.connect(site.pg.dsn()) as db:
        rows = db.execute(
            "SELECT idx, event FROM ledger WHERE vpn = %s AND kind = 'published'", (VPN,)
        ).fetchall()
    out: dict[int, int] = {}
    for idx, data in rows:
        event = decode_event(bytes(data), VPN)
        assert isinstance(event, Published)
        out[number(event.body)] = int(idx)
    return out


#: a VPN's windows as ranges, one a crash left open ending at the ledger index
WINDOWS = """
SELECT w.first_index, COALESCE(w.last_index, s.ledger_index), w.last_index IS NULL
FROM sync_window w JOIN vpn_state s ON s.vpn = w.vpn
WHERE w.vpn = %s ORDER BY w.epoch, w.first_index
"""


def _windows(site: LocalSite) -> list[tuple[int, int, bool]]:
    with psycopg.connect(site.pg.dsn()) as db:
        return [(int(f), int(la), bool(o)) for f, la, o in db.execute(WINDOWS, (VPN,))]


def test_a_frozen_standby_under_degrade_leaves_every_confirm_without_it_in_a_window(
    two_nodes: TwoNodes,
) -> None:
    """The standby's node frozen (SIGSTOP) past the sync timeout under
    ``degrade`` while a publisher streams, then the active killed: every
    publish confirmed above what the standby had acknowledged lies in the
    window recorded before its confirm, which starts exactly at the lowest
    of them; the next start closes the window at the ledger index; the
    standby thawed catches up and nothing new is windowed."""
    site_a, _, _, node_a, node_b = two_nodes.replicating(
        "--mode", "sync", "--sync-timeout-ms", "500", "--on-sync-timeout", "degrade"
    )
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "B connected")
    publisher = Publisher(site_a, range(1, 200_001), window=50).start()
    until(lambda: len(publisher.confirmed) >= 500, "500 publishes confirmed through B")
    assert node_b.pid is not None
    os.kill(node_b.pid, signal.SIGSTOP)
    try:
        behind = len(publisher.confirmed)
        until(lambda: vpn_status(node_a)["sync_eligible"] is False, "A sync-ineligible")
        until(lambda: len(publisher.confirmed) >= behind + 2000, "A to confirm without B")
        # A records B's acknowledgements coalesced, at most a second late
        applied = "SELECT applied_index FROM vpn_state WHERE vpn = %s"
        acked = scalar(site_a, applied, VPN)
        time.sleep(1.5)
        assert scalar(site_a, applied, VPN) == acked > 0  # B is frozen: no more
        node_a.kill()  # mid-stream, the window still open
        publisher.join()
        confirmed = set(publisher.confirmed)
        assert not publisher.nacked
        ledger = scalar(site_a, "SELECT ledger_index FROM vpn_state WHERE vpn = %s", VPN)
        index_of = _ledger_index_of(site_a)
        without = sorted(index_of[n] for n in confirmed if index_of[n] > acked)
        assert len(without) >= 2000
        assert _windows(site_a) == [(without[0], ledger, True)]  # open: the crash's
        first = without[0]
        outside = [i for i in without if not first <= i <= ledger]
        assert outside == [], f"confirmed without the standby, in no window: {outside[:10]}"

        node_a.start()  # the restart rule: closed where the ledger ended
        assert _windows(site_a) == [(first, ledger, False)]
    finally:
        os.kill(node_b.pid, signal.SIGCONT)
    caught_up(node_a, node_b)
    until(lambda: vpn_status(node_a)["sync_eligible"] is True, "A sync-eligible")
    publish_one(site_a, 200_001)  # confirmed through the standby: no new window
    status = cli_status(node_a)
    assert status["sync_windows_total"] == 1
    assert [(w["first_index"], w["last_index"]) for w in status["sync_windows"]] == [
        (first, ledger)
    ]
    assert node_b.stop() == 0 and node_a.stop() == 0


# ---------------------------------------------------------------- 6. TLS


def _with_tls(node: NodeProcess, tls: str) -> None:
    """The node's ``[tls]`` section (the harness's, last in the file) replaced."""
    text = node.config.read_text()
    node.config.write_text(text[: text.index("\n[tls]")] + tls)


STALLED = ("no answer within", "SSL handshake is taking longer")


def assert_no_stalled_handshake(a: NodeProcess, b: NodeProcess) -> None:
    """On loopback a TLS handshake completes or fails at once; one that sits
    until a side's 10 s timeout is a bug, whatever the retry does later."""
    stalled = [
        line
        for line in (a.log_text() + b.log_text()).splitlines()
        if any(s in line for s in STALLED)
    ]
    assert not stalled, "bridge TLS handshakes stalled until a timeout:\n" + "\n".join(stalled)


def test_replication_over_tls_with_certificates_of_another_pki(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
    pki: Pki,
) -> None:
    """Mutual TLS with certificates openssl made (not ``vpnrepl tls
    init``'s): any CA works when the certificates name the sites."""
    setup_vpn(site_a)
    enable(vpnrepl_a)
    _with_tls(node_a, pki.section("a", "ca"))
    _with_tls(node_b, pki.section("b", "ca"))  # B verifies A against the private CA
    node_a.start()
    node_b.start()
    until(
        lambda: (
            vpn_status(node_b).get("bridge") == "connected"
            or any(s in node_b.log_text() for s in STALLED)
        ),
        "the bridge link over TLS",
    )
    assert_no_stalled_handshake(node_a, node_b)
    assert Publisher(site_a, range(1, 1_001)).run().error is None
    removed = consume_mixed(site_a, "orders.q2", remove=300).removed
    rows = assert_same_state(node_a, node_b)
    expected = expected_rows(range(1, 1_001)) - {(n, "orders.q2") for n in removed}
    assert {(number(bytes(r[6])), r[0]) for r in rows} == expected
    assert "(mutual TLS)\n" in node_a.log_text()
    assert node_b.stop() == 0 and node_a.stop() == 0


def test_a_standby_certificate_from_another_ca_is_refused(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
    pki: Pki,
) -> None:
    setup_vpn(site_a)
    enable(vpnrepl_a)
    _with_tls(node_a, pki.section("a", "ca"))
    _with_tls(node_b, pki.section("rogue", "ca"))
    node_a.start()
    node_b.start()
    assert Publisher(site_a, range(1, 101)).run().error is None
    peer = f"127.0.0.1:{site_a.bridge_port}"

    def refusals() -> tuple[list[str], list[str]]:
        return (
            [x for x in node_a.log_text().splitlines() if "standby at 127.0.0.1:" in x],
            [x for x in node_b.log_text().splitlines() if f"bridge to {peer}: " in x],
        )

    until(lambda: min(map(len, refusals())) >= 2, "two refused attempts in both logs")
    assert_no_stalled_handshake(node_a, node_b)
    on_a, on_b = refusals()
    for line in on_a[:2]:
        assert "bridge: refused standby at 127.0.0.1:" in line
        assert "TLS handshake failed: certificate verify failed" in line
        assert f"(the standby's certificate is not signed by {pki.dir / 'ca.crt'})" in line
    for line in on_b[:2]:
        assert "refused this site's certificate" in line and "; retrying in" in line
    # Nothing replicated: B never even learnt of the VPN.
    assert vpn_status(node_b) == {}
    assert scalar(site_b, "SELECT count(*) FROM live_message") == 0
    assert vpn_status(node_a)["bridge"] == "disconnected"
    assert vpn_status(node_a)["applied_index"] == 0
    assert node_b.stop() == 0 and node_a.stop() == 0
