"""The package as a release installs it: from its wheel, not the checkout.

Every other test imports the editable checkout, where a file beside its
module is found whether or not the packaging declares it. Here the sdist is
built from the tree and the wheel from the sdist (``python -m build``), the
wheel is installed into a fresh virtualenv, and that virtualenv's
``vpnrepl`` runs from a directory outside the checkout: the console script,
the packages ``find:`` picks and their data (the status page, Spark's log
configuration, the Alembic migrations and their template) must all have
made it, and nothing but the four packages may ship.

Cheap on purpose (once per session, a few seconds): the build runs without
isolation (its backend is among the test extras), and the fresh virtualenv
is made without pip and given the wheel's dependencies as links to this
virtualenv's installed files instead of downloads. It is given exactly the
closure of the wheel's ``Requires-Dist``: a dependency the code imports but
the metadata leaves out fails here. pip then installs the wheel itself, no
index asked, and would refuse if a requirement were unmet.
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import psycopg
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from plugin.devtools import LocalSite, LocalSites
from sql import head_revision
from tests import REPO

PACKAGES = {"bridge", "plugin", "sql", "txn"}
#: what the build must not see: the checkout's own build output, caches, VCS
#: and virtualenv
NOT_SOURCES = (
    ".git", ".venv", ".tox", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
    ".hypothesis",
)  # fmt: skip
#: the package data, each read from the installed package
DATA = (
    ("plugin.admin", "status.html"),
    ("plugin.reconcile", "log4j2.properties"),
    ("sql", "script.py.mako"),
)
#: run by the fresh virtualenv's interpreter (``DATA`` its argument): where
#: the packages come from, whether their data is there
PROBE = """
import json, sys
from importlib.resources import files
import bridge, plugin, plugin.devtools, sql, txn
print(json.dumps({
    "files": [m.__file__ for m in (bridge, plugin, plugin.devtools, sql, txn)],
    "path": sys.path,
    "data": [files(p).joinpath(n).is_file() for p, n in json.loads(sys.argv[1])],
    "head": sql.head_revision(),
}))
"""


@dataclass(frozen=True)
class Installed:
    """The fresh virtualenv with the wheel installed, and what was built."""

    venv: Path
    site_packages: Path
    src: Path
    sdist: Path
    wheel: Path
    #: a directory outside the checkout, to run the installed commands in
    elsewhere: Path

    @property
    def vpnrepl(self) -> Path:
        return self.venv / "bin" / "vpnrepl"

    def run(self, *argv: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(a) for a in argv],
            capture_output=True,
            text=True,
            cwd=self.elsewhere,
            env=_outside_env(),
            timeout=120,
            check=False,
        )


def _outside_env() -> dict[str, str]:
    """This environment minus what would lead an interpreter to the checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _run(argv: list[str | Path], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    argv = [str(a) for a in argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done


def _requirements(requires: Iterable[str] | None, extras: Iterable[str]) -> Iterator[Requirement]:
    """The ``Requires-Dist`` lines that apply with ``extras`` asked for."""
    for line in requires or ():
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            yield req


def _dependencies(requires: list[str]) -> list[metadata.Distribution]:
    """This virtualenv's distributions that ``requires`` needs, transitively."""
    found: dict[str, metadata.Distribution] = {}
    extras_done: dict[str, set[str]] = {}
    todo = list(_requirements(requires, ()))
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        extras = set(req.extras) - extras_done.get(name, set())
        if name in found and not extras:
            continue
        dist = found.get(name) or metadata.distribution(req.name)
        assert req.specifier.contains(dist.version, prereleases=True), (
            f"{req} is required, {dist.version} is installed"
        )
        found[name] = dist
        extras_done.setdefault(name, set()).update(extras)
        todo.extend(_requirements(dist.requires, extras))
    return list(found.values())


def _link_installed_files(dist: metadata.Distribution, site_packages: Path) -> None:
    """``dist``'s files (modules, compiled modules, its dist-info) as links
    in ``site_packages``; not its scripts, which live outside."""
    assert dist.files is not None, f"{dist.metadata['Name']} has no RECORD"
    base = Path(str(dist.locate_file("")))
    for file in dist.files:
        target, link = base / file, site_packages / file
        if file.parts[0] == ".." or not target.exists() or os.path.lexists(link):
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)


def _wheel_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as whl:
        (name,) = (n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.BytesParser().parsebytes(whl.read(name))
    return meta.get_all("Requires-Dist") or []


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, venv = tmp / "src", tmp / "dist", tmp / "venv"
    # a copy, so that the build writes nothing into the checkout and finds no
    # stale build/ there
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, src], timeout=300)
    (sdist,), (wheel,) = dist.glob("*.tar.gz"), dist.glob("*.whl")

    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    site_packages = Path(purelib.stdout.strip())
    for dependency in _dependencies(_wheel_requires(wheel)):
        _link_installed_files(dependency, site_packages)
    _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-index", "-q", wheel],
        timeout=300,
    )
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    return Installed(venv, site_packages, src, sdist, wheel, elsewhere)


def test_the_wheel_ships_the_four_packages_with_every_file_of_theirs(
    installed: Installed,
) -> None:
    with zipfile.ZipFile(installed.wheel) as whl:
        names = {n for n in whl.namelist() if ".dist-info/" not in n}
    assert {n.split("/")[0] for n in names} == PACKAGES
    in_tree = {
        p.relative_to(installed.src).as_posix()
        for package in PACKAGES
        for p in (installed.src / package).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert in_tree - names == set(), "files of the packages the wheel leaves out"
    assert names - in_tree == set()
    # the test plumbing that ships is plugin.devtools (the demo and the sandbox)
    assert not [n for n in names if "/tests/" in n or n.rsplit("/", 1)[-1].startswith("test_")]


def test_the_sdist_holds_the_packages_and_their_build_files_but_no_tests(
    installed: Installed,
) -> None:
    with tarfile.open(installed.sdist) as tar:
        tops = {Path(n).parts[1] for n in tar.getnames() if len(Path(n).parts) > 1}
    assert tops == PACKAGES | {
        "MANIFEST.in", "PKG-INFO", "README.md", "pyproject.toml", "setup.cfg",
        "vpn_replication.egg-info",
    }  # fmt: skip


def test_the_installed_vpnrepl_runs_its_own_packages_from_outside_the_checkout(
    installed: Installed,
) -> None:
    assert installed.vpnrepl.read_text().splitlines()[0] == f"#!{installed.venv}/bin/python"
    help_ = installed.run(installed.vpnrepl, "--help")
    assert help_.returncode == 0, help_.stderr
    for command in ("init", "node", "status", "sandbox", "demo", "reconcile"):
        assert f"\n    {command} " in help_.stdout

    done = installed.run(installed.venv / "bin" / "python", "-c", PROBE, json.dumps(DATA))
    assert done.returncode == 0, done.stderr
    probe = json.loads(done.stdout)
    for file in probe["files"]:
        assert Path(file).is_relative_to(installed.site_packages), file
    assert not [p for p in probe["path"] if p and Path(p).resolve().is_relative_to(REPO)]
    assert probe["data"] == [True] * len(DATA), DATA
    assert probe["head"] == head_revision()


def test_the_installed_node_serves_the_status_page_on_the_schema_its_init_made(
    installed: Installed, site_a: LocalSite, sites: LocalSites, tmp_path: Path
) -> None:
    config = site_a.write_config(tmp_path / "a.toml", peer=sites.b, dial=False)
    init = installed.run(installed.vpnrepl, "--config", config, "init")
    assert init.returncode == 0, init.stderr
    assert init.stdout == f"schema upgraded from empty to revision {head_revision()}\n"
    with psycopg.connect(site_a.pg.dsn()) as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == [
            (head_revision(),)
        ]

    log = tmp_path / "node.log"
    with open(log, "wb") as out:
        node = subprocess.Popen(
            [installed.vpnrepl, "--config", config, "node"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=installed.elsewhere,
            env=_outside_env(),
            start_new_session=True,
        )
    try:
        admin = f"http://127.0.0.1:{site_a.admin_port}"
        deadline = time.monotonic() + 60
        while True:
            assert node.poll() is None, f"node exited {node.returncode}:\n{log.read_text()}"
            try:
                with urllib.request.urlopen(f"{admin}/health", timeout=5) as resp:  # noqa: S310
                    if resp.read() == b"ok\n":
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"node not healthy:\n{log.read_text()}"
            time.sleep(0.1)
        with urllib.request.urlopen(f"{admin}/", timeout=5) as resp:  # noqa: S310
            assert resp.headers.get_content_type() == "text/html"
            assert resp.read() == (REPO / "plugin" / "admin" / "status.html").read_bytes()
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=30) == 0, log.read_text()
    finally:
        if node.poll() is None:
            node.kill()
            node.wait(timeout=30)
    assert "Traceback" not in log.read_text(), log.read_text()
