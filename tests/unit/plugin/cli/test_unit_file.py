"""The systemd unit in deploy/ runs a command this release understands."""

from __future__ import annotations

import shlex
from pathlib import Path

from plugin.cli._parser import build_parser

UNIT = Path(__file__).resolve().parents[4] / "deploy" / "vpnrepl-node@.service"


def test_the_node_unit_starts_the_named_node_of_the_site_config() -> None:
    lines = UNIT.read_text().splitlines()
    start = next(line for line in lines if line.startswith("ExecStart="))
    env = dict(
        line.removeprefix("Environment=").split("=", 1)
        for line in lines
        if line.startswith("Environment=")
    )
    argv = shlex.split(start.removeprefix("ExecStart="))
    assert argv[0].endswith("/vpnrepl")
    argv = [env.get(a[2:-1], a) if a.startswith("${") else a.replace("%i", "nyc1") for a in argv]
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.name, args.config) == ("node", "nyc1", "/etc/vpnrepl/site.toml")
    assert any(line == "KillSignal=SIGTERM" for line in lines)  # releases the lease
