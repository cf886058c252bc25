"""``vpnrepl``: the broker admin's command line (names are a contract).

Exit status: 0 on success, 2 on a usage or config error, 1 on any other
failure, always with one line on stderr saying what is wrong; ``reconcile``
exits 3 when the sites still differ at the end of its run.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from bridge import BridgeError, InvalidSettings
from plugin._errors import PluginError, UsageError
from plugin.config import load_config

from ._commands import EXIT_FAILURE, EXIT_USAGE
from ._parser import build_parser

__all__ = ["main"]

log = logging.getLogger("vpnrepl")

#: Libraries that log routine steps at INFO (pika: every connection's open
#: and close, the demo's client; alembic: each plugin and revision at
#: ``init``, which prints its own summary; py4j: every Spark gateway
#: connection of ``reconcile``): noise around the command's own
#: lines; their warnings still show, and ``-v`` shows everything.
_CHATTY = ("pika", "alembic", "py4j")


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        args = build_parser().parse_args(argv)
        if args.verbose:
            logging.getLogger().setLevel(logging.DEBUG)
        else:
            for name in _CHATTY:
                logging.getLogger(name).setLevel(logging.WARNING)
            # pika logs a failed connect as an ERROR with a traceback; every
            # such failure reaches our code, which says what it means
            logging.getLogger("pika").setLevel(logging.CRITICAL)
        run: Callable[[Any, argparse.Namespace], int] = args.run
        cfg = None
        if getattr(args, "needs_config", True):
            if not args.config:
                raise UsageError("vpnrepl: --config SITE.TOML is required for this command")
            cfg = load_config(args.config, tuple(args.overrides), _node_name(args))
        return run(cfg, args)
    except (UsageError, InvalidSettings) as e:
        print(f"vpnrepl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (PluginError, BridgeError) as e:
        print(f"vpnrepl: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_FAILURE


def _node_name(args: argparse.Namespace) -> str | None:
    """``node --name``; a site of several nodes cannot start one unnamed
    (load_config says which names it knows)."""
    name: str | None = getattr(args, "name", None) if args.command == "node" else None
    return name
