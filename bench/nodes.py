"""Several nodes per site: what a relaying node costs, how fast a leader is
replaced, and what a second node adds to a site's throughput.

Two local sites; site A runs two nodes (``a1`` leads first, ``a2``
relays), site B one. Three measurements, each against its baseline in the
same run, alternated where they are comparable:

* **relay latency**: publishes with one in flight to the leader directly
  and through the relaying node, in interleaved chunks; the added p50 and
  p99 (the issue's target: p50 at most 0.5 ms more).
* **takeover**: ``--kills`` times, SIGKILL the node that leads and time
  until a client that tries the site's nodes in turn has a publish
  confirmed again; the killed node is started again (it relays) before the
  next kill. p50 and max against the lease plus 5 s.
* **throughput by nodes**: a1 and a2 each pinned to a core of their own
  (``--no-pin``: not); two VPNs published at once, 500 in flight each,
  with every client on the leader (one node serves) and with one VPN's
  clients on the relaying node (two nodes serve), alternated per
  round. One node leads all of a site's VPNs in this release, so the
  second node can only add its relay's cost; the ratio says how much.

Run from the repository root: ``.venv/bin/python bench/nodes.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from urllib.parse import quote

import uvloop
from _common import BenchError, LeanPublisher, percentile, vpnrepl

from plugin.devtools import HarnessError, LocalNode, LocalSites, free_port

VPNS = ("orders", "audit")
QUEUE = "bench.nodes"


class TwoNodeSite:
    """Sites A (nodes a1, a2) and B (one node), VPNs enabled, all up."""

    def __init__(self, lease: float, pinned: bool = True) -> None:
        self.lease = lease
        self.pinned = pinned
        self.sites = LocalSites()
        self.a, self.b = self.sites.a, self.sites.b
        self.ports: dict[str, tuple[int, int, int]] = {}
        self.nodes: dict[str, LocalNode] = {}

    def start(self) -> None:
        self.sites.start()
        a, b, base = self.a, self.b, self.sites.base
        for vpn in VPNS:
            a.rabbit.add_vhost(vpn)
            a.rabbit.api("PUT", f"queues/{quote(vpn, safe='')}/{QUEUE}", {"durable": True})
        self.ports = {
            "a1": (a.amqp_port, a.bridge_port, a.admin_port),
            "a2": (free_port(), free_port(), free_port()),
        }
        cfg_a = base / "a.toml"
        cfg_a.write_text(a.config_text(b, dial=False, nodes=self.ports, lease_seconds=self.lease))
        cfg_b = base / "b.toml"
        cfg_b.write_text(b.config_text(a, peer_bridges=[p[1] for p in self.ports.values()]))
        vpnrepl(cfg_a, "init")
        vpnrepl(cfg_b, "init")
        for vpn in VPNS:
            vpnrepl(cfg_a, "vpn", "enable", vpn, "--role", "active")
        for name, (_, _, admin) in self.ports.items():
            self.nodes[name] = LocalNode(
                a, cfg_a, base / f"node-{name}.log", node=name, admin_port=admin
            )
        self.nodes["b"] = LocalNode(b, cfg_b, base / "node-b.log", name="b")
        for node in self.nodes.values():
            node.start()
        self.pin()

    def pin(self) -> None:
        """Site A's nodes each on a core of their own (a1 on the first, a2
        on the second), as the issue measures them; again after a restart."""
        cores = sorted(os.sched_getaffinity(0))
        if not self.pinned or len(cores) < 2:
            return
        for core, name in zip(cores, ("a1", "a2"), strict=False):
            pid = self.nodes[name].pid
            if pid is not None:
                os.sched_setaffinity(pid, {core})

    def amqp(self, name: str) -> int:
        return self.ports[name][0]

    def leader(self) -> str:
        for name in ("a1", "a2"):
            node = self.nodes[name]
            if node.alive():
                try:
                    if node.status().get("leads"):
                        return name
                except OSError:
                    continue
        raise BenchError("no node of site A leads")

    def close(self) -> None:
        for node in self.nodes.values():
            node.kill()
        self.sites.close()


async def one_in_flight(port: int, vpn: str, messages: int) -> list[float]:
    pub = await LeanPublisher.connect(port, vpn, QUEUE)
    try:
        result = await pub.publish(f"{port}", messages, 1, 1024)
    finally:
        await pub.close()
    return result.latencies


async def relay_latency(site: TwoNodeSite, messages: int, chunks: int) -> None:
    leader = site.leader()
    other = "a2" if leader == "a1" else "a1"
    lat: dict[str, list[float]] = {"direct": [], "relayed": []}
    for _ in range(chunks):
        for how, node in (("direct", leader), ("relayed", other)):
            lat[how] += await one_in_flight(site.amqp(node), VPNS[0], messages // chunks)
    p50 = {k: percentile(v, 0.5) * 1e3 for k, v in lat.items()}
    p99 = {k: percentile(v, 0.99) * 1e3 for k, v in lat.items()}
    print(f"\nrelay latency, 1 KiB, 1 in flight, {messages} per path in {chunks} chunks:")
    for how in lat:
        print(f"  {how:8} p50 {p50[how]:6.2f} ms   p99 {p99[how]:6.2f} ms")
    print(
        f"  added by the relay: p50 {p50['relayed'] - p50['direct']:+.2f} ms "
        f"(target <= 0.5 ms), p99 {p99['relayed'] - p99['direct']:+.2f} ms"
    )


async def confirmed_once(ports: list[int]) -> bool:
    """One publish confirmed through the first node of ``ports`` that takes it."""
    for port in ports:
        try:
            async with asyncio.timeout(2):
                pub = await LeanPublisher.connect(port, VPNS[0], QUEUE)
                try:
                    await pub.publish("probe", 1, 1, 64)
                finally:
                    await pub.close()
            return True
        except (OSError, BenchError, TimeoutError):
            continue
    return False


async def takeovers(site: TwoNodeSite, kills: int) -> None:
    times: list[float] = []
    ports = [site.amqp("a1"), site.amqp("a2")]
    for n in range(kills):
        leader = site.leader()
        node = site.nodes[leader]
        killed = time.monotonic()
        node.kill()
        while not await confirmed_once(ports):
            if time.monotonic() - killed > 120:
                raise BenchError(f"kill {n + 1}: no confirm within 120 s")
            await asyncio.sleep(0.05)
        times.append(time.monotonic() - killed)
        node.start()  # relays from now on
        site.pin()
        print(f"  kill {n + 1:2}: {leader} killed, served again after {times[-1]:.2f} s")
    bound = site.lease + 5.0
    print(
        f"\ntakeover over {kills} leader kills (lease {site.lease:g} s): "
        f"p50 {statistics.median(times):.2f} s, max {max(times):.2f} s "
        f"(target max <= lease + 5 = {bound:g} s: {'met' if max(times) <= bound else 'NOT met'})"
    )


async def both_vpns(ports: tuple[int, int], messages: int) -> float:
    """Msg/s of the two VPNs published at once, 500 in flight each."""
    pubs = [await LeanPublisher.connect(p, vpn, QUEUE) for p, vpn in zip(ports, VPNS, strict=True)]
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(p.publish("both", messages, 500, 1024) for p in pubs))
        return 2 * messages / (time.perf_counter() - t0)
    finally:
        for p in pubs:
            await p.close()


async def throughput(site: TwoNodeSite, messages: int, rounds: int) -> None:
    leader = site.leader()
    other = "a2" if leader == "a1" else "a1"
    rates: dict[str, list[float]] = {"one node serves": [], "two nodes serve": []}
    for r in range(rounds):
        order = list(rates) if r % 2 == 0 else list(reversed(rates))
        for how in order:
            ports = (
                (site.amqp(leader), site.amqp(leader))
                if how == "one node serves"
                else (site.amqp(leader), site.amqp(other))
            )
            rates[how].append(await both_vpns(ports, messages))
    base = statistics.median(rates["one node serves"])
    print(f"\ntwo VPNs at once, {messages} x 1 KiB each, 500 in flight, {rounds} rounds:")
    for how, values in rates.items():
        median = statistics.median(values)
        print(f"  {how:16} {median:8.0f} msg/s  ratio {median / base:.2f}")
    print("  (one node leads every VPN of a site: a second node adds availability, not speed)")


async def run(opts: argparse.Namespace) -> None:
    site = TwoNodeSite(opts.lease, pinned=not opts.no_pin)
    try:
        site.start()
        print(f"site A: a1 and a2 (lease {opts.lease:g} s); site B: one node")
        await relay_latency(site, opts.probe, 5)
        await throughput(site, opts.messages, opts.rounds)
        await takeovers(site, opts.kills)
    finally:
        site.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lease", type=float, default=3.0, help="[site] lease_seconds (default 3)")
    p.add_argument("--kills", type=int, default=20, help="leader kills (default 20)")
    p.add_argument("--probe", type=int, default=2000, help="1-in-flight publishes per path")
    p.add_argument("--messages", type=int, default=10_000, help="per VPN per throughput run")
    p.add_argument("--rounds", type=int, default=3, help="throughput rounds (alternated)")
    p.add_argument(
        "--no-pin", action="store_true", help="leave a1 and a2 unpinned (default: a core each)"
    )
    opts = p.parse_args(argv)
    try:
        uvloop.run(run(opts))
    except (BenchError, HarnessError) as e:
        print(f"bench/nodes.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
