"""Run the installed ``vpnrepl`` console script as an admin would."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from plugin.devtools import LocalSite, LocalSites


@dataclass
class Vpnrepl:
    config: Path

    def set_peer_store(self, dsn: str) -> None:
        """Point the config's peer ``store_dsn`` at ``dsn`` (a role with
        the README's grants, say)."""
        text = self.config.read_text()
        changed = re.sub(r'(?m)^store_dsn = ".*"$', f'store_dsn = "{dsn}"', text, count=1)
        assert changed != text or f'store_dsn = "{dsn}"' in text, "no peer store_dsn to set"
        self.config.write_text(changed)

    def argv(self, *args: str, config: bool = True) -> list[str]:
        """The command line (for a caller that starts it itself)."""
        exe = shutil.which("vpnrepl") or str(Path(sys.executable).with_name("vpnrepl"))
        return [exe, *(["--config", str(self.config)] if config else []), *args]

    def __call__(self, *args: str, config: bool = True) -> subprocess.CompletedProcess[str]:
        argv = self.argv(*args, config=config)
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def vpnrepl_a(site_a: LocalSite, sites: LocalSites, tmp_path: Path) -> Vpnrepl:
    """``vpnrepl`` with a config for site A, which serves site B as its
    peer (and does not dial it)."""
    return Vpnrepl(site_a.write_config(tmp_path / "a.toml", peer=sites.b, dial=False))
