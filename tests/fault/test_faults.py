"""The fault suite: a workload under every nemesis, checked (``tests/fault/chaos.py``,
``tests/fault/checker.py``).

The smoke run (one nemesis, short) is in the default suite; every nemesis
in every mode and policy runs with ``./run test -m fault``. Each run writes its report
(``VPNREPL_FAULT_REPORTS=DIR`` keeps them).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.fault import chaos
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess

#: aiormq leaves a close coroutine of a connection the fault broke to the
#: garbage collector; it is the client library's, and says nothing of ours
AIO_CLOSE = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <coroutine object Connection.close"
    ":pytest.PytestUnraisableExceptionWarning"
)


@AIO_CLOSE
def test_smoke_a_killed_active_node_loses_nothing_confirmed(
    node_a: NodeProcess, node_b: NodeProcess, vpnrepl_a: Vpnrepl, tmp_path: Path
) -> None:
    with chaos.run(node_a, node_b, vpnrepl_a, "sync", tmp_path) as r:
        r.setup()
        r.start_workload()
        r.wait_confirmed(300)
        r.apply(chaos.kill_node("a"))
        r.wait_confirmed(300)  # the clients found the site again
        r.stop_workload()
        broken = r.report(r.drain(), "smoke-kill-node-a")
    assert broken == {}
    assert r.recorder.errors, "the fault cut no client off: it tested nothing"
    assert any(t.outcome == "committed" for t in r.history.txns)
    assert r.history.acked


def one_run(
    sites: tuple[NodeProcess, NodeProcess, Vpnrepl],
    tmp: Path,
    mode: str,
    policy: str,
    faults: chaos.Nemesis | list[chaos.Scheduled],
    name: str,
    declare: bool = False,
    replication: dict[str, int] | None = None,
) -> chaos.Run:
    """The workload, 300 confirms, the faults (one nemesis, or a random
    schedule) applied and healed, 300 more (the clients found the active
    site), drained and checked."""
    nemeses = [f.nemesis for f in faults] if isinstance(faults, list) else [faults]
    clocks = any(n.clocks for n in nemeses)
    with chaos.run(*sites, mode, tmp, policy, replication=replication, clocks=clocks) as r:
        r.setup()
        r.start_workload(declare=declare)
        r.wait_confirmed(300)
        if isinstance(faults, list):
            r.apply_schedule(faults)
        else:
            r.apply(faults)
        r.wait_confirmed(300, timeout=120)
        r.stop_workload()
        r.broken = r.report(r.drain(), f"{mode}-{policy}-{name}")
    return r


def disaster_run(
    node_a: NodeProcess, node_b: NodeProcess, vpnrepl_a: Vpnrepl, tmp: Path, mode: str, policy: str
) -> chaos.Run:
    """Site A lost for good under load (node, RabbitMQ and PostgreSQL killed
    together), B promoted, A never back; checked against B alone, while A's
    broker and node are still down. Under degrade the standby lags past the
    sync timeout: what A confirms without it is in a recorded window, and
    only that may be lost."""
    lag = 2 * chaos.SYNC_TIMEOUT if policy == "degrade" else chaos.DISASTER_LAG
    sites = (node_a, node_b, vpnrepl_a)
    r = one_run(sites, tmp, mode, policy, chaos.disaster(lag), "disaster", declare=True)
    assert not node_a.alive() and not node_a.site.rabbit.alive()
    return r


@AIO_CLOSE
def test_disaster_site_a_lost_for_good_loses_nothing_confirmed_in_sync(
    node_a: NodeProcess, node_b: NodeProcess, vpnrepl_a: Vpnrepl, tmp_path: Path
) -> None:
    r = disaster_run(node_a, node_b, vpnrepl_a, tmp_path, "sync", "reject")
    assert r.broken == {}
    assert r.history.old_active is not None and r.history.old_active.index_of
    assert r.declarer is not None and len(r.declarer.declared) >= 2, "no queue declared under load"


@AIO_CLOSE
@pytest.mark.fault
@pytest.mark.parametrize(
    ("mode", "policy"), [("sync", "reject"), ("sync", "degrade"), ("async", "reject")]
)
def test_disaster_in_every_mode(
    node_a: NodeProcess,
    node_b: NodeProcess,
    vpnrepl_a: Vpnrepl,
    tmp_path: Path,
    mode: str,
    policy: str,
) -> None:
    assert disaster_run(node_a, node_b, vpnrepl_a, tmp_path, mode, policy).broken == {}


def split_brain_run(
    node_a: NodeProcess, node_b: NodeProcess, vpnrepl_a: Vpnrepl, tmp: Path, mode: str, policy: str
) -> chaos.Run:
    """The bridge cut both ways, B promoted with ``--force`` while A still
    serves, clients on both sites for the hold; healed: A fenced, demoted
    (its tail exported), the tail republished on B; checked on both sites."""
    return one_run(
        (node_a, node_b, vpnrepl_a), tmp, mode, policy, chaos.split_brain(), "split-brain"
    )


@AIO_CLOSE
def test_split_brain_in_async_loses_nothing_once_the_tail_is_republished(
    node_a: NodeProcess, node_b: NodeProcess, vpnrepl_a: Vpnrepl, tmp_path: Path
) -> None:
    r = split_brain_run(node_a, node_b, vpnrepl_a, tmp_path, "async", "reject")
    assert r.broken == {}
    assert r.history.exported_tail, "the old active confirmed nothing during the split"
    assert r.split_brain_seen, "the old active did not say SPLIT-BRAIN"
    assert r.history.republished


@AIO_CLOSE
@pytest.mark.fault
@pytest.mark.parametrize(("mode", "policy"), [("sync", "reject"), ("sync", "degrade")])
def test_split_brain_in_sync(
    node_a: NodeProcess,
    node_b: NodeProcess,
    vpnrepl_a: Vpnrepl,
    tmp_path: Path,
    mode: str,
    policy: str,
) -> None:
    r = split_brain_run(node_a, node_b, vpnrepl_a, tmp_path, mode, policy)
    assert r.broken == {}
    if policy == "reject":
        # what the old active itself confirmed (a number in its tail may have
        # been confirmed by B to the client's retry)
        confirmed = {
            n
            for n, p in r.history.published.items()
            if p.outcome == "confirmed" and p.answered_by == "a"
        }
        assert not (r.history.exported_tail or frozenset()) & confirmed


#: every mode and sync-timeout policy a run can be in
MODES = (("sync", "reject"), ("sync", "degrade"), ("async", "reject"))


@AIO_CLOSE
@pytest.mark.fault
@pytest.mark.parametrize("nemesis", sorted(set(chaos.NEMESES) - {"disaster", "split-brain"}))
@pytest.mark.parametrize(("mode", "policy"), MODES)
def test_a_nemesis_breaks_no_promise(
    node_a: NodeProcess,
    node_b: NodeProcess,
    vpnrepl_a: Vpnrepl,
    tmp_path: Path,
    nemesis: str,
    mode: str,
    policy: str,
) -> None:
    # a long partition outlasts the ledger's retention and its bound
    replication = SMALL_LEDGER if nemesis.endswith("30s") else None
    sites = (node_a, node_b, vpnrepl_a)
    faults = chaos.NEMESES[nemesis]()
    try:
        r = one_run(sites, tmp_path, mode, policy, faults, nemesis, replication=replication)
    except chaos.MountRefused as e:
        pytest.skip(f"this machine cannot build a full disk: {e}")
    assert r.broken == {}
    if nemesis == "concurrent-promotions":
        assert r.epochs_raised == 1, "two promotions at once raised the epoch twice"
    if ("blackhole" in nemesis and not nemesis.startswith("client")) or faults.clocks:
        # liveness: a half-open link of ours leaves no client without an
        # answer (confirm, nack, error) longer than the sync timeout and a
        # bound: a transaction's commit too, while the site's own PostgreSQL
        # hangs (its prepare is refused after PREPARE_BOUND_SECONDS)
        silent = {
            who: t
            for silences in r.silences.values()
            for who, t in silences.items()
            if t > chaos.SYNC_TIMEOUT + LIVENESS_BOUND
        }
        assert not silent, f"clients without an answer for seconds: {silent}"


#: a ledger a 30-second partition outlasts: 10 s retention, a 100 kB bound
SMALL_LEDGER = {"ledger_retain_seconds": 10, "ledger_max_bytes": 100_000, "ledger_check_seconds": 2}
#: beyond the sync timeout, how long a client may wait for an answer while
#: one of our links is black-holed
LIVENESS_BOUND = 10.0


@AIO_CLOSE
@pytest.mark.fault
def test_a_random_schedule_breaks_no_promise(
    node_a: NodeProcess, node_b: NodeProcess, vpnrepl_a: Vpnrepl, tmp_path: Path, seed: int
) -> None:
    """``--seeds``: per seed, three faults of random kind, target, overlap
    and hold (``chaos.schedule``), in the mode and policy the seed picks.
    No promotion happens, so nothing may be lost in any mode; every other
    allowance (a retry's duplicate, an ack in flight) is the checker's,
    tied to the faults the schedule holds. The report names the seed."""
    mode, policy = MODES[seed % len(MODES)]
    faults = chaos.schedule(seed)
    sites = (node_a, node_b, vpnrepl_a)
    r = one_run(sites, tmp_path, mode, policy, faults, f"seed-{seed}", declare=True)
    assert r.broken == {}, f"seed {seed}: {[(s.at, s.nemesis.name) for s in faults]}"


def _rss_kib(pid: int | None) -> int:
    if pid is None:
        return 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


#: faults the soak cycles through (each heals itself within the minute)
SOAK_FAULTS = (
    "kill-node-b",
    "pause-pg-a",
    "bridge-cut",
    "kill-rabbit-a",
    "pause-node-a",
    "bridge-delay",
    "kill-pg-b",
    "kill-node-a",
)


@AIO_CLOSE
@pytest.mark.fault
def test_soak_mixed_load_with_a_fault_every_minute(
    node_a: NodeProcess, node_b: NodeProcess, vpnrepl_a: Vpnrepl, tmp_path: Path
) -> None:
    """``VPNREPL_SOAK_MINUTES`` (30) of the workload with a fault a minute:
    nothing broken, and both nodes' RSS and the ledger stay bounded."""
    from tests.support.two_sites import scalar

    minutes = int(os.environ.get("VPNREPL_SOAK_MINUTES", "30"))
    samples: list[tuple[float, int, int, int]] = []  # (t, rss a, rss b, ledger rows)
    with chaos.run(node_a, node_b, vpnrepl_a, "sync", tmp_path) as r:
        r.setup()
        # paced: orders.q2 keeps every publish, and the final check reads it
        r.start_workload(pace=0.05)
        start = time.monotonic()
        for minute in range(minutes):
            r.apply(chaos.NEMESES[SOAK_FAULTS[minute % len(SOAK_FAULTS)]]())
            while time.monotonic() < start + 60 * (minute + 1):
                time.sleep(5)
                rows = scalar(r.active_node().site, "SELECT count(*) FROM ledger") or 0
                samples.append((r.recorder.now(), _rss_kib(node_a.pid), _rss_kib(node_b.pid), rows))
        r.stop_workload()
        broken = r.report(r.drain(), "soak")
    out = Path(os.environ.get("VPNREPL_FAULT_REPORTS", str(tmp_path)))
    (out / "soak-resources.json").write_text(json.dumps(samples))
    chaos.plot_resources(samples, r.faults, out / "soak-resources.png", "soak: RSS and ledger")
    assert broken == {}
    # after the first quarter (warm caches), memory and the ledger stay level
    settled = [s for s in samples if s[0] > 60 * minutes / 4]
    for i, name in ((1, "node a"), (2, "node b")):
        first, peak = settled[0][i], max(s[i] for s in settled)
        assert peak < 1.5 * first + 50_000, f"{name} RSS grew from {first} to {peak} KiB"
    # the ledger holds about ledger_retain_seconds of events: level, not growing
    half = len(settled) // 2
    early, late = max(s[3] for s in settled[:half]), max(s[3] for s in settled[half:])
    assert late < 1.5 * early + 10_000, f"the ledger grew from {early} to {late} rows"
