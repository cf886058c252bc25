"""Config loading: every fault names the file and the key (no servers)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bridge import HostPort, redact_url
from plugin import ConfigError, PeerConfig, load_config
from plugin.cli import main

GOOD = """
[site]
name = "nyc"
[broker]
amqp_url = "amqp://guest:secret@127.0.0.1:5672/"
management_url = "http://guest:secret@127.0.0.1:15672/"
[listen]
amqp = "0.0.0.0:5673"
bridge = "0.0.0.0:5680"
[store]
dsn = "postgresql://vpnrepl@127.0.0.1:5432/vpnrepl"
[peer]
name = "ldn"
bridge = "standby.example:5680"
[tls]
cert = "c.pem"
key = "k.pem"
ca = "ca.pem"
"""
#: GOOD without its [tls] section
NO_TLS = GOOD[: GOOD.index("[tls]")]


def write(tmp_path: Path, text: str) -> str:
    for name in ("c.pem", "k.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    path = tmp_path / "site.toml"
    path.write_text(text)
    return str(path)


def test_good_config_loads_with_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.site_name == "nyc"
    assert cfg.listen_amqp == HostPort("0.0.0.0", 5673)
    assert cfg.listen_admin == HostPort("127.0.0.1", 9480)
    assert cfg.peer_bridge == HostPort("standby.example", 5680)
    assert cfg.peers == (PeerConfig("ldn", (HostPort("standby.example", 5680),), None),)
    assert cfg.tls is not None and cfg.bridge_authenticated and not cfg.plaintext_bridge


PEERS = """
[peers.ldn]
bridge = ["ldn-1.example:5680", "ldn-2.example:5680"]
store_dsn = "postgresql://reader@ldn.example/vpnrepl"
"""


def test_peers_are_tables_keyed_by_site_name(tmp_path: Path) -> None:
    text = NO_TLS[: NO_TLS.index("[peer]")] + PEERS + GOOD[GOOD.index("[tls]") :]
    path = write(tmp_path, text)
    cfg = load_config(path)
    assert cfg.peer is not None and cfg.peer.name == "ldn"
    assert cfg.peer.bridge == (HostPort("ldn-1.example", 5680), HostPort("ldn-2.example", 5680))
    assert cfg.peer_bridge == HostPort("ldn-1.example", 5680)
    assert cfg.peer_store_dsn == "postgresql://reader@ldn.example/vpnrepl"
    # --set reaches a peer's table, and a new one
    cfg = load_config(path, ('peers.ldn.bridge="ldn-3.example:5680"',))
    assert cfg.peer is not None and cfg.peer.bridge == (HostPort("ldn-3.example", 5680),)
    with pytest.raises(ConfigError, match="peers.NAME.KEY=VALUE"):
        load_config(path, ("peers.bridge=x:1",))


def test_a_plaintext_bridge_is_an_explicit_opt_out(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, NO_TLS))
    assert info.value.key == "tls"
    assert "set tls.cert, tls.key and tls.ca" in info.value.problem
    assert "[insecure] plaintext_bridge = true" in info.value.problem
    cfg = load_config(write(tmp_path, NO_TLS + "[insecure]\nplaintext_bridge = true\n"))
    assert cfg.tls is None and cfg.plaintext_bridge and not cfg.bridge_authenticated
    assert not cfg.bridge_moving


def test_tls_beside_the_opt_out_is_a_pair_moving_to_tls(tmp_path: Path) -> None:
    """README "Moving a plaintext pair to mutual TLS": both accepted, and
    not authenticated while plain TCP is."""
    cfg = load_config(write(tmp_path, GOOD + "[insecure]\nplaintext_bridge = true\n"))
    assert cfg.tls is not None and cfg.bridge_moving and not cfg.bridge_authenticated


def _brokers(*more: object) -> Callable[[str], str]:
    """GOOD with ``broker.amqp_url`` a list: its own URL, then ``more``."""
    listed = ", ".join(f'"{m}"' if isinstance(m, str) else repr(m) for m in more)
    url = '"amqp://guest:secret@127.0.0.1:5672/"'
    return lambda t: t.replace(f"amqp_url = {url}", f"amqp_url = [{url}, {listed}]")


def test_a_cluster_behind_a_site_is_a_list_of_its_nodes(tmp_path: Path) -> None:
    text = _brokers("amqp://guest:secret@10.0.0.2:5672/", "amqp://guest:secret@10.0.0.3/")(GOOD)
    text = text.replace(
        'management_url = "http://guest:secret@127.0.0.1:15672/"',
        'management_url = ["http://guest:secret@127.0.0.1:15672/", "http://guest:secret@h2/"]',
    )
    cfg = load_config(write(tmp_path, text))
    assert cfg.amqp_urls == (
        "amqp://guest:secret@127.0.0.1:5672/",
        "amqp://guest:secret@10.0.0.2:5672/",
        "amqp://guest:secret@10.0.0.3/",
    )
    assert cfg.amqp_url == cfg.amqp_urls[0]
    assert cfg.management_urls == (
        "http://guest:secret@127.0.0.1:15672/",
        "http://guest:secret@h2/",
    )
    single = load_config(write(tmp_path, GOOD))
    assert single.amqp_urls == ("amqp://guest:secret@127.0.0.1:5672/",)


@pytest.mark.parametrize(
    ("edit", "key", "problem"),
    [
        (lambda t: t.replace("amqp_url", "amqp_ulr"), "broker.amqp_ulr", "unknown key"),
        (lambda t: t.replace('name = "nyc"', ""), "site.name", "required key is missing"),
        (lambda t: t.replace('"0.0.0.0:5673"', "5673"), "listen.amqp", "expected str, got int"),
        (
            lambda t: t.replace('"0.0.0.0:5680"\n[store]', '"nowhere"\n[store]'),
            "listen.bridge",
            "expected HOST:PORT",
        ),
        (lambda t: t.replace("amqp://guest", "http://guest"), "broker.amqp_url", "amqp"),
        (lambda t: t.replace("postgresql://", "mysql://"), "store.dsn", "postgresql"),
        (
            _brokers("amqp://guest:secret@b:5672/", "amqps://guest:secret@c/"),
            "broker.amqp_url",
            "item 3: amqps:// where item 1 is amqp://",
        ),
        (
            _brokers("amqp://ops:secret@b:5672/"),
            "broker.amqp_url",
            "item 2: another user or password than item 1's",
        ),
        (
            _brokers("amqp://guest:secret@127.0.0.1:5672/"),
            "broker.amqp_url",
            "item 2: 127.0.0.1:5672 is named twice",
        ),
        (_brokers(5), "broker.amqp_url", "item 2: expected a URL string, got int"),
        (_brokers("http://guest:secret@b/"), "broker.amqp_url", "item 2: expected a amqp or"),
        (
            lambda t: t.replace(
                'amqp_url = "amqp://guest:secret@127.0.0.1:5672/"', "amqp_url = []"
            ),
            "broker.amqp_url",
            "an amqp or amqps URL, or a list of them",
        ),
        (
            lambda t: t.replace('amqp_url = "amqp://guest:secret@127.0.0.1:5672/"', "amqp_url = 7"),
            "broker.amqp_url",
            "an amqp or amqps URL, or a list of them",
        ),
        (lambda t: t + "\n[extra]\nx = 1\n", "extra", "unknown section"),
        (lambda t: t.replace(':5673"', ':99999"'), "listen.amqp", "outside 0..65535"),
        (lambda t: t.replace('key = "k.pem"\n', ""), "tls.key", "required key is missing"),
        (lambda t: t.replace('ca = "ca.pem"\n', ""), "tls.ca", "required key is missing"),
        (lambda t: t.replace('"c.pem"', '"absent.pem"'), "tls.cert", "file not found"),
        (lambda t: t.replace('name = "ldn"\n', ""), "peer.name", "required key is missing"),
        (lambda t: t.replace('name = "ldn"', 'name = "nyc"'), "peers", "names this site itself"),
        (lambda t: t + PEERS, "peer", "both [peer] and [peers.NAME]"),
        (
            lambda t: t.replace("[peer]\n", "[peers.x]\nbridge = 'x:1'\n[peer]\n"),
            "peer",
            "both [peer] and [peers.NAME]",
        ),
        (
            lambda t: t + PEERS.replace("ldn", "fra") + PEERS.replace("[peers.ldn]", "[peers.x]"),
            "peer",
            "both",
        ),
        (lambda t: t + "[peers.fra]\nport = 1\n", "peers.fra.port", "unknown key"),
        (lambda t: t + "[peers.fra]\nbridge = 5\n", "peers.fra.bridge", "an address or a list"),
        (lambda t: t + "[peers.fra]\nbridge = 'x'\n", "peers.fra.bridge", "HOST:PORT"),
        (lambda t: t + '[peers."f r"]\n', "peers.f r", "peer site name"),
        (
            lambda t: t.replace(
                'bridge = "0.0.0.0:5680"', 'bridge = "0.0.0.0:5680"\nadmin = "0.0.0.0:9480"'
            ),
            "listen.admin",
            "is not loopback, and the endpoint can promote and demote",
        ),
        (lambda t: t + '[admin]\nuser = "ops"\n', "admin", "user and password go together"),
        (lambda t: t + '[admin]\ntoken = "short"\n', "admin.token", "16 characters or more"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path: Path, edit, key: str, problem: str) -> None:
    path = write(tmp_path, edit(GOOD))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key
    assert problem in info.value.problem
    assert str(info.value).startswith(f"{path}: {key}: ")


def test_syntax_error_and_missing_file_name_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[site\nname=")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_config(path)
    assert info.value.path == path
    with pytest.raises(ConfigError, match="file not found"):
        load_config(str(tmp_path / "absent.toml"))


def test_overrides_apply_after_the_file_and_are_validated(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    cfg = load_config(path, ("listen.amqp=127.0.0.1:6000", 'site.name="bos"'))
    assert cfg.listen_amqp == HostPort("127.0.0.1", 6000)
    assert cfg.site_name == "bos"
    with pytest.raises(ConfigError) as info:
        load_config(path, ("listen.amqp=nowhere",))
    assert info.value.key == "listen.amqp"
    with pytest.raises(ConfigError, match="SECTION.KEY=VALUE"):
        load_config(path, ("justakey",))


def test_tls_paths_resolve_relative_to_the_config(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.tls is not None
    assert cfg.tls.cert == tmp_path / "c.pem"
    assert cfg.tls.ca == tmp_path / "ca.pem"


def test_an_admin_endpoint_off_loopback_takes_credentials(tmp_path: Path) -> None:
    off = GOOD.replace('bridge = "0.0.0.0:5680"', 'bridge = "0.0.0.0:5680"\nadmin = "0.0.0.0:9480"')
    cfg = load_config(write(tmp_path, off + '[admin]\ntoken = "0123456789abcdef0123"\n'))
    assert cfg.admin_token == "0123456789abcdef0123" and cfg.admin_user is None
    cfg = load_config(write(tmp_path, GOOD))  # loopback: none needed
    assert (cfg.admin_user, cfg.admin_password, cfg.admin_token) == (None, None, None)


def test_two_peer_sites_are_refused_in_this_release(tmp_path: Path) -> None:
    text = NO_TLS[: NO_TLS.index("[peer]")] + PEERS + PEERS.replace("ldn", "fra")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text + GOOD[GOOD.index("[tls]") :]))
    assert info.value.key == "peers" and "replicates with one" in info.value.problem


def test_ledger_retention_is_optional_and_checked(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, GOOD)).ledger_retain_seconds == 300
    cfg = load_config(write(tmp_path, GOOD + "\n[replication]\nledger_retain_seconds = 5\n"))
    assert cfg.ledger_retain_seconds == 5
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, GOOD + "\n[replication]\nledger_retain_seconds = -1\n"))
    assert info.value.key == "replication.ledger_retain_seconds"


def test_trace_export_is_off_unless_an_http_endpoint_is_given(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, GOOD)).otlp_traces_url is None
    url = "https://otel.example:4318/v1/traces"
    cfg = load_config(write(tmp_path, GOOD + f'\n[telemetry]\notlp_traces_url = "{url}"\n'))
    assert cfg.otlp_traces_url == url
    for bad in ('"collector:4317"', "4318"):
        with pytest.raises(ConfigError) as info:
            load_config(write(tmp_path, GOOD + f"\n[telemetry]\notlp_traces_url = {bad}\n"))
        assert info.value.key == "telemetry.otlp_traces_url"


def test_redact_url_hides_the_password_only() -> None:
    assert redact_url("amqp://guest:secret@host:5672/v") == "amqp://guest:***@host:5672/v"
    assert redact_url("postgresql://u@h/db") == "postgresql://u@h/db"
    assert (
        redact_url("postgresql://u@h/db?password=hunter2&sslmode=require")
        == "postgresql://u@h/db?password=***&sslmode=require"
    )
    assert "s3cret" not in redact_url("postgresql://u:s3cret@h/db?sslpassword=s3cret")


def _pem_files(tmp_path: Path, *names: str) -> None:
    for name in names:
        (tmp_path / name).write_text("x")


def test_amqps_listener_takes_its_tls_files_relative_to_the_config(tmp_path: Path) -> None:
    _pem_files(tmp_path, "c.pem", "k.pem", "clients-ca.pem")
    text = GOOD.replace('amqp = "0.0.0.0:5673"', 'amqp = "0.0.0.0:5673"\namqps = "0.0.0.0:5674"')
    text += '\n[client_tls]\ncert = "c.pem"\nkey = "k.pem"\nca = "clients-ca.pem"\n'
    cfg = load_config(write(tmp_path, text))
    assert cfg.listen_amqps == HostPort("0.0.0.0", 5674)
    assert cfg.client_tls is not None
    assert (cfg.client_tls.cert, cfg.client_tls.key, cfg.client_tls.ca) == (
        tmp_path / "c.pem",
        tmp_path / "k.pem",
        tmp_path / "clients-ca.pem",
    )
    assert cfg.tls is not None and cfg.tls.ca == tmp_path / "ca.pem"  # the bridge's, apart
    plain = load_config(write(tmp_path, GOOD))
    assert (plain.listen_amqps, plain.client_tls, plain.broker_ca) == (None, None, None)


def test_broker_ca_is_resolved_for_an_amqps_broker(tmp_path: Path) -> None:
    _pem_files(tmp_path, "broker-ca.pem")
    text = GOOD.replace("amqp://guest:secret@127.0.0.1:5672/", "amqps://guest:secret@mq:5671/")
    text = text.replace("[listen]", 'ca = "broker-ca.pem"\n[listen]')
    cfg = load_config(write(tmp_path, text))
    assert cfg.broker_ca == tmp_path / "broker-ca.pem"


AMQPS = 'amqps = "0.0.0.0:5674"\n[store]'
CLIENT_TLS = '\n[client_tls]\ncert = "c.pem"\nkey = "k.pem"\n'


@pytest.mark.parametrize(
    ("edit", "key", "problem"),
    [
        (lambda t: t.replace("[store]", AMQPS), "listen.amqps", "requires a [client_tls] section"),
        (lambda t: t + CLIENT_TLS, "client_tls", "only used with listen.amqps"),
        (
            lambda t: t.replace("[store]", AMQPS) + '\n[client_tls]\ncert = "c.pem"\n',
            "client_tls.key",
            "required key is missing",
        ),
        (
            lambda t: t.replace("[store]", AMQPS) + CLIENT_TLS.replace("c.pem", "absent.pem"),
            "client_tls.cert",
            "file not found",
        ),
        (
            lambda t: t.replace("[store]", AMQPS) + CLIENT_TLS + 'ca = "absent.pem"\n',
            "client_tls.ca",
            "file not found",
        ),
        (
            lambda t: t.replace("[store]", 'amqps = "nowhere"\n[store]') + CLIENT_TLS,
            "listen.amqps",
            "expected HOST:PORT",
        ),
        (
            lambda t: t.replace("[listen]", 'ca = "c.pem"\n[listen]'),
            "broker.ca",
            "only used with an amqps:// broker.amqp_url",
        ),
        (
            lambda t: t.replace("amqp://", "amqps://").replace("[listen]", 'ca = "x"\n[listen]'),
            "broker.ca",
            "file not found",
        ),
    ],
)
def test_bad_tls_listener_config_names_the_key(tmp_path: Path, edit, key, problem) -> None:
    _pem_files(tmp_path, "c.pem", "k.pem")
    path = write(tmp_path, edit(GOOD))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key
    assert problem in info.value.problem
    assert str(info.value).startswith(f"{path}: {key}: ")


def test_amqps_listener_can_be_set_by_overrides(tmp_path: Path) -> None:
    _pem_files(tmp_path, "c.pem", "k.pem")
    path = write(tmp_path, GOOD)
    with pytest.raises(ConfigError) as info:
        load_config(path, ("listen.amqps=127.0.0.1:6001",))
    assert info.value.key == "listen.amqps"
    cfg = load_config(
        path, ("listen.amqps=127.0.0.1:6001", 'client_tls.cert="c.pem"', 'client_tls.key="k.pem"')
    )
    assert cfg.listen_amqps == HostPort("127.0.0.1", 6001)
    assert cfg.client_tls is not None and cfg.client_tls.ca is None


@pytest.mark.parametrize(
    ("section", "key", "problem"),
    [
        ("interval = 5", "reconcile.interval", "seconds >= 10"),
        ('method = "fast"', "reconcile.method", "'pushdown' or 'jdbc'"),
        ('master = "nowhere"', "reconcile.master", "Spark master URL"),
        ("segments = 0", "reconcile.segments", "1 to 65536"),
        ('repair = "yes"', "reconcile.repair", "expected bool"),
        ("interval = 3600", "reconcile.interval", "needs peers.ldn.store_dsn"),
    ],
)
def test_reconcile_settings_are_checked(
    tmp_path: Path, section: str, key: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, GOOD + f"\n[reconcile]\n{section}\n"))
    assert key in str(info.value) and problem in str(info.value)


def test_reconcile_settings_load_with_their_defaults(tmp_path: Path) -> None:
    text = GOOD.replace(
        "[peer]\n", '[peer]\nstore_dsn = "postgresql://reader@standby.example/vpnrepl"\n'
    )
    cfg = load_config(write(tmp_path, text + "\n[reconcile]\ninterval = 21600\n"))
    rc = cfg.reconcile
    assert (rc.interval_seconds, rc.repair, rc.method, rc.segments) == (
        21600,
        False,
        "pushdown",
        1024,
    )
    assert load_config(write(tmp_path, GOOD)).reconcile.interval_seconds is None


#: GOOD with two nodes instead of [listen]
NODES = GOOD.replace(
    '[listen]\namqp = "0.0.0.0:5673"\nbridge = "0.0.0.0:5680"\n',
    """[nodes.a1]
amqp = "0.0.0.0:5673"
bridge = "0.0.0.0:5680"
admin = "127.0.0.1:9480"
host = "a1.example"
[nodes.a2]
amqp = "10.0.0.2:5673"
bridge = "10.0.0.2:5680"
admin = "127.0.0.1:9481"
""",
)


def test_a_node_runs_with_its_own_table_and_knows_the_others(tmp_path: Path) -> None:
    path = write(tmp_path, NODES)
    a2 = load_config(path, node="a2")
    assert (a2.node_name, a2.holder) == ("a2", "a2")
    assert (a2.listen_amqp, a2.listen_bridge) == (
        HostPort("10.0.0.2", 5673),
        HostPort("10.0.0.2", 5680),
    )
    assert a2.listen_admin == HostPort("127.0.0.1", 9481)
    assert [n.name for n in a2.nodes] == ["a1", "a2"]
    a1 = a2.node("a1")
    assert a1 is not None and a1.reach(a1.amqp) == HostPort("a1.example", 5673)
    assert a2.lease_seconds == 15.0
    # a command that is no node reads the site with the first node's addresses
    cli = load_config(path)
    assert cli.node_name == "" and cli.listen_amqp == HostPort("0.0.0.0", 5673)
    # an override reaches a node's table
    moved = load_config(path, ("nodes.a2.amqp=10.0.0.2:6673", "site.lease_seconds=2.5"), "a2")
    assert moved.listen_amqp == HostPort("10.0.0.2", 6673) and moved.lease_seconds == 2.5


def test_a_one_node_site_keeps_listen_and_may_name_its_node(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, GOOD), node="a1")
    assert (cfg.node_name, cfg.nodes, cfg.listen_amqp) == ("a1", (), HostPort("0.0.0.0", 5673))
    assert load_config(write(tmp_path, GOOD)).holder == "node"


def _a2_at_a1s_host(text: str) -> str:
    return text.replace('"10.0.0.2:5673"', '"10.0.0.2:5673"\nhost = "a1.example"')


def _named_sessions(text: str) -> str:
    return text.replace('/vpnrepl"', '/vpnrepl?application_name=x"')


def _short_lease(text: str) -> str:
    return text.replace('name = "nyc"', 'name = "nyc"\nlease_seconds = 0.5')


@pytest.mark.parametrize(
    ("change", "key", "words"),
    [
        (lambda t: t, "nodes.a3", "no such node table (known: a1, a2)"),
        (lambda t: t + '[listen]\namqp = "x:1"\nbridge = "x:2"\n', "listen", "keep one"),
        (lambda t: t.replace('host = "a1.example"\n', ""), "nodes.a1.host", "every address"),
        (_a2_at_a1s_host, "nodes.a2", "also node 'a1'"),
        (lambda t: t.replace("[nodes.a2]", "[nodes.a2]\nport = 1"), "nodes.a2.port", "unknown key"),
        (lambda t: t.replace('amqp = "10.0.0.2:5673"\n', ""), "nodes.a2.amqp", "required"),
        (_short_lease, "site.lease_seconds", "1 to 600"),
        (lambda t: t.replace("[nodes.a2]", "[nodes.'a 2']"), "nodes.a 2", "node name"),
        (lambda t: t.replace("[nodes.a2]", "[nodes.cli]"), "nodes.cli", "holder of the site"),
        (lambda t: t.replace("10.0.0.2:5680", "0.0.0.0:5680"), "nodes.a2.host", "every address"),
        (_named_sessions, "store.dsn", "the node's"),
        (lambda t: t[: t.index("[nodes.a1]")] + t[t.index("[store]") :], "listen", "missing"),
    ],
)  # fmt: skip
def test_a_bad_nodes_table_is_refused_by_its_key(
    tmp_path: Path, change: Callable[[str], str], key: str, words: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, change(NODES)), node="a3" if key == "nodes.a3" else None)
    assert e.value.key == key and words in str(e.value)


def test_a_node_of_a_site_of_several_must_be_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, NODES)
    assert main(["--config", path, "node"]) == 2
    assert "several nodes (a1, a2): start one with --name NODE" in capsys.readouterr().err
    assert main(["--config", path, "node", "--name", "a3"]) == 2
    assert "nodes.a3: no such node table (known: a1, a2)" in capsys.readouterr().err
