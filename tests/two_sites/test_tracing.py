"""Transaction spans leave the node over OTLP/HTTP when ``[telemetry]`` says so.

A small OTLP/HTTP receiver in the test process stands in for the operator's
collector (the exporter is the real one; the receiver decodes what it sends
with the OpenTelemetry protobuf classes).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pika
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from plugin.devtools import LocalSite, OtlpReceiver
from tests.fix_cli import Vpnrepl
from tests.fix_node import NodeProcess
from tests.support.two_sites import (
    VPN,
    amqp_url,
    body,
    enable,
    properties,
    routing_key,
    setup_vpn,
    until,
    vpn_status,
)


class Collector:
    """Accepts ``POST /v1/traces`` and keeps every span with its resource."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.bodies: list[bytes] = []
        self.paths: set[str] = set()
        self.receiver = OtlpReceiver(self.take)
        self.url = self.receiver.url

    def take(self, path: str, data: bytes) -> None:
        # (runs in the server's thread: what it saw is asserted by the test)
        self.paths.add(path)
        self.bodies.append(data)
        request = ExportTraceServiceRequest.FromString(data)
        for rs in request.resource_spans:
            resource = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for span in ss.spans:
                    attributes = {
                        a.key: a.value.string_value or a.value.int_value or a.value.bool_value
                        for a in span.attributes
                    }
                    self.spans.append(
                        {
                            "name": span.name,
                            "id": span.span_id,
                            "parent": span.parent_span_id,
                            "trace": span.trace_id,
                            "attributes": attributes,
                            "resource": resource,
                        }
                    )

    def close(self) -> None:
        self.receiver.close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    try:
        yield c
    finally:
        c.close()


def test_a_sync_transaction_exports_its_span_and_one_per_phase(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
    collector: Collector,
) -> None:
    setup_vpn(site_a)
    enable(vpnrepl_a, "--mode", "sync", "--sync-timeout-ms", "10000")
    with open(vpnrepl_a.config, "a") as f:
        f.write(f'\n[telemetry]\notlp_traces_url = "{collector.url}"\n')
    node_a.start()
    node_b.start()
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "the standby to connect")
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(site_a)))
    ch = conn.channel()
    ch.tx_select()
    for n in (5, 10):
        ch.basic_publish("events", routing_key(n), body(n), properties(n))
    ch.tx_commit()
    conn.close()
    node_a.stop()  # a clean stop sends what the batch processor holds

    assert collector.paths == {"/v1/traces"}  # the configured URL, as given
    roots = [s for s in collector.spans if s["name"] == "txn"]
    assert len(roots) == 1
    root = roots[0]
    assert root["attributes"]["vpn"] == VPN and root["attributes"]["events"] == 2
    assert root["attributes"]["txn.outcome"] == "committed"
    assert root["resource"] == {**root["resource"], "service.name": "vpnrepl", "vpnrepl.site": "a"}
    phases = [s for s in collector.spans if s["parent"] == root["id"]]
    assert [s["name"] for s in phases] == [
        "txn.prepare",
        "txn.broker_commit",
        "txn.decision",
        "txn.standby_commit",
    ]
    assert all(s["trace"] == root["trace"] for s in phases)
    assert phases[0]["attributes"]["txn.standby_voted"] is True
    assert phases[3]["attributes"]["txn.standby_applied"] is True
    # what leaves the site: ids and counts, never a message body
    assert not any(body(n) in data for data in collector.bodies for n in (5, 10))
    assert "otlp" in node_a.log_text().lower()


def test_a_telemetry_url_that_is_not_http_is_refused_at_start(vpnrepl_a: Vpnrepl) -> None:
    with open(vpnrepl_a.config, "a") as f:
        f.write('\n[telemetry]\notlp_traces_url = "grpc://collector:4317"\n')
    done = vpnrepl_a("status")
    assert done.returncode != 0
    assert "telemetry.otlp_traces_url" in done.stderr and "http or https URL" in done.stderr


def test_an_xa_branch_exports_a_span_per_verb_and_its_phases(
    site_a: LocalSite,
    site_b: LocalSite,
    vpnrepl_a: Vpnrepl,
    node_a: NodeProcess,
    node_b: NodeProcess,
    collector: Collector,
) -> None:
    from txn.client import XAResource
    from txn.xa import Xid

    setup_vpn(site_a)
    enable(vpnrepl_a, "--mode", "sync", "--sync-timeout-ms", "10000")
    with open(vpnrepl_a.config, "a") as f:
        f.write(f'\n[telemetry]\notlp_traces_url = "{collector.url}"\n')
    node_a.start()
    node_b.start()
    until(lambda: vpn_status(node_a).get("bridge") == "connected", "the standby to connect")
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url(site_a)))
    xa = XAResource(conn, timeout=20)
    work = conn.channel()
    xid = Xid.from_parts(1, "traced", "b")
    xa.start(xid, work)
    work.basic_publish("events", routing_key(15), body(15), properties(15))
    xa.end(xid)
    xa.prepare(xid)
    xa.commit(xid)
    conn.close()
    node_a.stop()

    verbs = [s for s in collector.spans if s["name"].startswith("xa.")]
    assert [s["name"] for s in verbs] == ["xa.start", "xa.end", "xa.prepare", "xa.commit"]
    assert all(s["attributes"]["xid"] == str(xid) for s in verbs)
    assert all(s["attributes"]["xa.code"] == "XA_OK" for s in verbs)
    [branch] = [s for s in collector.spans if s["name"] == "xa"]
    assert branch["parent"] == verbs[2]["id"]  # begun by the prepare, ended by the commit
    assert branch["attributes"]["txn.outcome"] == "committed"
    phases = [s["name"] for s in collector.spans if s["parent"] == branch["id"]]
    assert phases == ["txn.prepare", "txn.broker_commit", "txn.decision", "txn.standby_commit"]
    assert not any(body(15) in data for data in collector.bodies)
