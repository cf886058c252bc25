"""The management API over a cluster's nodes: a node that gives no answer
passes the call to the next, an HTTP answer is final (no servers: a
stand-in HTTP server on loopback)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from bridge.broker import ManagementAPI, ManagementUnavailable


class _Answers(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        code, body = (404, {"reason": "Not Found"}) if "missing" in self.path else (200, [1])
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def live_port() -> Iterator[int]:
    server = HTTPServer(("127.0.0.1", 0), _Answers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_call_goes_to_the_next_node_when_one_gives_no_answer(live_port: int) -> None:
    dead = _dead_port()
    api = ManagementAPI(
        [f"http://u:secret@127.0.0.1:{dead}/", f"http://u:secret@127.0.0.1:{live_port}/"],
        timeout=2,
    )
    assert api.get("queues") == [1]
    assert api.get("queues") == [1]  # and stays on the node that answered
    with pytest.raises(ManagementUnavailable) as info:
        api.get("missing")  # an HTTP answer is the cluster's: not retried elsewhere
    assert info.value.not_found and f":{live_port}" in str(info.value)


def test_no_node_answering_names_each_and_no_password() -> None:
    ports = [_dead_port(), _dead_port()]
    api = ManagementAPI([f"http://u:secret@127.0.0.1:{p}/" for p in ports], timeout=2)
    with pytest.raises(ManagementUnavailable) as info:
        api.get("queues")
    message = str(info.value)
    assert all(f"127.0.0.1:{p}" in message for p in ports), message
    assert "secret" not in message and info.value.status is None
