"""Settings precedence (defaults < TOML < env < flags), the serve command, metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.settings import Settings
from tools.cli import app

TOML = """
[server]
port = 9001
host = "127.0.0.1"
data_dir = "/from/toml"
max_page_nbytes = 1048576
"""


def test_defaults_are_loopback_8700_and_var_kvstore():
    s = Settings.load(env={})
    assert (s.host, s.port, s.data_dir) == ("127.0.0.1", 8700, Path("./var/kvstore"))
    assert not s.auth_enabled


def test_toml_then_env_then_flags(tmp_path):
    config = tmp_path / "kvstore.toml"
    config.write_text(TOML)
    s = Settings.load(config, env={})
    assert (s.port, s.data_dir, s.max_page_nbytes) == (9001, Path("/from/toml"), 1 << 20)
    env = {"KVSTORE_PORT": "9002", "KVSTORE_DIR": "/from/env", "KVSTORE_CONFIG": str(config)}
    s = Settings.load(env=env)
    assert (s.port, s.data_dir, s.max_page_nbytes) == (9002, Path("/from/env"), 1 << 20)
    s = Settings.load(env=env, port=9003, data_dir=None)
    assert (s.port, s.data_dir) == (9003, Path("/from/env"))


def test_secrets_stay_out_of_repr():
    s = Settings.load(env={"KVSTORE_TOKEN": "a-very-secret-token-value"})
    assert s.auth_enabled and "a-very-secret" not in repr(s)


def test_unknown_or_bad_settings_are_refused(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nprot = 1\n")
    with pytest.raises(ValueError):
        Settings.load(config, env={})
    with pytest.raises(ValueError):
        Settings.load(env={"KVSTORE_PORT": "http"})


def test_serve_help_has_an_example_and_refuses_an_unsafe_bind(monkeypatch):
    for key in ("KVSTORE_TOKEN", "KVSTORE_ADMIN_TOKEN", "KVSTORE_TOKENS_FILE", "KVSTORE_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    runner = CliRunner()
    result = runner.invoke(app, ["serve", "--help"])
    assert result.exit_code == 0 and "Example" in result.output and "kvstore serve" in result.output
    result = runner.invoke(app, ["serve", "--host", "0.0.0.0", "--port", "1"])
    assert result.exit_code == 2 and "refusing" in result.output


def test_metrics_count_requests_by_route_template(open_client):
    open_client.get("/v1/health")
    open_client.put("/v1/pages/" + "ab" * 32, content=b"x")
    text = open_client.get("/metrics").text
    assert 'kvstore_http_requests_total{method="PUT",route="/v1/pages/{digest}",status="422"} 1' in text
    assert "kvstore_store_page_count 0" in text
    assert "ab" * 32 not in text
