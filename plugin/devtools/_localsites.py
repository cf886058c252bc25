"""Two local sites for the demo, tests and benchmarks: each a RabbitMQ node,
a PostgreSQL cluster (:mod:`plugin.devtools._rabbit`,
:mod:`plugin.devtools._postgres`) and the ports its ``vpnrepl node``
listens on, with the bridge's certificates.

Every server runs in its own temporary directory on free ports of
127.0.0.1, so any of the four can be stopped, SIGKILLed and restarted on
the same ports and data. The servers of a harness whose process died
without closing it are found and killed by the next one
(:func:`sweep_orphans`).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from plugin.tls import init_certificates

from ._postgres import PostgresCluster
from ._processes import HarnessError, free_port, kill_tree, stat_fields
from ._rabbit import RabbitNode

__all__ = ["LocalSite", "LocalSites", "kill_servers_in", "sweep_orphans"]

log = logging.getLogger(__name__)


class LocalSite:
    """One site's servers plus the ports its vpnrepl node listens on;
    ``brokers`` RabbitMQ nodes in one cluster (:attr:`rabbit` is the first)."""

    def __init__(self, name: str, base: Path, brokers: int = 1) -> None:
        if brokers < 1:
            raise HarnessError(f"a site has at least one broker node, not {brokers}")
        self.name = name
        self.base = base
        cookie = secrets.token_hex(16) if brokers > 1 else None
        # unique on the host: one process may run two harnesses' sites "a"
        unique = f"vpnrepl-{name}-{os.getpid()}-{secrets.token_hex(2)}"
        self.rabbits = [
            RabbitNode(
                unique + (f"-{n}" if n else ""),
                base / ("rabbit" if n == 0 else f"rabbit{n}"),
                cookie=cookie,
            )
            for n in range(brokers)
        ]
        self.rabbit = self.rabbits[0]
        self.pg = PostgresCluster(name, base / "pg")
        self.amqp_port, self.bridge_port, self.admin_port = free_port(), free_port(), free_port()
        #: the directory of the bridge certificates (``vpnrepl tls init``'s)
        self.pki: Path | None = None

    def config_text(
        self,
        peer: LocalSite | None = None,
        tls: bool = True,
        dial: bool = True,
        nodes: Mapping[str, tuple[int, int, int]] | None = None,
        lease_seconds: float | None = None,
        peer_bridges: Sequence[int] | None = None,
    ) -> str:
        """This site's config; ``peer``: the site it replicates with (which
        it dials unless ``dial`` is false: a site that only serves it, at
        ``peer_bridges`` when its nodes are several). ``nodes``: the site's
        nodes by name, each with its AMQP, bridge and admin ports
        (``[nodes.NAME]`` instead of ``[listen]``)."""
        lease = f"lease_seconds = {lease_seconds}\n" if lease_seconds is not None else ""
        if nodes:
            listen = "".join(
                f'[nodes.{name}]\namqp = "127.0.0.1:{amqp}"\nbridge = "127.0.0.1:{bridge}"\n'
                f'admin = "127.0.0.1:{admin}"\n\n'
                for name, (amqp, bridge, admin) in nodes.items()
            )
        else:
            listen = (
                f'[listen]\namqp = "127.0.0.1:{self.amqp_port}"\n'
                f'bridge = "127.0.0.1:{self.bridge_port}"\n'
                f'admin = "127.0.0.1:{self.admin_port}"\n\n'
            )
        text = (
            f'[site]\nname = "{self.name}"\n{lease}\n'
            f"[broker]\namqp_url = {_listed([r.amqp_url() for r in self.rabbits])}\n"
            f"management_url = {_listed([r.management_url for r in self.rabbits])}\n\n"
            f"{listen}"
            f'[store]\ndsn = "{self.pg.dsn()}"\n'
        )
        if peer is not None:
            text += f"\n[peers.{peer.name}]\n"
            if dial:
                ports = list(peer_bridges or [peer.bridge_port])
                text += f"bridge = {_listed([f'127.0.0.1:{p}' for p in ports])}\n"
            text += f'store_dsn = "{peer.pg.dsn()}"\n'

        if tls and self.pki is not None:
            text += (
                f'\n[tls]\ncert = "{self.pki / self.name}.crt"\n'
                f'key = "{self.pki / self.name}.key"\nca = "{self.pki}/ca.crt"\n'
            )
        return text

    def write_config(
        self, path: Path, peer: LocalSite | None = None, tls: bool = True, dial: bool = True
    ) -> Path:
        """The site's config (:meth:`config_text`): mutual TLS with the
        harness's certificates (``tls=False``: no ``[tls]``, for a caller
        that adds its own)."""
        path.write_text(self.config_text(peer, tls, dial))
        return path


def _listed(urls: list[str]) -> str:
    """A TOML string, or a list of them for a cluster's nodes."""
    quoted = [f'"{u}"' for u in urls]
    return quoted[0] if len(quoted) == 1 else f"[{', '.join(quoted)}]"


_SITES_PREFIX = "vpnrepl-sites-"
_OWNER_FILE = "owner"


def _started_at(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (``/proc/PID/stat`` field 22), or
    None when it is gone: with the pid it names one process, even after the
    pid is reused."""
    try:
        return stat_fields(Path("/proc") / str(pid) / "stat")[19]
    except (OSError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        raw = (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def kill_servers_in(base: Path) -> int:
    """SIGKILL the RabbitMQ nodes and PostgreSQL clusters of the sites in
    ``base`` (found by their pid files; a process is killed only if its
    command line names ``base``, so a reused pid is never hit). Returns how
    many were running."""
    killed = 0
    for pidfile in (*base.glob("*/rabbit*/rabbit.pid"), *base.glob("*/pg/data/postmaster.pid")):
        try:
            pid = int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if str(base) in _cmdline(pid):
            kill_tree(pid)
            killed += 1
    return killed


def sweep_orphans(tmp: Path | None = None) -> list[Path]:
    """Kill the servers of harnesses whose process died without closing them
    (a test run or benchmark SIGKILLed), and remove their directories.

    Each :class:`LocalSites` with a directory of its own writes its owner's
    pid and start time there; a directory whose owner is gone is an orphan.
    A server is killed only if its command line names the orphan's
    directory, so a reused pid is never hit. Returns the directories removed.
    """
    removed = []
    for base in sorted((tmp or Path(tempfile.gettempdir())).glob(f"{_SITES_PREFIX}*")):
        try:
            pid_text, started = (base / _OWNER_FILE).read_text().split()
            owner = int(pid_text)
        except (OSError, ValueError):
            continue  # not ours, or not written yet
        if _started_at(owner) == started:
            continue  # its owner still runs
        if kill_servers_in(base):
            log.warning("killed the servers a dead harness left in %s", base)
        shutil.rmtree(base, ignore_errors=True)
        removed.append(base)
    return removed


class LocalSites:
    """Two sites, ``a`` and ``b``: two RabbitMQ nodes and two PostgreSQL clusters.

    With no ``base`` given, the servers live in a temporary directory of
    their own, which :meth:`close` removes; one that a killed process never
    closed is cleaned up by the next :meth:`start` (:func:`sweep_orphans`).
    """

    def __init__(self, base: Path | None = None, brokers: tuple[int, int] = (1, 1)) -> None:
        """``brokers``: how many RabbitMQ nodes each site's cluster has (a, b)."""
        self._own_base = base is None
        self.base = Path(tempfile.mkdtemp(prefix=_SITES_PREFIX)) if base is None else base
        self.base.chmod(0o755)  # the postgres user must reach its directory
        if self._own_base:
            me = os.getpid()
            (self.base / _OWNER_FILE).write_text(f"{me} {_started_at(me)}\n")
        self.a = LocalSite("a", self.base / "a", brokers[0])
        self.b = LocalSite("b", self.base / "b", brokers[1])
        # the bridge's certificates: a private CA and one naming each site
        pki = self.base / ".pki"
        if not (pki / "b.crt").exists():
            init_certificates(pki, [self.a.name, self.b.name])
        self.a.pki = self.b.pki = pki
        self.startup_seconds = 0.0

    def start(self) -> None:
        t0 = time.monotonic()
        sweep_orphans()
        rabbits = [*self.a.rabbits, *self.b.rabbits]
        for node in rabbits:
            node.launch()
        with ThreadPoolExecutor(2 + len(rabbits)) as pool:
            futures = [
                pool.submit(self.a.pg.start),
                pool.submit(self.b.pg.start),
                *(pool.submit(node.wait_ready) for node in rabbits),
            ]
            for f in futures:
                f.result()
        for site in (self.a, self.b):
            for node in site.rabbits[1:]:
                node.join(site.rabbit)
            site.pg.reset()
        self.startup_seconds = time.monotonic() - t0
        log.info("two sites started in %.1f s", self.startup_seconds)

    def close(self) -> None:
        for site in (self.a, self.b):
            servers: list[RabbitNode | PostgresCluster] = [*site.rabbits, site.pg]
            for server in servers:
                try:
                    server.kill()
                except HarnessError as e:
                    log.warning("%s", e)
        if self._own_base:
            shutil.rmtree(self.base, ignore_errors=True)


@contextmanager
def local_sites(brokers: tuple[int, int] = (1, 1)) -> Iterator[LocalSites]:
    sites = LocalSites(brokers=brokers)
    try:
        sites.start()
        yield sites
    finally:
        sites.close()
