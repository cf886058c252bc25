"""Metrics for Prometheus, exposed through ``prometheus_client``.

The hot path never calls into a metrics library: the listener keeps plain
counters (:class:`ListenerStats`, a :class:`Buckets` per VPN and mode for the
confirm delay), the ledger writer and the coordinator keep theirs, and a
custom collector reads them all when ``/metrics`` is scraped. Per-VPN state
(lag, indexes, eligibility, bridge, in-doubt transactions) comes from the
same status document ``vpnrepl status --json`` prints, read at scrape time,
so the two never disagree. ``prometheus_client`` writes the exposition
format; nothing here renders text by hand.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from bridge import TlsConfig
from bridge.ledger import WriterStats
from plugin.tls import not_after
from txn.branches import XaStats
from txn.local import TxnStats

__all__ = ["CONTENT_TYPE", "Buckets", "ListenerStats", "Metrics"]

#: the ``Content-Type`` of :meth:`Metrics.render`: the text format 0.0.4,
#: which every Prometheus reads (``prometheus_client`` writes the same text
#: for the names here, all of them valid in 0.0.4, under "1.0.0" since 0.22)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: upper bounds (seconds) of the confirm-delay buckets: a sync confirm waits
#: for two commits and a round trip (a few ms); a degrading one for the sync
#: timeout (default 2 s)
CONFIRM_DELAY_BOUNDS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

#: upper bounds of the ledger commit size buckets (entries per transaction)
COMMIT_ENTRIES_BOUNDS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


class Buckets:
    """A histogram's state, cheap to update inline: one ``bisect`` and two
    additions per observation."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = CONFIRM_DELAY_BOUNDS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, count)`` pairs as the exposition format has them."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


@dataclass
class ListenerStats:
    """Counters the listener bumps inline."""

    connections_open: int = 0
    connections_total: int = 0
    #: client connections refused for listen.max_connections
    connections_refused: int = 0
    #: reply code -> client connections closed by the listener for bad input
    protocol_closes: Counter[int] = field(default_factory=Counter)
    #: broker node (HOST:PORT) -> client upstream connects it refused
    broker_connect_failures: Counter[str] = field(default_factory=Counter)
    #: (vpn, mode) -> how long publisher confirms were held for replication
    confirm_held: dict[tuple[str, str], Buckets] = field(default_factory=dict)

    def confirm_delay(self, vpn: str, mode: str) -> Buckets:
        """The buckets a connection of ``vpn`` in ``mode`` observes into."""
        key = (vpn, mode)
        buckets = self.confirm_held.get(key)
        if buckets is None:
            buckets = self.confirm_held[key] = Buckets()
        return buckets


class Metrics:
    """One registry per node; :meth:`render` is the ``/metrics`` body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._listener: ListenerStats | None = None
        self._txn: TxnStats | None = None
        self._xa: XaStats | None = None
        #: vhost -> forged commit markers a sweep removed
        self._forged_markers: Mapping[str, int] | None = None
        self._bound: Mapping[str, int] | None = None
        self._ledger: WriterStats | None = None
        self._sync_counts: Callable[[], Mapping[str, tuple[int, int]]] | None = None
        self._not_ours: Callable[[], int] | None = None
        #: role ("site", "ca") -> when the bridge's certificate expires
        self._expiry: dict[str, float] = {}
        #: the status document of the scrape under way (None: the store was
        #: unreachable)
        self._status: dict[str, Any] | None = None
        self.registry.register(_Collector(self))

    def observe_listener(self, stats: ListenerStats) -> None:
        self._listener = stats

    def observe_txn(self, stats: TxnStats) -> None:
        self._txn = stats

    def observe_xa(self, stats: XaStats) -> None:
        self._xa = stats

    def observe_markers(self, forged: Mapping[str, int]) -> None:
        """VPN -> messages in its commit-marker queue that were no marker."""
        self._forged_markers = forged

    def observe_ledger_bound(self, unacknowledged: Mapping[str, int]) -> None:
        """VPN -> ledger entries pruned before the standby acknowledged them."""
        self._bound = unacknowledged

    def observe_ledger(self, stats: WriterStats) -> None:
        self._ledger = stats

    def observe_config_sync(self, not_ours: Callable[[], int]) -> None:
        """``not_ours()``: users config-sync left alone (this site made them)."""
        self._not_ours = not_ours

    def observe_certificates(self, tls: TlsConfig) -> None:
        """The bridge's certificate and CA, read now (at start, and again
        at each SIGHUP): their expiry, for the alert before it bites."""
        files = {"site": tls.cert, "ca": tls.ca}
        self._expiry = {
            role: when
            for role, path in files.items()
            if path is not None and (when := not_after(path)) is not None
        }

    def observe_sync(self, counts: Callable[[], Mapping[str, tuple[int, int]]]) -> None:
        """``counts()``: VPN -> (sync timeouts that cost eligibility, confirms
        nacked waiting for a window's record)."""
        self._sync_counts = counts

    def render(self, status: dict[str, Any] | None = None) -> bytes:
        """The exposition text; ``status`` is this site's status document
        (``None`` when its store could not be read: ``vpnrepl_store_up 0``
        and no per-VPN state)."""
        self._status = status
        try:
            return generate_latest(self.registry)
        finally:
            self._status = None


class _Collector:
    """Reads every source when the registry is collected."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        if m._listener is not None:
            yield from _listener_families(m._listener)
        if m._txn is not None:
            yield _counter(
                "vpnrepl_txn",
                "local transactions coordinated here, by VPN and outcome",
                ("vpn", "outcome"),
                m._txn.outcomes,
            )
            yield _counter(
                "vpnrepl_txn_applied_ahead",
                "transactions the standby committed before their ledger stream copy",
                ("vpn",),
                m._txn.committed_early,
            )
        if m._forged_markers is not None:
            yield _counter(
                "vpnrepl_commit_markers_forged",
                "messages found in a VPN's commit-marker queue without this site's tag"
                " (routed there by a client), removed and not believed",
                ("vpn",),
                m._forged_markers,
            )
        if m._xa is not None:
            yield _counter(
                "vpnrepl_xa",
                "client XA branches handled here, by VPN and outcome (committed, rolled_back,"
                " refused, read_only, hazard, heuristic_commit, heuristic_rollback)",
                ("vpn", "outcome"),
                m._xa.outcomes,
            )
        if m._bound is not None:
            yield _counter(
                "vpnrepl_ledger_pruned_unacknowledged",
                "ledger entries pruned past [replication] ledger_max_bytes before the standby"
                " acknowledged them (it resyncs from a checkpoint)",
                ("vpn",),
                m._bound,
            )
        if m._ledger is not None:
            yield _counter(
                "vpnrepl_events",
                "replication events committed to the ledger, by kind (those of a "
                "local transaction or an XA branch at its commit)",
                ("vpn", "kind"),
                m._ledger.events,
            )
            yield _commit_entries(m._ledger)
            yield CounterMetricFamily(
                "vpnrepl_ledger_confirms_nacked_late",
                "client confirms nacked after waiting past the ledger's answer timeout for a "
                "store that did not answer (their entries commit once it does)",
                value=m._ledger.answered_late,
            )
        if m._not_ours is not None:
            yield GaugeMetricFamily(
                "vpnrepl_configsync_users_not_ours",
                "users the active lists that exist on this site and that config-sync did not"
                " create: left as they are (their passwords and tags are this site's)",
                value=m._not_ours(),
            )
        if m._expiry:
            expiry = GaugeMetricFamily(
                "vpnrepl_tls_certificate_expiry_seconds",
                "seconds until the bridge's certificate (role site) or its CA (role ca)"
                " expires, as read at start or at the last SIGHUP",
                labels=["role"],
            )
            now = time.time()
            for role, when in sorted(m._expiry.items()):
                expiry.add_metric([role], when - now)
            yield expiry
        yield from _vpn_families(m._status, m._sync_counts)


def _counter(
    name: str, doc: str, labels: tuple[str, ...], counts: Mapping[Any, int]
) -> CounterMetricFamily:
    """A counter family from ``counts``, whose keys are the label values (a
    tuple, or the one value when there is one label)."""
    family = CounterMetricFamily(name, doc, labels=list(labels))
    for key, n in list(counts.items()):
        values = key if isinstance(key, tuple) else (key,)
        family.add_metric([str(v) for v in values], n)
    return family


def _listener_families(stats: ListenerStats) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "vpnrepl_client_connections_open",
        "client connections open through the listener",
        value=stats.connections_open,
    )
    yield CounterMetricFamily(
        "vpnrepl_client_connections",
        "client connections accepted by the listener",
        value=stats.connections_total,
    )
    yield CounterMetricFamily(
        "vpnrepl_client_connections_refused",
        "client connections refused (320) because listen.max_connections were open",
        value=stats.connections_refused,
    )
    yield _counter(
        "vpnrepl_protocol_closes",
        "client connections closed for bad input, by AMQP reply code",
        ("reply_code",),
        stats.protocol_closes,
    )
    yield _counter(
        "vpnrepl_broker_connect_failures",
        "client upstream connections a broker node of the site refused or did not "
        "answer (the client went to the next node), by node",
        ("broker",),
        stats.broker_connect_failures,
    )
    delay = HistogramMetricFamily(
        "vpnrepl_confirm_delay_seconds",
        "time a publisher confirm was held for replication (ledger commit, and "
        "in sync mode the standby's), by VPN and mode",
        labels=["vpn", "mode"],
    )
    for (vpn, mode), buckets in list(stats.confirm_held.items()):
        delay.add_metric([vpn, mode], buckets.cumulative(), buckets.total)
    yield delay


def _commit_entries(stats: WriterStats) -> HistogramMetricFamily:
    buckets = Buckets(COMMIT_ENTRIES_BOUNDS)
    for size, n in list(stats.batch_sizes.items()):
        buckets.counts[bisect.bisect_left(buckets.bounds, size)] += n
        buckets.total += size * n
    family = HistogramMetricFamily(
        "vpnrepl_ledger_commit_entries",
        "ledger entries written by one database transaction (group commit)",
    )
    family.add_metric([], buckets.cumulative(), buckets.total)
    return family


#: status document key -> (metric, help, kind) for the per-VPN state
_VPN_GAUGES = (
    ("lag_events", "vpnrepl_replication_lag_events", "ledger entries the standby has not applied"),
    (
        "lag_seconds",
        "vpnrepl_replication_lag_seconds",
        "age of the oldest ledger entry the standby has not applied (0 when caught up)",
    ),
    ("ledger_index", "vpnrepl_ledger_index", "index of the VPN's newest ledger entry on this site"),
    (
        "applied_index",
        "vpnrepl_applied_index",
        "newest ledger index the standby applied (on an active: as the standby acknowledged it)",
    ),
    ("sync_eligible", "vpnrepl_sync_eligible", "1 when sync mode confirms only after the standby"),
    ("fenced", "vpnrepl_fenced", "1 when the peer took the VPN over at a newer epoch"),
    ("epoch", "vpnrepl_epoch", "the VPN's current epoch as this site knows it"),
    (
        "in_doubt_txns",
        "vpnrepl_in_doubt_transactions",
        "prepared local transactions whose outcome is not decided yet",
    ),
)


#: per-VPN gauges computed from a VPN's status document
_VPN_DERIVED: tuple[tuple[str, str, Callable[[dict[str, Any]], float]], ...] = (
    (
        "vpnrepl_uncertain_publishes",
        "replicated publishes still live whose broker confirm never came (the broker"
        " connection died): possible phantoms, until consumed or retired by reconcile",
        lambda v: v.get("uncertain_publishes", 0),
    ),
    (
        "vpnrepl_split_brain",
        "1 when this site learnt that both sites held the VPN active at once (the same"
        " epoch, or a higher one elsewhere while this site kept confirming): demote one",
        lambda v: 1 if v.get("split_brain") else 0,
    ),
    (
        "vpnrepl_topology_changes_streamed",
        "topology changes a standby holds above the active's last definitions listing (a"
        " promotion imports them with it; a number that only grows: the listings fail)",
        lambda v: v.get("definitions", {}).get("streamed_changes", 0),
    ),
)


def _vpn_families(
    status: dict[str, Any] | None, sync_counts: Callable[[], Mapping[str, tuple[int, int]]] | None
) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "vpnrepl_store_up",
        "1 when this site's database answered the scrape's status read",
        value=1 if status is not None else 0,
    )
    if status is not None:
        yield GaugeMetricFamily(
            "vpnrepl_bridge_authenticated",
            "1 when the bridge is mutual TLS between named sites; 0 when it is plain TCP"
            " ([insecure] plaintext_bridge: no peer is authenticated)",
            value=1 if status.get("bridge_authenticated", True) else 0,
        )
    vpns = status["vpns"] if status is not None else []
    info = GaugeMetricFamily(
        "vpnrepl_vpn_info",
        "one per replicated VPN: its role and mode here",
        labels=["vpn", "role", "mode"],
    )
    for v in vpns:
        info.add_metric([v["name"], v["role"], v["mode"]], 1)
    yield info
    for key, name, doc in _VPN_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["vpn"])
        for v in vpns:
            family.add_metric([v["name"]], float(v[key]))
        yield family
    connected = GaugeMetricFamily(
        "vpnrepl_bridge_connected",
        "1 while the VPN's bridge to the peer is up (connected or catching up)",
        labels=["vpn"],
    )
    unknown = CounterMetricFamily(
        "vpnrepl_unknown_acks",
        "acknowledgements the standby could not match to a replicated message",
        labels=["vpn"],
    )
    windows = CounterMetricFamily(
        "vpnrepl_sync_windows",
        "sync-ineligible windows recorded: ledger ranges the VPN confirmed without its"
        " standby (sync timeouts under degrade, degraded transactions)",
        labels=["vpn"],
    )
    for v in vpns:
        connected.add_metric([v["name"]], 1 if v["bridge"] in ("connected", "syncing") else 0)
        unknown.add_metric([v["name"]], v["unknown_acks"])
        windows.add_metric([v["name"]], v.get("sync_windows_total", 0))
    yield connected
    yield unknown
    yield windows
    degraded = CounterMetricFamily(
        "vpnrepl_sync_degraded",
        "times a sync-mode VPN's standby missed the sync timeout and the VPN "
        "became sync-ineligible, since the node started",
        labels=["vpn"],
    )
    unrecorded = CounterMetricFamily(
        "vpnrepl_sync_confirms_nacked_unrecorded",
        "confirms of a sync-ineligible window nacked after waiting 10 s for the store"
        " to record the window's opening, since the node started",
        labels=["vpn"],
    )
    counts = sync_counts() if sync_counts is not None else {}
    for v in vpns:
        if v["role"] == "active":
            degradations, nacked = counts.get(v["name"], (0, 0))
            degraded.add_metric([v["name"]], degradations)
            unrecorded.add_metric([v["name"]], nacked)
    yield degraded
    yield unrecorded
    branches = GaugeMetricFamily(
        "vpnrepl_xa_branches",
        "client XA branches this site coordinates, by kind: prepared (awaiting their"
        " transaction manager), heuristic and hazards (not forgotten yet)",
        labels=["vpn", "kind"],
    )
    for v in vpns:
        for kind, n in v.get("xa", {}).items():
            branches.add_metric([v["name"], kind], n)
    yield branches
    for name, doc, value in _VPN_DERIVED:
        family = GaugeMetricFamily(name, doc, labels=["vpn"])
        for v in vpns:
            family.add_metric([v["name"]], value(v))
        yield family
    yield from _reconcile_families(vpns)


def _reconcile_families(vpns: list[dict[str, Any]]) -> Iterator[Metric]:
    """The newest ``vpnrepl reconcile`` run of each VPN (its row in the
    site's ``reconcile_run``)."""
    differences = GaugeMetricFamily(
        "vpnrepl_reconcile_differences",
        "differences the newest reconcile run left, by kind (broker_drift: queues)",
        labels=["vpn", "kind"],
    )
    last = GaugeMetricFamily(
        "vpnrepl_reconcile_last_run_timestamp_seconds",
        "when the newest reconcile run ended (Unix time)",
        labels=["vpn"],
    )
    agree = GaugeMetricFamily(
        "vpnrepl_reconcile_agree",
        "1 when the newest reconcile run found the sites equal (after repair)",
        labels=["vpn"],
    )
    took = GaugeMetricFamily(
        "vpnrepl_reconcile_duration_seconds", "how long the newest run took", labels=["vpn"]
    )
    for v in vpns:
        run = v.get("reconcile")
        if not run:
            continue
        name = v["name"]
        for kind in ("missing_on_standby", "extra_on_standby", "differs", "broker_drift"):
            differences.add_metric([name, kind], run[kind])
        last.add_metric([name], datetime.fromisoformat(run["finished_at"]).timestamp())
        agree.add_metric([name], 1 if run["outcome"] == "agree" else 0)
        took.add_metric([name], run["seconds"])
    yield from (differences, last, agree, took)
