"""``vpnrepl sandbox``: refuses what it must not touch, with a clear line."""

from __future__ import annotations

import os
from pathlib import Path

from tests.fix_cli import Vpnrepl


def test_sandbox_refuses_a_busy_directory_and_stops_only_a_sandbox(tmp_path: Path) -> None:
    vpnrepl = Vpnrepl(tmp_path / "unused.toml")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    busy = vpnrepl("sandbox", "start", str(tmp_path / "busy"), config=False)
    assert busy.returncode == 2 and "is not empty" in busy.stderr
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    stop = vpnrepl("sandbox", "stop", str(tmp_path / "busy"), config=False)
    assert stop.returncode == 2 and "holds no sandbox" in stop.stderr
    assert (tmp_path / "busy" / "notes.txt").exists()
    bad = vpnrepl("sandbox", "pause", str(tmp_path), config=False)
    assert bad.returncode == 2 and "invalid choice: 'pause'" in bad.stderr
    many = vpnrepl("sandbox", "start", str(tmp_path / "new"), "--brokers", "9", config=False)
    assert many.returncode == 2 and "--brokers 9: expected 1 to 5" in many.stderr
    assert not (tmp_path / "new").exists()


def test_as_root_a_directory_postgres_cannot_enter_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    tmp_path.chmod(0o700)  # as pytest makes it: the postgres user cannot enter
    done = Vpnrepl(tmp_path / "unused.toml")("sandbox", "start", str(tmp_path / "s"), config=False)
    if os.geteuid() == 0:
        assert done.returncode == 2 and "the postgres user cannot reach" in done.stderr
        assert not (tmp_path / "s" / "a").exists()
    else:  # PostgreSQL runs as this user, who can
        assert done.returncode == 0, done.stderr
        assert (
            Vpnrepl(tmp_path / "u")("sandbox", "stop", str(tmp_path / "s"), config=False).returncode
            == 0
        )
