"""A local OTLP/HTTP trace receiver, standing in for an operator's collector."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["OtlpReceiver"]


class OtlpReceiver:
    """A local OTLP/HTTP trace receiver, standing in for an operator's
    collector in the tests and benchmarks: every ``POST`` (``path``, body)
    goes to ``take`` (in the server's thread), and is answered with an empty
    ``ExportTraceServiceResponse``. ``url`` is for ``[telemetry]
    otlp_traces_url``."""

    def __init__(self, take: Callable[[str, bytes], None]) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceResponse,
        )

        reply = ExportTraceServiceResponse().SerializeToString()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                take(self.path, self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
