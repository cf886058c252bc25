"""A private PostgreSQL cluster from the Debian binaries, ``initdb``'d in its
own directory on a free port, so a PostgreSQL that already runs on the
machine is never touched. Run as root, ``initdb`` and ``pg_ctl`` (which
refuse root) run as the ``postgres`` user.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import psycopg

from ._processes import HarnessError, free_port, kill_tree, log_tail, wait_dead

__all__ = ["PostgresCluster"]


def _pg_bindir() -> Path:
    found = shutil.which("pg_config")
    if found:
        out = subprocess.run(  # noqa: S603 - pg_config from PATH, fixed arguments
            [found, "--bindir"], capture_output=True, text=True, check=False
        )
        candidate = Path(out.stdout.strip())
        if (candidate / "initdb").exists():
            return candidate
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3])
    )
    if not versions:
        raise HarnessError("PostgreSQL server binaries not found (install `postgresql`)")
    return versions[-1].parent


class PostgresCluster:
    """One PostgreSQL cluster, initdb'd in its own directory."""

    def __init__(self, name: str, base: Path) -> None:
        self.name = name
        self.base = base
        self.port = free_port()
        self.datadir = base / "data"
        self._bindir = _pg_bindir()
        self._as_postgres = os.geteuid() == 0
        #: environment the server starts with besides this process's (the
        #: fault suite's clock jump preloads libfaketime)
        self.extra_env: dict[str, str] = {}
        base.mkdir(parents=True, exist_ok=True)
        if self._as_postgres:
            shutil.chown(base, "postgres", "postgres")

    def _run(self, *argv: str) -> None:
        cmd = [str(self._bindir / argv[0]), *argv[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        result = subprocess.run(  # noqa: S603 - fixed argv
            cmd,
            capture_output=True,
            text=True,
            check=False,
            cwd=self.base,
            timeout=120,
            env={**os.environ, **self.extra_env},
        )
        if result.returncode != 0:
            raise HarnessError(
                f"PostgreSQL {self.name}: {argv[0]} failed: {result.stderr.strip()}\n"
                f"{log_tail(self.base / 'server.log')}"
            )

    def dsn(self, dbname: str = "vpnrepl") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> None:
        if not self.datadir.exists():
            self._run(
                "initdb",
                "-D",
                str(self.datadir),
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
            )
        options = (
            f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 "
            "-c max_connections=200 -c shared_buffers=64MB -c max_prepared_transactions=20"
        )
        self._run(
            "pg_ctl",
            "-D",
            str(self.datadir),
            "-o",
            options,
            "-l",
            str(self.base / "server.log"),
            "-w",
            "-t",
            "60",
            "start",
        )

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.datadir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def alive(self) -> bool:
        pid = self.postmaster_pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self) -> None:
        if self.alive():
            self._run("pg_ctl", "-D", str(self.datadir), "-m", "fast", "-w", "stop")

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend, as a crash would."""
        pid = self.postmaster_pid()
        if pid is None or not self.alive():
            return
        kill_tree(pid)
        wait_dead(pid)

    def restart(self) -> None:
        self.stop()
        self.start()

    def reset(self, dbname: str = "vpnrepl") -> None:
        """Drop and recreate ``dbname``: a fresh database for the next test."""
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{dbname}"')
