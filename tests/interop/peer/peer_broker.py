"""A peer client's own test suite, pointed at a broker we name instead of Docker.

``tests/interop/test_peer_suites.py`` runs aiormq's and aio-pika's suites (from their
sdists) in a pytest of their own, with this directory on ``PYTHONPATH`` and
``-p peer_broker``. Their conftests would start a RabbitMQ container (aio-pika's
refuses to start at all without a Docker socket); here:

- ``amqp_direct_url`` is ``VPNREPL_PEER_BROKER`` (an ``amqp://`` URL: the
  harness's RabbitMQ or a listener in front of it, and a vhost), and
  ``rabbitmq_container`` its host, port and ``VPNREPL_PEER_AMQPS_PORT``
  (the same server's AMQPS). A conftest's own definitions of the two, and
  its Docker check, are removed as it registers, so these apply; nothing
  else of the conftest changes.
- Every test is bounded by ``--aiomisc-test-timeout``.
- Tests whose node id matches a pattern (``fnmatch``) in the JSON list
  ``VPNREPL_PEER_EXCLUDE`` are deselected.
- The outcome of every test, the end of each failure's report and the
  deselected tests are written as JSON to ``VPNREPL_PEER_REPORT``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from yarl import URL

_OVERRIDDEN = ("rabbitmq_container", "amqp_direct_url")
# best to worst: a test's outcome is the worst of its setup, call and teardown
_RANK = ("passed", "skipped", "xfailed", "xpassed", "failed", "error")
_FAILURE_LINES = 40

_report: dict[str, Any] = {"outcomes": {}, "failures": {}, "deselected": []}


@dataclass(frozen=True, slots=True)
class Broker:
    """What the suites read of their ``rabbitmq_container``: host and ports."""

    host: str
    ports: dict[str, int] = field(default_factory=dict)


def _url() -> URL:
    return URL(os.environ["VPNREPL_PEER_BROKER"])


@pytest.fixture(scope="session")
def rabbitmq_container() -> Broker:
    url = _url()
    assert url.host is not None and url.port is not None
    amqps = int(os.environ["VPNREPL_PEER_AMQPS_PORT"])
    return Broker(url.host, {"5672/tcp": url.port, "5671/tcp": amqps})


@pytest.fixture(scope="session")
def amqp_direct_url() -> URL:
    return _url()


@pytest.fixture(autouse=True)
def _every_test_times_out(aiomisc_test_timeout: float | None) -> None:
    """aiomisc bounds a test by ``--aiomisc-test-timeout`` only if it asks for
    this fixture; asking for it here bounds them all, so a test that waits
    forever fails instead of holding up the run."""


@pytest.hookimpl(tryfirst=True)
def pytest_plugin_registered(plugin: object) -> None:
    # runs before pytest reads the conftest's fixtures and calls its
    # pytest_configure (aio-pika's raises a UsageError when Docker is missing)
    if not isinstance(plugin, ModuleType) or plugin.__name__.rpartition(".")[2] != "conftest":
        return
    for name in _OVERRIDDEN:
        if hasattr(plugin, name):
            delattr(plugin, name)
    if hasattr(plugin, "check_docker_available"):
        plugin.check_docker_available = lambda: None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    patterns = json.loads(os.environ.get("VPNREPL_PEER_EXCLUDE", "[]"))
    keep, drop = [], []
    for item in items:
        (drop if any(fnmatch(item.nodeid, p) for p in patterns) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    _report["deselected"] = [item.nodeid for item in drop]


def _failed(nodeid: str, text: str) -> None:
    _report["failures"].setdefault(nodeid, "\n".join(text.splitlines()[-_FAILURE_LINES:]))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _report["outcomes"][report.nodeid] = "error"
        _failed(report.nodeid, report.longreprtext)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        outcome = "failed" if report.when == "call" else "error"
        _failed(report.nodeid, report.longreprtext)
    elif hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    else:
        outcome = "skipped" if report.skipped else "passed"
    previous = _report["outcomes"].get(report.nodeid, "passed")
    _report["outcomes"][report.nodeid] = max(previous, outcome, key=_RANK.index)


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("VPNREPL_PEER_REPORT")
    if path:
        Path(path).write_text(json.dumps(_report, indent=1, sort_keys=True))
