"""The best ratio ``bench/bridge.py`` could print on this machine, whatever the code.

``bench/bridge.py`` compares publishing through two replicating sites with
publishing to the broker directly, on one machine that hosts everything:
the client, both brokers, both databases and both nodes. Every replicated
message needs, besides the broker's own work, database work that the issue
names and no implementation can skip:

* site A's ledger row, holding the message (the standby may be down: the
  active must be able to replay it) — durable before the client's confirm;
* site A's live-state row (the active applies its own ledger to
  ``live_message``, so both sites compare row for row);
* site B's live-state row, with its applied index;

and every consumption ACK a ledger row on A and the live-state row's removal
on both sites.

This script measures that floor without any vpn-replication code on the
path. Each round publishes ``--messages`` 1 KiB persistent messages directly
to RabbitMQ A (the same lean confirm-window client as ``bench/bridge.py``,
500 in flight) and then consumes and acks them, twice, in an order rotated
per round:

* **direct** — the broker alone, as ``bench/bridge.py``'s baseline;
* **direct + database floor** — the same publish (then consume) while two
  writer processes do the rows above for the same number of messages in
  PostgreSQL A and B (the real schema, ``vpnrepl init``), in the cheapest
  form there is: rows built before the clock starts, inserts shipped with
  binary ``COPY`` and removals with one array-parameter ``DELETE`` per
  ``--batch`` messages, one commit per batch, A's ledger and live rows in
  the same transaction. The run's time runs from its start until the client
  *and* both writers are done.

No listener, no node, no bridge and no per-message Python on the database
side: everything the replicated runs of ``bench/bridge.py`` do on top of
this (relaying every frame, the id header, shipping the events to B) only
adds work. So the ratios printed here bound the ones ``bench/bridge.py``
can reach on this machine from above: when one is below the issue's bar,
that bar cannot be met on this machine by any implementation that keeps
the ledger and the two live states the issue asks for. (On a deployment
whose standby site has hosts of its own, B's share leaves the active's
machine; this script prints the bound with A's share alone as well.)

Run from the repository root: ``.venv/bin/python bench/floor.py``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import uvloop
from _common import (
    BenchError,
    LeanConsumer,
    LeanPublisher,
    beam_pid,
    start_ready,
    tree_cpu,
    vpnrepl,
)

from plugin.devtools import HarnessError, LocalSites

VPN = "orders"
QUEUE = "bench.floor"
#: the issue's bars, as a fraction of the direct rate
BARS = {"publish": 0.70, "consume": 0.70}
MODES = ("direct", "floor A+B", "floor A")

_COPY_HEAD = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
_COPY_TAIL = struct.pack(">h", -1)
_FIELD = struct.Struct(">i")
_INT8 = struct.Struct(">iq")  # length 8, value


# ---------------------------------------------------------------- the writers


def _field(value: bytes) -> bytes:
    return _FIELD.pack(len(value)) + value


def _copy(rows: list[list[bytes]]) -> bytes:
    """A binary COPY stream of ``rows`` (each a list of encoded fields)."""
    parts = [_COPY_HEAD]
    for row in rows:
        parts.append(struct.pack(">h", len(row)))
        parts.extend(row)
    parts.append(_COPY_TAIL)
    return b"".join(parts)


def _repl_id(n: int) -> bytes:
    return n.to_bytes(16, "big")


@dataclass
class _Batch:
    ledger: bytes  # COPY stream of ledger rows (site A only)
    live: bytes  # COPY stream of live_message rows (publish) or b""
    ids: list[bytes]  # the batch's repl ids (acks)
    last: int  # the batch's last index


def _batches(
    site: str, phase: str, first: int, ids_from: int, messages: int, size: int, batch: int
) -> list[_Batch]:
    """Every batch of one writer's run, built before the clock starts: ledger
    indexes from ``first``, replication ids from ``ids_from`` (a consume run
    acks the ids the publish run before it wrote)."""
    vpn, queue = _field(VPN.encode()), _field(QUEUE.encode())
    body = os.urandom(size)
    properties = b"\x90\x00\x18application/octet-stream\x02"  # what the publisher sends
    out = []
    for start in range(0, messages, batch):
        ledger_rows: list[list[bytes]] = []
        live_rows: list[list[bytes]] = []
        ids: list[bytes] = []
        for n in range(start, min(messages, start + batch)):
            index, rid = first + n, _repl_id(ids_from + n)
            ids.append(rid)
            if phase == "publish":
                # an encoded Published event is about the body plus ~80 bytes
                event = rid + properties + QUEUE.encode() + body
                live_rows.append(
                    [
                        vpn,
                        queue,
                        _field(rid),
                        _INT8.pack(8, index),
                        _field(b""),
                        queue,
                        _field(properties),
                        _field(body),
                    ]
                )
            else:
                event = rid + QUEUE.encode()  # an encoded Consumed event
            if site == "a":
                ledger_rows.append(
                    [
                        vpn,
                        _INT8.pack(8, index),
                        _INT8.pack(8, 1),
                        _field(phase.encode()),
                        _field(event),
                    ]
                )
        out.append(
            _Batch(
                _copy(ledger_rows) if ledger_rows else b"",
                _copy(live_rows) if live_rows else b"",
                ids,
                first + min(messages, start + batch) - 1,
            )
        )
    return out


_LEDGER_COPY = "COPY ledger (vpn, idx, epoch, kind, event) FROM STDIN (FORMAT binary)"
_LIVE_COPY = (
    "COPY live_message (vpn, queue, repl_id, publish_index, exchange, routing_key,"
    " properties, body) FROM STDIN (FORMAT binary)"
)
_A_INDEX = "UPDATE vpn_state SET ledger_index = %b WHERE vpn = %b"
_B_INDEX = "UPDATE vpn_state SET applied_index = %b WHERE vpn = %b"


def writer_main(
    site: str, dsn: str, phase: str, first: int, ids_from: int, messages: int, size: int, batch: int
) -> int:
    """One writer process: build the batches, say ``ready``, wait for a line
    on stdin, write them all, print the monotonic time it finished. Acks
    remove rows with the apply step's own statement and packed arrays."""
    # this script's directory holds bench/bridge.py, which shadows the package
    sys.path.remove(str(Path(__file__).resolve().parent))
    from bridge.ledger import DELETE_ACKED, bytea_array, text_array

    batches = _batches(site, phase, first, ids_from, messages, size, batch)
    deletes = [(VPN, text_array([QUEUE] * len(b.ids)), bytea_array(b.ids)) for b in batches]
    with psycopg.connect(dsn) as conn:
        print("ready", flush=True)
        sys.stdin.readline()
        for b, delete in zip(batches, deletes, strict=True):
            with conn.cursor() as cur:
                if site == "a":
                    with cur.copy(_LEDGER_COPY) as copy:
                        copy.write(b.ledger)
                if phase == "publish":
                    with cur.copy(_LIVE_COPY) as copy:
                        copy.write(b.live)
                else:
                    cur.execute(DELETE_ACKED, delete)
                    if cur.rowcount != len(b.ids):  # the floor must do the whole work
                        print(f"removed {cur.rowcount} of {len(b.ids)} rows", flush=True)
                        return 1
                cur.execute(_A_INDEX if site == "a" else _B_INDEX, (b.last, VPN))
            conn.commit()
    print(f"done {time.perf_counter():.9f}", flush=True)
    return 0


class Writer:
    """A writer subprocess, started and made ready before the clock starts."""

    def __init__(
        self, site: str, dsn: str, phase: str, first: int, ids_from: int, opts: Options
    ) -> None:
        argv = [sys.executable, __file__, "--writer", site, dsn, phase, str(first)]
        argv += [str(ids_from), str(opts.messages), str(opts.size), str(opts.batch)]
        self.proc = start_ready(argv, f"writer {site}")

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def finished_at(self) -> float:
        out, _ = self.proc.communicate(timeout=600)
        text = out.decode()
        if self.proc.returncode != 0 or not text.startswith("done "):
            raise BenchError(f"writer failed (exit {self.proc.returncode}): {text!r}")
        return float(text.split()[1])


# ---------------------------------------------------------------- the rounds


@dataclass
class Options:
    messages: int
    rounds: int
    inflight: int
    size: int
    batch: int


@dataclass
class Results:
    rates: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    cpu: dict[tuple[str, str], list[tuple[float, float, float]]] = field(default_factory=dict)


class Bench:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.sites = LocalSites()
        self.index = 0  # the last ledger index written (writers use the next ones)
        self.ids_from = 1  # the replication ids the last publish run wrote start here

    def start(self) -> None:
        t0 = time.monotonic()
        self.sites.start()
        a, b = self.sites.a, self.sites.b
        print(f"two RabbitMQ nodes + two PostgreSQL clusters up in {time.monotonic() - t0:.0f} s")
        a.rabbit.add_vhost(VPN)
        base = self.sites.base
        cfg_a = a.write_config(base / "a.toml", peer=b, dial=False)
        cfg_b = b.write_config(base / "b.toml", peer=a)
        vpnrepl(cfg_a, "init")
        vpnrepl(cfg_a, "vpn", "enable", VPN, "--role", "active")
        vpnrepl(cfg_b, "init")
        vpnrepl(cfg_b, "vpn", "enable", VPN, "--role", "standby")

    def cpu(self) -> tuple[float, float, float]:
        beam = beam_pid(self.sites.a.rabbit.pidfile)
        return (
            tree_cpu(beam) or 0.0,
            tree_cpu(self.sites.a.pg.postmaster_pid()) or 0.0,
            tree_cpu(self.sites.b.pg.postmaster_pid()) or 0.0,
        )

    async def run(self, mode: str, phase: str) -> tuple[float, tuple[float, float, float]]:
        """One publish or consume run; returns messages/s and CPU µs per message
        (RabbitMQ A, PostgreSQL A, PostgreSQL B)."""
        opts, a = self.opts, self.sites.a
        writers: list[Writer] = []
        if mode != "direct":
            first = self.index + 1
            if phase == "publish":
                self.ids_from = first
            writers.append(Writer("a", a.pg.dsn(), phase, first, self.ids_from, opts))
            if mode == "floor A+B":
                writers.append(
                    Writer("b", self.sites.b.pg.dsn(), phase, first, self.ids_from, opts)
                )
            self.index += opts.messages
        port = a.rabbit.amqp_port
        cpu0 = self.cpu()
        t0 = time.perf_counter()
        for w in writers:
            w.go()
        if phase == "publish":
            pub: LeanPublisher = await LeanPublisher.connect(port, VPN, QUEUE)
            try:
                await pub.publish(mode, opts.messages, opts.inflight, opts.size)
            finally:
                await pub.close()
        else:
            con: LeanConsumer = await LeanConsumer.connect(port, VPN, QUEUE, prefetch=500)
            try:
                await con.consume(mode, opts.messages)
            finally:
                await con.close()
        end = time.perf_counter()
        for w in writers:
            end = max(end, w.finished_at())
        cpu1 = self.cpu()
        per = tuple((c1 - c0) / opts.messages * 1e6 for c0, c1 in zip(cpu0, cpu1, strict=True))
        return opts.messages / (end - t0), (per[0], per[1], per[2])


async def rounds(bench: Bench, opts: Options) -> Results:
    results = Results()
    con: LeanConsumer = await LeanConsumer.connect(bench.sites.a.rabbit.amqp_port, VPN, QUEUE)
    await con.declare()
    await con.close()
    for r in range(opts.rounds):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        line = []
        for mode in order:
            for phase in ("publish", "consume"):
                rate, cpu = await bench.run(mode, phase)
                results.rates.setdefault((mode, phase), []).append(rate)
                results.cpu.setdefault((mode, phase), []).append(cpu)
                line.append(f"{mode} {phase} {rate:,.0f}/s")
        print(f"round {r + 1}: " + " | ".join(line), flush=True)
    return results


def report(results: Results, opts: Options) -> None:
    print()
    print(f"{'run':30} {'median/s':>9} {'rmqA':>6} {'pgA':>6} {'pgB':>6}   (CPU µs per message)")
    for (mode, phase), rates in results.rates.items():
        cpu = results.cpu[(mode, phase)]
        cpu_med = [statistics.median(c[i] for c in cpu) for i in range(3)]
        print(
            f"{mode + ' ' + phase:30} {statistics.median(rates):9,.0f} "
            f"{cpu_med[0]:6.1f} {cpu_med[1]:6.1f} {cpu_med[2]:6.1f}"
        )
    print(
        f"\n{opts.messages} x {opts.size} B persistent per run, {opts.inflight} in flight, "
        f"{opts.rounds} rounds, database batches of {opts.batch}"
    )
    for phase in ("publish", "consume"):
        direct = results.rates[("direct", phase)]
        for mode in MODES[1:]:
            ratios = [f / d for f, d in zip(results.rates[(mode, phase)], direct, strict=True)]
            med = statistics.median(ratios)
            verdict = "below" if med < BARS[phase] else "at or above"
            print(
                f"{phase} with the {mode} database floor / direct = {med:.2f} "
                f"(per round {min(ratios):.2f}..{max(ratios):.2f}; {verdict} the "
                f"bar of {BARS[phase]:.2f})"
            )
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average at the end: {load}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--writer"]:
        site, dsn, phase = argv[1:4]
        first, ids_from, messages, size, batch = (int(x) for x in argv[4:9])
        return writer_main(site, dsn, phase, first, ids_from, messages, size, batch)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=10000, help="per run (default 10000)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--inflight", type=int, default=500, help="unconfirmed publishes (default 500)")
    p.add_argument("--size", type=int, default=1024, help="body bytes (default 1024)")
    p.add_argument("--batch", type=int, default=500, help="messages per database commit")
    a = p.parse_args(argv)
    if min(a.messages, a.rounds, a.inflight, a.size, a.batch) < 1:
        p.error("--messages, --rounds, --inflight, --size and --batch must be >= 1")
    opts = Options(a.messages, a.rounds, a.inflight, a.size, a.batch)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    bench = Bench(opts)
    try:
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"load average before start: {load} ({os.cpu_count()} CPUs)")
        bench.start()
        report(uvloop.run(rounds(bench, opts)), opts)
        return 0
    except (BenchError, HarnessError, psycopg.Error) as e:
        print(f"bench/floor.py: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench/floor.py: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        bench.sites.close()


if __name__ == "__main__":
    sys.exit(main())
