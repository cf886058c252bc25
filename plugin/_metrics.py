"""Metrics: OpenTelemetry SDK instruments, read out as Prometheus text.

The hot path never touches an instrument: the listener keeps plain integer
counters (:class:`ListenerStats`) and observable instruments read them when
``/metrics`` is scraped, so a publish costs an ``int`` increment, not an SDK
call. Rendering to the Prometheus text format is done here from the SDK's
in-memory reader, which avoids a dependency on a separate exporter package.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import Gauge, InMemoryMetricReader, Sum

from txn import TxnStats

__all__ = ["ListenerStats", "Metrics"]


@dataclass
class ListenerStats:
    """Counters the listener bumps inline."""

    connections_open: int = 0
    connections_total: int = 0
    #: (vpn, kind) -> events handed to the sink
    events: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: reply code -> client connections closed by the listener for bad input
    protocol_closes: Counter[int] = field(default_factory=Counter)


class Metrics:
    """One meter provider per node; instruments registered by component."""

    def __init__(self) -> None:
        self._reader = InMemoryMetricReader()
        self._provider = MeterProvider(metric_readers=[self._reader])
        self.meter = self._provider.get_meter("vpnrepl")

    def observe_listener(self, stats: ListenerStats) -> None:
        def gauge(read: Callable[[], int]) -> Callable[[CallbackOptions], Iterable[Observation]]:
            return lambda _: [Observation(read())]

        self.meter.create_observable_up_down_counter(
            "vpnrepl_client_connections",
            callbacks=[gauge(lambda: stats.connections_open)],
            description="client connections open through the listener",
        )
        self.meter.create_observable_counter(
            "vpnrepl_client_connections_total",
            callbacks=[gauge(lambda: stats.connections_total)],
            description="client connections accepted by the listener",
        )
        self.counted(
            "vpnrepl_events_total",
            stats.events,
            ("vpn", "kind"),
            "replication events handed to the sink",
        )
        self.counted(
            "vpnrepl_protocol_closes_total",
            stats.protocol_closes,
            ("reply_code",),
            "client connections closed for bad input, by AMQP reply code",
        )

    def observe_txn(self, stats: TxnStats) -> None:
        self.counted(
            "vpnrepl_txn_total",
            stats.outcomes,
            ("vpn", "outcome"),
            "local transactions coordinated here, by VPN and outcome",
        )
        self.counted(
            "vpnrepl_txn_applied_ahead_total",
            stats.committed_early,
            ("vpn",),
            "transactions the standby committed before their ledger stream copy",
        )

    def counted(
        self, name: str, counts: Counter[Any], labels: tuple[str, ...], description: str
    ) -> None:
        """An observable counter read from ``counts``, whose keys are the
        label values (a tuple, or the one value when there is one label)."""

        def observe(_: CallbackOptions) -> Iterable[Observation]:
            for key, n in list(counts.items()):
                values = key if isinstance(key, tuple) else (key,)
                yield Observation(n, {k: str(v) for k, v in zip(labels, values, strict=True)})

        self.meter.create_observable_counter(name, callbacks=[observe], description=description)

    def prometheus_text(self) -> str:
        lines: list[str] = []
        data = self._reader.get_metrics_data()
        for rm in data.resource_metrics if data is not None else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    kind = "gauge"
                    if isinstance(metric.data, Sum) and metric.data.is_monotonic:
                        kind = "counter"
                    elif not isinstance(metric.data, Sum | Gauge):
                        continue
                    lines.append(f"# HELP {metric.name} {metric.description}")
                    lines.append(f"# TYPE {metric.name} {kind}")
                    for point in metric.data.data_points:
                        labels = ",".join(
                            f'{k}="{_escape(str(v))}"'
                            for k, v in sorted((point.attributes or {}).items())
                        )
                        name = metric.name + (f"{{{labels}}}" if labels else "")
                        lines.append(f"{name} {point.value}")
        return "\n".join(lines) + "\n"

    def shutdown(self) -> None:
        self._provider.shutdown()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
