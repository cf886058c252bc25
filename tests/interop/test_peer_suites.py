"""Peer AMQP clients' own test suites, directly and through the listener.

aiormq and aio-pika ship their tests in their sdists (pika does not). Each
suite, pinned in ``SUITES``, is downloaded once with pip into a cache beside
the virtualenv (``<venv>/peer-suites``; its code is never copied into this
repository) and run by a pytest of its own, twice at the same time:

- directly against a RabbitMQ of the harness that also serves AMQPS (the
  suites test TLS too; the sites' own nodes serve plain AMQP only), and
- through a real ``vpnrepl node`` (AMQP and AMQPS) in front of site A's
  RabbitMQ, where every vhost the suite uses is an active VPN (async, every
  queue in scope).

``tests/interop/peer/peer_broker.py`` points the suites' Docker broker fixtures at
those. Every test must end the same way in both runs.

aiormq's suite publishes nothing persistent: it checks that the listener
passes a client's traffic through unchanged. aio-pika's publishes persistent
messages (``test_amqp``, the ``Master`` pattern), so it also exercises the
replicated path: ids spliced in and cut out again, confirms held until the
ledger has the message.

The default run takes a chosen set of modules; the whole suites run under
``-m fault``. Tests that neither the harness nor the listener can serve are
excluded (in both runs), each with its reason; tests that fail against
RabbitMQ directly are listed in ``fails_directly``, and that list is kept
exact: a listed test that passes, or a failing one not listed, fails here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatch
from importlib.metadata import version
from pathlib import Path

import pytest

from plugin.devtools import LocalSite, LocalSites, RabbitNode, free_port
from sql import migrate
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.fix_tls import Pki
from tests.support.prometheus import value

PLUGIN_DIR = Path(__file__).with_name("peer")
CACHE = Path(sys.prefix) / "peer-suites"
FAILING = ("failed", "error")
WHOLE = ("tests",)
MAX_SHOWN = 30


@dataclass(frozen=True, slots=True)
class PeerSuite:
    """One client's suite: which sdist, what the default run takes, and why
    some tests are not compared."""

    dist: str
    version: str
    #: pytest arguments of the default run (modules, deselections)
    default: tuple[str, ...]
    #: node-id pattern (fnmatch) -> why neither run can serve those tests
    exclude: Mapping[str, str]
    #: whether the suite publishes persistent messages (the replicated path)
    replicates: bool
    #: node id -> why it fails against the harness's RabbitMQ directly too
    fails_directly: Mapping[str, str] = field(default_factory=dict)


SUITES = (
    PeerSuite(
        dist="aiormq",
        version="7.2.4",
        default=(
            "tests/test_connection.py",
            "tests/test_channel.py",
            "tests/test_channel_number.py",
            "tests/test_consumer_publish.py",
            "tests/test_publish_cancel.py",
            "tests/test_consumer_cancel.py",
            "tests/test_delivery_error.py",
            "tests/test_late_confirms.py",
            "tests/test_nowait.py",
            # the same tests again with a connection name in the client
            # properties, and over TLS (with and without a client certificate)
            "-k",
            "not amqp-named and not amqps",
            # heartbeat timeouts and close-timing stairways: 100 s of sleeping
            "--deselect=tests/test_connection.py::test_closing_waiter_cancelled_before_connection_loss",
            "--deselect=tests/test_connection.py::test_connection_close_stairway",
            "--deselect=tests/test_connection.py::test_connection_stuck",
            "--deselect=tests/test_connection.py::test_writer_closed_on_connection_loss",
        ),
        exclude={},
        replicates=False,
    ),
    PeerSuite(
        dist="aio-pika",
        version="10.2.1",
        default=(
            # connection, channel, publish/confirm/return, consume/ack, tx, DLX
            # (RPC, Master/Worker and type tests run in the whole suite, -m fault)
            "tests/test_amqp.py",  # aio-pika's own, in its sdist
            "tests/test_message.py",
            "tests/test_connect.py",
            "tests/test_connection_close_state.py",
            "tests/test_close_notification.py",
            "tests/test_nowait.py",
            "tests/test_consumer_publish_errors.py",
            "tests/test_queue_iterator_close.py",
            "tests/test_consumer_cancel_recovery.py",
        ),
        exclude={
            "tests/test_robust_recovery.py::*": (
                "starts, stops and kills a RabbitMQ container of its own through the "
                "Docker API; it never uses the broker it is given"
            ),
        },
        replicates=True,
    ),
)


def _fetch(suite: PeerSuite) -> Path:
    """The suite's sdist, unpacked in the cache; downloaded on first use."""
    tree = CACHE / f"{suite.dist}-{suite.version}"
    if (tree / "tests" / "conftest.py").is_file():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix=".download-") as tmp:
        argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
        argv += ["--no-binary", suite.dist, "--dest", tmp, f"{suite.dist}=={suite.version}"]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
        if result.returncode != 0:
            pytest.fail(f"pip could not download {suite.dist} {suite.version}:\n{result.stderr}")
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (unpacked,) = (p for p in Path(tmp).iterdir() if p.is_dir())
        if not tree.exists():  # else a concurrent session was faster
            unpacked.rename(tree)
    return tree


@pytest.fixture(scope="session")
def peer_suites() -> dict[str, Path]:
    """Each suite's unpacked sdist, by distribution name."""
    for suite in SUITES:
        # aio-pika's suite runs on the installed aiormq: setup.cfg pins both
        assert version(suite.dist) == suite.version, (
            f"{suite.dist} {version(suite.dist)} is installed, the suite is {suite.version}: "
            "pin the same version in setup.cfg's test extra"
        )
    return {suite.dist: _fetch(suite) for suite in SUITES}


@dataclass(frozen=True, slots=True)
class Outcomes:
    """What one run of a suite reported (``tests/interop/peer/peer_broker.py``)."""

    #: node id -> passed, failed, error, skipped, xfailed or xpassed
    tests: Mapping[str, str]
    #: node id -> the end of its failure report
    failures: Mapping[str, str] = field(default_factory=dict)
    #: node ids deselected by the suite's exclusions
    excluded: tuple[str, ...] = ()

    def summary(self) -> str:
        counts = Counter(self.tests.values())
        return ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))

    def updated(self, rerun: Outcomes) -> Outcomes:
        """These outcomes, with the tests run again ending as they did then."""
        tests = {**self.tests, **rerun.tests}
        failures = {**self.failures, **rerun.failures}
        failures = {t: text for t, text in failures.items() if tests[t] in FAILING}
        return Outcomes(tests, failures, self.excluded)


@dataclass
class SuiteRun:
    """One pytest of a peer suite against one broker URL, as a process."""

    target: str
    log: Path
    report: Path
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def start(
        cls,
        target: str,
        tree: Path,
        broker: tuple[str, int],
        args: tuple[str, ...],
        suite: PeerSuite,
        out: Path,
    ) -> SuiteRun:
        """Run ``suite`` against ``broker`` (its AMQP URL, its AMQPS port);
        output in ``out``, named after the suite and ``target``."""
        name = f"{suite.dist}-{target}"
        log, report = out / f"{name}.log", out / f"{name}.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(PLUGIN_DIR), env.get("PYTHONPATH")])),
            PYTHONDONTWRITEBYTECODE="1",  # the cached tree stays as unpacked
            VPNREPL_PEER_BROKER=broker[0],
            VPNREPL_PEER_AMQPS_PORT=str(broker[1]),
            VPNREPL_PEER_EXCLUDE=json.dumps(list(suite.exclude)),
            VPNREPL_PEER_REPORT=str(report),
        )
        # the suite's own config (not ours: no filterwarnings=error, no strict
        # markers), its tests and its package from the unpacked tree (cwd)
        argv = [sys.executable, "-m", "pytest", "-c", str(tree / "pyproject.toml")]
        argv += ["--rootdir", str(tree), "-p", "no:cacheprovider", "-p", "peer_broker"]
        # -v: a run cut short shows its last test; a test bounded to 60 s, and the
        # stacks dumped when one holds up the run for 90 s
        argv += ["-v", "--tb=short", "-o", "log_cli=false", "--aiomisc-test-timeout=60"]
        argv += ["-o", "faulthandler_timeout=90", *args]
        with open(log, "wb") as f:
            proc = subprocess.Popen(  # noqa: S603 - our interpreter, fixed arguments
                argv, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        return cls(target, log, report, proc)

    def finish(self, timeout: float) -> tuple[Outcomes, float]:
        """Wait for the run; its outcomes and how long it took."""
        try:
            code = self.proc.wait(timeout=max(1.0, timeout - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.target} run still going after {timeout:g} s:\n{self.tail()}")
        seconds = time.monotonic() - self.started
        doc = json.loads(self.report.read_text()) if self.report.exists() else {}
        if code not in (0, 1) or not doc.get("outcomes"):
            pytest.fail(f"{self.target} run ended with {code}, no test ran:\n{self.tail()}")
        return Outcomes(doc["outcomes"], doc["failures"], tuple(doc["deselected"])), seconds

    def kill(self) -> None:
        """SIGKILL the run (its pytest and whatever that started), if it still runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def unsettled(suite: PeerSuite, direct: Outcomes, listener: Outcomes) -> set[str]:
    """The tests :func:`differences` would name (exclusions aside): worth a rerun."""
    failing = {t for t, outcome in direct.tests.items() if outcome in FAILING}
    differ = {t for t, outcome in direct.tests.items() if listener.tests.get(t, outcome) != outcome}
    listed = set(suite.fails_directly) & set(direct.tests)
    return differ | (failing - listed) | (listed - failing)


def differences(
    suite: PeerSuite, direct: Outcomes, listener: Outcomes, whole: bool = False
) -> list[str]:
    """What keeps the two runs from being the same, and what keeps the
    suite's lists from being exact, each as a paragraph."""
    problems = []
    if set(direct.tests) != set(listener.tests):
        only = sorted(set(direct.tests) ^ set(listener.tests))[:20]
        problems.append(f"the runs collected different tests: {only}")
    for test, outcome in sorted(direct.tests.items()):
        through = listener.tests.get(test, outcome)
        if through != outcome:
            why = listener.failures.get(test) or direct.failures.get(test, "")
            problems.append(f"{test}: {outcome} directly, {through} through the listener\n{why}")
    failing = {t for t, outcome in direct.tests.items() if outcome in FAILING}
    for test in sorted(failing - set(suite.fails_directly)):
        problems.append(
            f"{test} fails directly and is not in fails_directly (list it with the "
            f"reason, or exclude it):\n{direct.failures.get(test, '')}"
        )
    for test in sorted(set(suite.fails_directly) & set(direct.tests) - failing):
        problems.append(f"{test} is in fails_directly but {direct.tests[test]} directly")
    if whole:
        for pattern in suite.exclude:
            if not any(fnmatch(t, pattern) for t in direct.excluded):
                problems.append(f"exclusion {pattern!r} matches no test of the suite")
    return problems


def _published(node: NodeProcess, vpns: tuple[str, ...]) -> int:
    """Persistent publishes the node replicated for ``vpns`` (its /metrics)."""
    metrics = node.get("/metrics")
    return sum(
        int(value(metrics, "vpnrepl_events_total", vpn=vpn, kind="published") or 0) for vpn in vpns
    )


@pytest.fixture(scope="module")
def peer_broker(sites: LocalSites, pki: Pki) -> Iterator[RabbitNode]:
    """The broker of the direct runs: a RabbitMQ node of the harness (in its
    directory, so an orphan is swept like the sites' nodes) that also serves
    AMQPS, with site a's certificate (no client certificate asked for)."""
    node = RabbitNode(f"vpnrepl-peer-{os.getpid()}", sites.base / "peer" / "rabbit", pki.tls("a"))
    node.start()
    try:
        yield node
    finally:
        node.kill()


def _serve_amqps(vpnrepl: Vpnrepl, pki: Pki) -> int:
    """Give the node's config an AMQPS listener (site a's certificate, no
    client certificate asked for); its port."""
    port = free_port()
    text = vpnrepl.config.read_text()
    text = text.replace("[store]", f'amqps = "127.0.0.1:{port}"\n\n[store]', 1)
    text += f'\n[client_tls]\ncert = "{pki.dir / "a.crt"}"\nkey = "{pki.dir / "a.key"}"\n'
    vpnrepl.config.write_text(text)
    return port


def _compare_runs(
    suite: PeerSuite,
    args: tuple[str, ...],
    tree: Path,
    broker: RabbitNode,
    site: LocalSite,
    vpnrepl: Vpnrepl,
    node: NodeProcess,
    pki: Pki,
    out: Path,
    timeout: float,
) -> None:
    # the suite's vhost; aio-pika's test_amqps connects to "/" whatever it is given
    vhosts = (f"peer-{suite.dist}", "/")
    broker.reset()
    broker.add_vhost(vhosts[0])
    site.rabbit.add_vhost(vhosts[0])
    for vhost in vhosts:
        result = vpnrepl("vpn", "enable", vhost, "--role", "active")  # no --queues: all
        assert result.returncode == 0, result.stderr
    amqps_port = _serve_amqps(vpnrepl, pki)
    node.start()
    assert broker.amqps_port is not None
    through = f"amqp://guest:guest@127.0.0.1:{site.amqp_port}/{vhosts[0]}"
    targets = {"direct": (broker.amqp_url(vhosts[0]), broker.amqps_port)}
    targets["listener"] = (through, amqps_port)

    def both(tests: tuple[str, ...], tag: str) -> tuple[tuple[Outcomes, float], ...]:
        runs = [SuiteRun.start(t + tag, tree, at, tests, suite, out) for t, at in targets.items()]
        try:
            return tuple(run.finish(timeout) for run in runs)
        finally:
            for run in runs:
                run.kill()

    (direct, direct_s), (listener, listener_s) = both(args, "")
    # a race in the client or the broker is no difference: what differs, or
    # fails directly unlisted, is run again (in both runs, at most twice) and
    # counts as it ends then; the tests so settled are printed
    settled: set[str] = set()
    for attempt in (1, 2):
        rerun = unsettled(suite, direct, listener)
        if not rerun:
            break
        settled |= rerun
        (direct_again, _), (listener_again, _) = both(tuple(sorted(rerun)), f"-rerun{attempt}")
        direct, listener = direct.updated(direct_again), listener.updated(listener_again)
    settled -= unsettled(suite, direct, listener)
    published = _published(node, vhosts)
    print(
        f"\n[peer] {suite.dist} {suite.version} ({'whole' if args == WHOLE else 'default'}): "
        f"{len(direct.excluded)} excluded; directly {direct.summary()} in {direct_s:.0f} s; "
        f"through the listener {listener.summary()} in {listener_s:.0f} s; "
        f"{published} persistent publishes replicated"
        + (f"; settled by a rerun: {sorted(settled)}" if settled else "")
    )
    problems = differences(suite, direct, listener, whole=args == WHOLE)
    shown = "\n\n".join(problems[:MAX_SHOWN])
    assert not problems, f"{len(problems)} differences (first {MAX_SHOWN} shown):\n\n{shown}"
    if suite.replicates:
        assert published > 0, "the suite's persistent publishes were not replicated"
    else:
        assert published == 0, "the suite published persistent messages after all"
    assert node.stop() == 0


#: the default suite runs aiormq's subset; aio-pika's (80 s) runs with -m fault,
#: as both whole suites do
DEFAULT_SUITES = [
    pytest.param(s, marks=pytest.mark.fault) if s.dist == "aio-pika" else s for s in SUITES
]


@pytest.mark.parametrize("suite", DEFAULT_SUITES, ids=lambda s: s.dist)
def test_peer_suite_passes_through_the_listener_as_directly(
    suite: PeerSuite,
    peer_suites: dict[str, Path],
    peer_broker: RabbitNode,
    site_a: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    pki: Pki,
    tmp_path: Path,
) -> None:
    tree = peer_suites[suite.dist]
    servers = (peer_broker, site_a, vpnrepl_a, node_a, pki)
    _compare_runs(suite, suite.default, tree, *servers, tmp_path, 600)


@pytest.mark.fault
@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.dist)
def test_whole_peer_suite_passes_through_the_listener_as_directly(
    suite: PeerSuite,
    peer_suites: dict[str, Path],
    peer_broker: RabbitNode,
    site_a: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    pki: Pki,
    tmp_path: Path,
) -> None:
    tree = peer_suites[suite.dist]
    servers = (peer_broker, site_a, vpnrepl_a, node_a, pki)
    _compare_runs(suite, WHOLE, tree, *servers, tmp_path, 1800)


@pytest.mark.fault
@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.dist)
def test_peer_suite_passes_through_the_listener_in_front_of_a_cluster(
    suite: PeerSuite,
    peer_suites: dict[str, Path],
    peer_broker: RabbitNode,
    cluster_sites: LocalSites,
    pki: Pki,
    tmp_path: Path,
) -> None:
    """The default subsets, with the node's listener spreading the suite's
    connections over site A's three broker nodes."""
    site, peer = cluster_sites.a, cluster_sites.b
    vpnrepl = Vpnrepl(site.write_config(tmp_path / "a.toml", peer=peer, dial=False))
    migrate(site.pg.dsn())
    node = NodeProcess(site, vpnrepl.config, tmp_path / "node-a.log")
    try:
        servers = (peer_broker, site, vpnrepl, node, pki)
        _compare_runs(suite, suite.default, peer_suites[suite.dist], *servers, tmp_path, 600)
    finally:
        node.kill()
    assert "Traceback" not in node.log_text(), node.log_text()


_TOY = PeerSuite(
    dist="toy",
    version="1.0",
    default=(),
    exclude={"tests/test_tls.py::*": "TLS"},
    replicates=False,
    fails_directly={"tests/test_a.py::test_old": "the broker is too old"},
)


def test_the_same_outcomes_are_no_difference() -> None:
    runs = Outcomes({"tests/test_a.py::test_x": "passed", "tests/test_a.py::test_old": "failed"})
    assert differences(_TOY, runs, runs) == []


def test_a_listener_only_failure_is_named_with_its_report() -> None:
    direct = Outcomes({"t::x": "passed", "t::y": "skipped"})
    listener = Outcomes({"t::x": "failed", "t::y": "skipped"}, {"t::x": "E  assert 1 == 2"})
    (problem,) = differences(_TOY, direct, listener)
    assert problem == "t::x: passed directly, failed through the listener\nE  assert 1 == 2"


def test_the_lists_of_direct_failures_and_exclusions_stay_exact() -> None:
    direct = Outcomes(
        {"tests/test_a.py::test_old": "passed", "tests/test_a.py::test_new": "error"},
        excluded=("tests/test_b.py::test_z",),
    )
    assert unsettled(_TOY, direct, direct) == {
        "tests/test_a.py::test_new",
        "tests/test_a.py::test_old",
    }
    problems = differences(_TOY, direct, direct, whole=True)
    assert [p.split(" ", 1)[0] for p in problems] == [
        "tests/test_a.py::test_new",  # fails directly, not listed
        "tests/test_a.py::test_old",  # listed, but passes
        "exclusion",  # tests/test_tls.py::* matched nothing
    ]
