"""The bridge codec's CPU cost per frame kind, without servers.

For one representative frame of each kind, ``encode()`` and
``decode_frame()`` are timed (the best of ``--repeat`` short runs) and
printed as µs per frame. ``--against PATH`` compares this tree with
another checkout: each side runs in a subprocess importing ``bridge`` from
its own tree, the two alternate ``--rounds`` times (the order swapped each
round), and the table gives each side's best µs (the least disturbed by
other load) and the ratio this/other per kind.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HOT = ("Events", "Ack", "Heartbeat", "Checkpoint")


def samples() -> dict[str, Any]:
    """One frame per kind, sized like the replication stream's (1 KiB bodies)."""
    from bridge import (
        LedgerEntry,
        Mode,
        Published,
        ReplicationId,
        Role,
        SyncTimeoutPolicy,
        TopicFilter,
        encode_event,
        wire as w,
    )

    vpn, body = "orders", b"x" * 1024

    def rid(n: int) -> ReplicationId:
        return ReplicationId.from_parts(7, n)

    def row(n: int) -> Any:
        return w.CheckpointRow("orders.q1", rid(n), n, "amq.direct", "q1", b"\x90\x00\x02", body)

    def entry(n: int) -> LedgerEntry:
        event = Published(vpn, rid(n), "amq.topic", "a.b", b"\x90\x00\x02", body, ("q1", "q2"))
        return LedgerEntry(vpn, 3, n, event, encode_event(event))

    resource = w.VpnResource(
        vpn, 3, Mode.SYNC, 2000, SyncTimeoutPolicy.REJECT, ("orders\\..*",),
        (TopicFilter("amq.topic", "eu.#"),), b'{"queues": []}' * 40, False, 0, 7,
    )  # fmt: skip
    frames = [
        w.Hello("ldn", 6, Role.STANDBY, 15),
        w.GetAllResources(),
        w.ResourceList((resource,)),
        w.SyncRequest(vpn, 3, 1042, 2, "ldn", 99),
        w.SyncAccepted(vpn, 3, 1043),
        w.Checkpoint(vpn, 3, 100, tuple(row(n) for n in range(1, 11)), False),
        w.SyncFinished(vpn, 3, 1042),
        w.Events(vpn, 3, tuple(entry(n) for n in range(1, 11))),
        w.Ack(vpn, 3, 1042),
        w.Heartbeat(),
        w.Error(1, vpn, "epoch 2 is stale"),
        w.TxnPrepare(vpn, 3, "7.1.1.1", b"\x00\x00\x00\x01P" * 10, "alice"),
        w.TxnVote(vpn, 3, "7.1.1.1", True),
        w.TxnOutcome(vpn, 3, "7.1.1.1", True),
        w.TxnQuery(vpn, 3, ("7.1.1.1", "7.2.1.5")),
        w.TxnCommit(vpn, 3, "7.1.1.1", 1043),
        w.TxnApplied(vpn, 3, "7.1.1.1", True),
        w.Repair(vpn, 3, (row(4),), (("orders.q1", rid(6)),)),
    ]
    assert {type(f) for f in frames} == set(w.FRAME_TYPES.values()), "a frame kind is missing"
    return {type(f).__name__: f for f in frames}


def best_us(stmt: str, names: dict[str, Any], repeat: int) -> float:
    """The best of ``repeat`` runs of about 5-10 ms each: on a shared
    machine many short runs find a quiet moment more often than a few long."""
    timer, number = timeit.Timer(stmt, globals=names), 1
    while timer.timeit(number) < 0.005:
        number *= 2
    return min(timer.repeat(repeat, number)) / number * 1e6


def measure(repeat: int) -> dict[str, tuple[float, float]]:
    from bridge.wire import decode_frame

    out = {}
    for kind, frame in samples().items():
        data = frame.encode()
        assert decode_frame(data) == (frame, len(data))
        names = {"encode": frame.encode, "decode_frame": decode_frame, "data": data}
        out[kind] = (
            best_us("encode()", names, repeat),
            best_us("decode_frame(data)", names, repeat),
        )
    return out


def run_tree(tree: Path, repeat: int) -> dict[str, tuple[float, float]]:
    """Measure in a subprocess that imports ``bridge`` from ``tree``."""
    done = subprocess.run(
        [sys.executable, __file__, "--worker", str(tree), "--repeat", str(repeat)],
        capture_output=True,
        text=True,
        check=True,
    )
    return {k: (v[0], v[1]) for k, v in json.loads(done.stdout).items()}


def compare(other: Path, rounds: int, repeat: int) -> None:
    runs: dict[str, list[dict[str, tuple[float, float]]]] = {"this": [], "other": []}
    for r in range(rounds):
        for side in ("this", "other") if r % 2 == 0 else ("other", "this"):
            runs[side].append(run_tree(ROOT if side == "this" else other, repeat))
            print(f"round {r + 1}/{rounds}: {side} done", file=sys.stderr)

    def best(side: str, kind: str, i: int) -> float:
        return min(run[kind][i] for run in runs[side])

    print(f"this: {ROOT}\nother: {other}\nbest of {rounds} runs each, µs per frame")
    head = f"{'other':>8} {'ratio':>6}"
    print(f"{'frame':16} {'encode':>8} {head}   {'decode':>8} {head}")
    for kind in runs["this"][0]:
        enc, enc_o = best("this", kind, 0), best("other", kind, 0)
        dec, dec_o = best("this", kind, 1), best("other", kind, 1)
        mark = " *" if kind in HOT else ""
        print(
            f"{kind:16} {enc:8.2f} {enc_o:8.2f} {enc / enc_o:6.2f}"
            f"   {dec:8.2f} {dec_o:8.2f} {dec / dec_o:6.2f}{mark}"
        )
    print("* hot on the replication stream")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", type=Path, metavar="PATH", help="another checkout to compare with")
    p.add_argument("--rounds", type=int, default=5, help="runs per side with --against")
    p.add_argument("--repeat", type=int, default=20, help="timed runs per figure (the best counts)")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.against:
        compare(opts.against.resolve(), opts.rounds, opts.repeat)
        return 0
    # bench/bridge.py would shadow the package: the tree measured goes first
    sys.path.insert(0, str(opts.worker or ROOT))
    got = measure(opts.repeat)
    if opts.worker:
        print(json.dumps(got))
        return 0
    print(f"{'frame':16} {'encode µs':>10} {'decode µs':>10}")
    for kind, (enc, dec) in got.items():
        print(f"{kind:16} {enc:10.2f} {dec:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
