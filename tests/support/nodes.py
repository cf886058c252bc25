"""Several nodes on one site: their configuration, and clients that, like a
real application given the site's node list, reconnect to the next node
when theirs goes away, recording what each was told."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pika
import pika.exceptions

from plugin.devtools import LocalSite, free_port
from tests.fault.checker import Fault, Final, History, Publish, Txn, check, table, violations
from tests.fix_node import NodeProcess
from tests.support.two_sites import (
    IN_SCOPE,
    VPN,
    body,
    drained,
    live,
    number,
    properties,
    queues_of,
    routing_key,
)

#: what a client connection may fail with while the site changes leader
LOST = (
    pika.exceptions.AMQPError,
    OSError,
    # pika's blocking adapter can surface a closed socket as these
    AssertionError,
    AttributeError,
)


class SiteNodes:
    """Site ``site``'s nodes ``a1``, ``a2``...: the first on the site's own
    ports, the others on free ones; one config file for all of them."""

    def __init__(
        self,
        site: LocalSite,
        peer: LocalSite,
        tmp: Path,
        count: int = 2,
        lease_seconds: float = 3.0,
        peer_bridges: list[int] | None = None,
    ) -> None:
        self.site = site
        self.names = [f"{site.name}{n}" for n in range(1, count + 1)]
        self.ports: dict[str, tuple[int, int, int]] = {
            name: (site.amqp_port, site.bridge_port, site.admin_port)
            if n == 0
            else (free_port(), free_port(), free_port())
            for n, name in enumerate(self.names)
        }
        text = site.config_text(
            peer, nodes=self.ports, lease_seconds=lease_seconds, peer_bridges=peer_bridges
        )
        self.config = tmp / f"{site.name}-nodes.toml"
        self.config.write_text(text)
        self.nodes = {
            name: NodeProcess(
                site, self.config, tmp / f"node-{name}.log", node=name,
                admin_port=self.ports[name][2],
            )
            for name in self.names
        }  # fmt: skip

    def __getitem__(self, name: str) -> NodeProcess:
        return self.nodes[name]

    def amqp_ports(self, first: str | None = None) -> list[int]:
        """Every node's AMQP port, ``first``'s first (a client's node list)."""
        order = sorted(self.names, key=lambda n: n != first)
        return [self.ports[n][0] for n in order]

    def bridge_ports(self) -> list[int]:
        return [self.ports[n][1] for n in self.names]

    def leader(self) -> str | None:
        """The node whose status says it leads, if one answers so."""
        for name, node in self.nodes.items():
            if not node.alive():
                continue
            try:
                doc = node.status()
            except OSError:
                continue
            if doc.get("leads", True):
                return name
        return None


def connect(ports: list[int], deadline: float = 60.0) -> pika.BlockingConnection:
    """A connection to the first node of ``ports`` that takes it, trying
    them in turn (as a client given the site's node list does)."""
    params = [
        pika.URLParameters(
            f"amqp://guest:guest@127.0.0.1:{p}/{VPN}?connection_attempts=1&socket_timeout=5"
            "&blocked_connection_timeout=30&heartbeat=5"
        )
        for p in ports
    ]
    end = time.monotonic() + deadline
    while True:
        try:
            return pika.BlockingConnection(params)
        except LOST:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


class Client(threading.Thread):
    """A client thread that reconnects across the site's nodes until
    :meth:`finish`; ``told`` holds what it was told, with the time of each
    answer, ``uncertain`` what it sent without an answer, ``closes`` why
    each connection ended."""

    def __init__(self, name: str, ports: list[int]) -> None:
        super().__init__(name=name, daemon=True)
        self.ports = ports
        self.told: dict[int, float] = {}
        self.uncertain: set[int] = set()
        self.closes: list[str] = []
        self.reconnects: list[float] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            try:
                conn = connect(self.ports)
            except LOST as e:
                self.closes.append(f"connect: {e!r}")
                continue
            try:
                self.work(conn)
                with contextlib.suppress(*LOST):
                    conn.close()
                return
            except LOST as e:
                self.closes.append(repr(e))
                self.reconnects.append(time.monotonic())
                with contextlib.suppress(*LOST):
                    conn.close()

    def work(self, conn: pika.BlockingConnection) -> None:
        raise NotImplementedError

    def finish(self, timeout: float = 60.0) -> None:
        self._done.set()
        self.join(timeout)
        assert not self.is_alive(), f"{self.name} still running after {timeout:g} s"

    def served_again(self, when: float) -> float | None:
        """Seconds from ``when`` to the first answer on a connection made
        after it (the client lost its connection at or after ``when``)."""
        again = [t for t in self.reconnects if t >= when]
        first = self.first_after(again[0]) if again else None
        return again[0] - when + first if again and first is not None else None

    def first_after(self, when: float) -> float | None:
        """Seconds from ``when`` to the first answer after it."""
        after = [t for t in self.told.values() if t > when]
        return min(after) - when if after else None


class ConfirmingPublisher(Client):
    """Publishes numbered messages from ``first`` one at a time with
    publisher confirms; ``told``: the confirmed ones."""

    def __init__(self, ports: list[int], first: int, pause: float = 0.0) -> None:
        super().__init__(f"publisher-{first}", ports)
        self.next = first
        self.nacked: set[int] = set()
        self.pause = pause

    def work(self, conn: pika.BlockingConnection) -> None:
        ch = conn.channel()
        ch.confirm_delivery()
        while not self._done.is_set():
            n = self.next
            self.next += 1
            self.uncertain.add(n)
            try:
                ch.basic_publish("events", routing_key(n), body(n), properties(n))
            except pika.exceptions.NackError:
                self.nacked.add(n)
                continue
            self.uncertain.discard(n)
            self.told[n] = time.monotonic()
            if self.pause:
                time.sleep(self.pause)


class TxPublisher(Client):
    """Publishes numbered messages in transactions of five; ``told``: the
    messages whose ``tx.commit-ok`` came; ``batches``: every batch sent."""

    def __init__(self, ports: list[int], first: int) -> None:
        super().__init__(f"tx-{first}", ports)
        self.next = first
        self.batches: list[list[int]] = []

    def work(self, conn: pika.BlockingConnection) -> None:
        ch = conn.channel()
        ch.tx_select()
        while not self._done.is_set():
            batch = list(range(self.next, self.next + 5))
            self.next += 5
            self.batches.append(batch)
            self.uncertain.update(batch)
            for m in batch:
                ch.basic_publish("events", routing_key(m), body(m), properties(m))
            ch.tx_commit()
            self.uncertain.difference_update(batch)
            now = time.monotonic()
            for m in batch:
                self.told[m] = now


class AckingConsumer(Client):
    """Consumes ``queue`` and acks each delivery; ``told``: the acked ones."""

    def __init__(self, ports: list[int], queue: str) -> None:
        super().__init__(f"consumer-{queue}", ports)
        self.queue = queue

    def work(self, conn: pika.BlockingConnection) -> None:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=20)
        for method, _, payload in ch.consume(self.queue, inactivity_timeout=0.5):
            if self._done.is_set():
                return
            if method is None:
                continue
            ch.basic_ack(method.delivery_tag)
            self.told[number(payload)] = time.monotonic()


def queue_contents(ports: list[int], queue: str) -> list[int]:
    """The numbers in ``queue``, in queue order, read through the site's
    nodes (unacked: they go back)."""
    return drained(connect(ports), queue)


def judged(
    mode: str,
    policy: str,
    clients: list[Client],
    faults: list[Fault],
    ports: list[int],
    active: LocalSite,
    standby: LocalSite,
) -> str:
    """The fault suite's checker on what ``clients`` were told against
    what the sites hold (the active's broker read through ``ports``, both
    live states): "" when nothing breaks ``mode``'s promise, else its
    table of verdicts. Acks are counted unsure (no synchronous call after
    them); a transaction is judged on ``orders.q2``, where all its
    messages go."""
    history = History(mode, policy, faults=faults, consumed_queues=frozenset({"orders.q1"}))
    for i, client in enumerate(clients):
        if isinstance(client, ConfirmingPublisher):
            for n in client.told:
                history.published[n] = Publish(queues_of(n), "confirmed", i)
            for n in client.uncertain:
                history.published[n] = Publish(queues_of(n), "uncertain", i)
            for n in client.nacked:
                history.published[n] = Publish(queues_of(n), "nacked", i)
        elif isinstance(client, TxPublisher):
            for batch in client.batches:
                outcome = "committed" if batch[0] in client.told else "uncertain"
                history.txns.append(Txn(tuple(batch), ("orders.q2",), outcome))
        elif isinstance(client, AckingConsumer):
            history.acks_unsure.update((n, client.queue) for n in client.told)
    final = Final(
        broker={q: queue_contents(ports, q) for q in IN_SCOPE},
        active_live=_live_sets(active),
        standby_live=_live_sets(standby),
    )
    verdicts = check(history, final)
    return table(verdicts) if violations(history, verdicts) else ""


def _live_sets(site: LocalSite) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for row in live(site):
        out.setdefault(str(row[0]), set()).add(number(bytes(row[6])))
    return out
