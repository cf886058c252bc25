"""What RabbitMQ charges for a message's property bytes, direct to the broker.

Why this script exists: the listener adds one header, ``x-vpnrepl-id``, to
every replicated message. RabbitMQ 3.10 (Erlang/OTP 25) spends markedly more
CPU per persistent message once the content header's properties pass 64
bytes (Erlang copies binaries up to 64 bytes onto a process heap and keeps
larger ones reference-counted), so *how many bytes* the id adds decides what
replication costs the broker for compact messages. This script measures it
without the listener: the lean publisher of the other benchmarks (500 in
flight, 1 KiB persistent) publishes, interleaved, messages whose properties
are

* ``bare``: delivery mode + a 24-byte content type (28 bytes), the listener
  benchmark's message as the client sends it;
* ``int64 id``: the same plus our header as an int64 (54 bytes), what the
  listener sends now;
* ``hex id``: the same plus our header as 32 hex digits (82 bytes), what it
  sent before;
* ``bare, 76 bytes``: no header at all, a longer content type: the cost
  comes from the size, not from the header.

It prints each variant's median rate relative to ``bare`` and RabbitMQ's CPU
per message. Run from the repository root: ``.venv/bin/python bench/properties.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from collections.abc import Callable

import _common
from _common import BenchError, LeanPublisher, process_cpu
from pamqp import body, commands, frame, header
from pamqp.common import FieldTable

from bridge import REPLICATION_HEADER, ReplicationId
from plugin.devtools import HarnessError, LocalSites, RabbitNode

_TYPE = "application/octet-stream"
_ID = ReplicationId.from_parts(123_456, 7_890_123)
VARIANTS: dict[str, tuple[FieldTable | None, str]] = {
    "bare": (None, _TYPE),
    "int64 id": ({REPLICATION_HEADER: _ID.wire}, _TYPE),
    "hex id": ({REPLICATION_HEADER: _ID.hex}, _TYPE),
    "bare, 76 bytes": (None, _TYPE * 3),
}


def _encoder(headers: FieldTable | None, content_type: str) -> Callable[..., bytes]:
    def encode(channel: int, size: int, frame_max: int, queue: str) -> bytes:
        if size > frame_max - 8:
            raise BenchError("one body frame per message: keep --size below frame-max")
        props = commands.Basic.Properties(
            delivery_mode=2, content_type=content_type, headers=headers
        )
        return b"".join(
            (
                frame.marshal(commands.Basic.Publish(exchange="", routing_key=queue), channel),
                frame.marshal(header.ContentHeader(0, size, props), channel),
                frame.marshal(body.ContentBody(os.urandom(size)), channel),
            )
        )

    return encode


def property_bytes(variant: str) -> int:
    headers, content_type = VARIANTS[variant]
    props = commands.Basic.Properties(delivery_mode=2, content_type=content_type, headers=headers)
    return len(header.ContentHeader(0, 0, props).marshal()) - 12


async def measure(rabbit: RabbitNode, rounds: int, messages: int) -> None:
    pid = int(rabbit.pidfile.read_text().strip())
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for n in range(1, rounds + 1):
        line = []
        for i, (variant, (headers, content_type)) in enumerate(VARIANTS.items()):
            # the publisher encodes its message through this module function
            _common.encode_message = _encoder(headers, content_type)
            pub = await LeanPublisher.connect(rabbit.amqp_port, f"props-{i}", "q")
            try:
                await pub.purge()
                before = process_cpu(pid)
                result = await pub.publish(variant, messages, 500, 1024)
                after = process_cpu(pid)
                if await pub.purge() != messages:
                    raise BenchError(f"{variant}: the queue does not hold every confirmed message")
            finally:
                await pub.close()
            rates[variant].append(result.rate)
            if before is not None and after is not None:
                cpu[variant].append((after - before) / messages * 1e6)
            line.append(f"{variant} {result.rate:7.0f}")
        print(f"round {n}: " + " | ".join(line), flush=True)
    base = statistics.median(rates["bare"])
    head = ("properties", "bytes", "median msg/s", "/ bare", "broker cpu")
    print("\n{:<16} {:>5} {:>13} {:>7} {:>11}".format(*head))
    for variant in VARIANTS:
        rate = statistics.median(rates[variant])
        us = f"{statistics.median(cpu[variant]):.1f} us" if cpu[variant] else "-"
        print(
            f"{variant:<16} {property_bytes(variant):>5} {rate:>13.0f} {rate / base:>7.2f} {us:>11}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--messages", type=int, default=20000, help="per run")
    opts = parser.parse_args(argv)
    sites = LocalSites()
    rabbit = sites.a.rabbit
    try:
        rabbit.launch()
        rabbit.wait_ready()
        for i in range(len(VARIANTS)):
            rabbit.add_vhost(f"props-{i}")
            rabbit.api("PUT", f"queues/props-{i}/q", {"durable": True})
        asyncio.run(measure(rabbit, opts.rounds, opts.messages))
    except (BenchError, HarnessError) as e:
        print(f"benchmark failed: {e}", file=sys.stderr)
        return 1
    finally:
        sites.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
