"""Bad input at the edges the AMQP and bridge fuzzers do not cover, with
hypothesis: config files and the admin endpoint. Each bad input gets its
own error (a ``ConfigError`` naming the file, an HTTP 4xx naming what there
is), never a crash."""

from __future__ import annotations

import asyncio
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings, strategies as st

from bridge import BridgeError, Role
from bridge.wire import CLOSED, NEED_DATA, BridgeConnection
from plugin import ConfigError, load_config
from plugin.admin import AdminServer, LagHistory
from tests.unit.plugin.session.test_session import make_session, open_session
from tests.unit.plugin.test_config import GOOD

SECTIONS = ["site", "broker", "listen", "store", "peer", "tls", "replication", "reconcile",
            "telemetry", "client_tls", "nonsense"]  # fmt: skip
KEYS = ["name", "amqp_url", "management_url", "amqp", "bridge", "admin", "dsn", "cert", "key",
        "ca", "ledger_retain_seconds", "ledger_max_bytes", "ledger_check_seconds", "interval",
        "segments", "method", "master", "store_dsn", "amqps", "x"]  # fmt: skip
VALUES = st.one_of(
    st.integers(-(2**40), 2**40).map(str),
    st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=30).map(repr),
    st.sampled_from(['"0.0.0.0:5672"', '"amqp://x"', "true", "[1, 2]", '"postgresql://a/b"']),
)


def _load(text: str | bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "site.toml"
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        try:
            load_config(str(path))
        except ConfigError as e:
            assert str(path) in str(e) or "site.toml" in str(e), e


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(SECTIONS), st.sampled_from(KEYS), VALUES), max_size=8))
def test_a_config_edited_at_random_loads_or_names_its_fault(
    edits: list[tuple[str, str, str]],
) -> None:
    text = GOOD + "".join(f"\n[{s}]\n{k} = {v}\n" for s, k, v in edits)
    _load(text)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_a_config_of_random_bytes_names_its_fault(data: bytes) -> None:
    _load(data)


def _ask(port: int, method: str, path: str) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:  # noqa: S310 - loopback
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"]),
            st.text(alphabet="/abcdefghijklmnopqrstuvwxyz%2F._-?=&0123456789", max_size=40),
        ),
        min_size=1,
        max_size=10,
    )
)
def test_the_admin_endpoint_answers_any_request_without_a_server_error(
    requests: list[tuple[str, str]],
) -> None:
    async def status() -> dict[str, Any]:
        return {"site": "a", "vpns": []}

    async def metrics() -> bytes:
        return b"vpnrepl_store_up 1.0\n"

    async def run() -> list[int]:
        server = AdminServer(status, metrics, lambda vpn: vpn == "orders", LagHistory())
        await server.start("127.0.0.1", 0)
        try:
            return [
                await asyncio.to_thread(_ask, server.port, method, "/" + path.lstrip("/"))
                for method, path in requests
            ]
        finally:
            await server.close()

    for code in asyncio.run(run()):
        assert code < 500 or code == 503, code  # 503: a VPN not active here


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.sampled_from(["active", "standby"]))
def test_random_bridge_bytes_fail_the_connection_with_a_bridge_error(
    data: bytes, role: str
) -> None:
    """Whatever a peer sends, the bridge connection yields frames or fails
    with one of the protocol's own errors (which it can report to the peer)."""
    conn = BridgeConnection(Role(role), "nyc")
    conn.receive_data(data)
    try:
        for _ in range(100):
            if conn.next_event() in (NEED_DATA, CLOSED):
                break
    except BridgeError as e:
        assert e.code  # a wire code the peer is told
    except Exception as e:  # noqa: BLE001 - the property: nothing else escapes
        raise AssertionError(f"{type(e).__name__} escaped the bridge codec: {e}") from e


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=400))
def test_random_broker_bytes_close_the_client_with_a_reply_code(data: bytes) -> None:
    """A broker that sends garbage after the handshake: the session closes
    the client's connection with an AMQP reply code, never crashes."""
    s = make_session()
    open_session(s)
    s.broker_data(data)  # a fault becomes a connection.close to the client
    assert s.fault_code is None or 300 <= s.fault_code < 600
