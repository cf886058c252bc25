"""``vpnrepl sandbox start|stop DIR``: two sites' servers on this machine.

For trying vpn-replication (the README's walkthrough) without brokers and
databases of one's own: ``start`` runs two RabbitMQ nodes (with the
management plugin) and two PostgreSQL clusters of the harness in ``DIR``,
on free loopback ports, and leaves them running; it writes a site config
per site (``a.toml``, ``b.toml``, each naming the other as its peer, each
with two nodes, ``a1`` and ``a2``, ``b1`` and ``b2``, on a 5 s lease so a
takeover is quick to watch) and ``sandbox.env`` (shell variables with the
addresses). ``stop`` kills those
servers, found by the pid files in ``DIR`` (a server is killed only when
its command line names ``DIR``), and removes ``DIR``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from plugin._errors import UsageError

from ._localsites import LocalSite, LocalSites, kill_servers_in
from ._processes import HarnessError, free_port

__all__ = ["start_sandbox", "stop_sandbox"]

MARKER = "sandbox.env"
#: the sandbox sites' lease: a takeover in the walkthrough takes seconds
SANDBOX_LEASE_SECONDS = 5


def start_sandbox(where: Path, brokers: int = 1) -> list[str]:
    """Start the servers, each site's RabbitMQ a cluster of ``brokers``
    nodes; returns the lines that say what runs where."""
    if not 1 <= brokers <= 5:
        raise UsageError(f"--brokers {brokers}: expected 1 to 5 RabbitMQ nodes per site")
    where = where.resolve()
    if (where / MARKER).exists():
        raise UsageError(f"{where} holds a sandbox already: `vpnrepl sandbox stop {where}` first")
    if where.exists() and any(where.iterdir()):
        raise UsageError(f"{where} is not empty: give a new or an empty directory")
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0 and not _postgres_reaches(where):
        raise UsageError(
            f"the postgres user cannot reach {where} (a parent directory is private): "
            "give a directory such as /tmp/vpnrepl-try"
        )
    sites = LocalSites(where, brokers=(brokers, brokers))
    try:
        sites.start()
    except HarnessError:
        sites.close()
        raise
    env = []
    ports = {site.name: _node_ports(site) for site in (sites.a, sites.b)}
    for site, peer in ((sites.a, sites.b), (sites.b, sites.a)):
        mine = ports[site.name]
        text = site.config_text(
            peer,
            tls=False,
            nodes=mine,
            lease_seconds=SANDBOX_LEASE_SECONDS,
            peer_bridges=[bridge for _, bridge, _ in ports[peer.name].values()],
        )
        (where / f"{site.name}.toml").write_text(text)
        up = site.name.upper()
        env += [
            f"SITE_{up}_BROKER=127.0.0.1:{site.rabbit.amqp_port}",
            f"SITE_{up}_MANAGEMENT=127.0.0.1:{site.rabbit.management_port}",
            f"SITE_{up}_LISTENER=127.0.0.1:{site.amqp_port}",
            f"SITE_{up}_LISTENERS=" + ",".join(f"127.0.0.1:{a}" for a, _, _ in mine.values()),
            f"SITE_{up}_ADMIN=127.0.0.1:{site.admin_port}",
            f"SITE_{up}_ADMINS=" + ",".join(f"127.0.0.1:{m}" for _, _, m in mine.values()),
        ]
        if brokers > 1:
            nodes = ",".join(f"127.0.0.1:{r.amqp_port}" for r in site.rabbits)
            env.append(f"SITE_{up}_BROKERS={nodes}")
    (where / MARKER).write_text("".join(f"export {line}\n" for line in env))
    return [
        f"sandbox in {where}: RabbitMQ (user guest"
        + (f", a cluster of {brokers} nodes per site" if brokers > 1 else "")
        + ") and PostgreSQL for sites a and b",
        f"  site configs: {where / 'a.toml'}, {where / 'b.toml'}, two nodes each (a1, a2;"
        f" b1, b2), without [tls]: add it, e.g. from"
        f" `vpnrepl tls init {where / 'pki'} --sites a,b`",
        f"  addresses: {where / MARKER} (`. {where / MARKER}`)",
        f"  stop it with `vpnrepl sandbox stop {where}`",
    ]


def _node_ports(site: LocalSite) -> dict[str, tuple[int, int, int]]:
    """The site's two nodes: the first on the site's own ports."""
    return {
        f"{site.name}1": (site.amqp_port, site.bridge_port, site.admin_port),
        f"{site.name}2": (free_port(), free_port(), free_port()),
    }


def _postgres_reaches(where: Path) -> bool:
    """As root the harness runs PostgreSQL as ``postgres``, which must be
    able to enter ``where``."""
    done = subprocess.run(  # noqa: S603 - fixed argv
        ["runuser", "-u", "postgres", "--", "test", "-x", str(where)],  # noqa: S607
        capture_output=True,
        check=False,
        timeout=30,
    )
    return done.returncode == 0


def stop_sandbox(where: Path) -> int:
    """Kill the sandbox's servers and remove ``where``; returns how many
    servers were running."""
    where = where.resolve()
    if not (where / MARKER).exists():
        raise UsageError(f"{where} holds no sandbox (no {MARKER})")
    killed = kill_servers_in(where)
    shutil.rmtree(where)
    return killed
