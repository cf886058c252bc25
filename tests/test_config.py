"""Config loading: every fault names the file and the key (no servers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugin import ConfigError, HostPort, load_config, redact_url

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
bridge = "standby.example:5680"
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "site.toml"
    path.write_text(text)
    return str(path)


def test_good_config_loads_with_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.site_name == "nyc"
    assert cfg.listen_amqp == HostPort("0.0.0.0", 5673)
    assert cfg.listen_admin == HostPort("127.0.0.1", 9480)
    assert cfg.peer_bridge == HostPort("standby.example", 5680)
    assert cfg.tls is None


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
        (lambda t: t + "\n[extra]\nx = 1\n", "extra", "unknown section"),
        (lambda t: t.replace(':5673"', ':99999"'), "listen.amqp", "outside 0..65535"),
        (lambda t: t + '\n[tls]\ncert = "c.pem"\n', "tls.key", "required key is missing"),
        (lambda t: t + '\n[tls]\ncert = "c.pem"\nkey = "k.pem"\n', "tls.cert", "file not found"),
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
    (tmp_path / "c.pem").write_text("x")
    (tmp_path / "k.pem").write_text("x")
    cfg = load_config(write(tmp_path, GOOD + '\n[tls]\ncert = "c.pem"\nkey = "k.pem"\n'))
    assert cfg.tls is not None
    assert cfg.tls.cert == tmp_path / "c.pem"
    assert cfg.tls.ca is None


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
