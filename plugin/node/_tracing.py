"""Traces: the transaction spans of :mod:`txn.local._coordinator`, exported over OTLP.

Off unless ``[telemetry] otlp_traces_url`` is set (an OTLP/HTTP traces
endpoint, e.g. ``http://collector:4318/v1/traces``). Then the node installs
an OpenTelemetry SDK tracer provider that batches finished spans and sends
them there; ``service.name`` is ``vpnrepl`` and ``vpnrepl.site`` the site's
name. Headers a collector needs (an API key) come from the SDK's own
environment variable ``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, so they never
sit in the site's TOML file or its log.

What is exported: per transaction a ``txn`` span (``vpn``, ``txid``,
``events``, ``txn.outcome``) and one child per phase (``txn.prepare``,
``txn.broker_commit``, ``txn.decision``, ``txn.standby_commit``), and
``txn.recover`` per transaction recovered at start. Never a message body,
a routing key or a credential. A collector that is down costs the node a
bounded queue (the batch processor drops the oldest spans beyond 2048),
never a transaction.
"""

from __future__ import annotations

import asyncio
import logging

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from bridge import redact_url
from plugin.config import SiteConfig

__all__ = ["Tracing"]

log = logging.getLogger(__name__)

#: seconds an export (and the flush at shutdown) may take before giving up
EXPORT_TIMEOUT = 10


class Tracing:
    """The node's tracer provider, when ``[telemetry] otlp_traces_url`` is set."""

    def __init__(self, cfg: SiteConfig) -> None:
        self.provider: TracerProvider | None = None
        url = cfg.otlp_traces_url
        if url is None:
            return
        resource = Resource.create({"service.name": "vpnrepl", "vpnrepl.site": cfg.site_name})
        self.provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(self.provider)
        log.info("transaction spans exported to %s (OTLP/HTTP)", redact_url(url))

    async def shutdown(self) -> None:
        """Send what is buffered (in a thread: the export is blocking I/O)."""
        if self.provider is not None:
            await asyncio.to_thread(self.provider.shutdown)
