"""Flags, environment and YAML layer into one validated Config; bad input exits 2 with one
line naming the field."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from exporter.cli import build_parser, main
from exporter.config import FLAGS, Config, ConfigError, build_config


def config_from(argv: list[str], environ: dict[str, str] | None = None) -> Config:
    args = build_parser().parse_args(["run", *argv])
    return build_config(args, environ=environ or {})


def test_every_flag_has_a_config_field_and_back():
    fields = {f.name for f in dataclasses.fields(Config)}
    assert {flag.dest for flag in FLAGS} == fields


def test_defaults_bind_localhost_on_the_documented_port():
    config = config_from([])
    assert config.web_listen_address == "127.0.0.1:10123"
    assert config.vllm_url == ()


def test_precedence_flag_over_env_over_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("vllm:\n  url: [http://file:8000]\n  timeout: 3\nlog.level: debug\n")
    env = {"VLLM_CACHE_EXPORTER_VLLM_TIMEOUT": "4", "VLLM_CACHE_EXPORTER_LOG_LEVEL": "warning"}
    config = config_from(["--config.file", str(path), "--log.level", "error"], env)
    assert config.vllm_url == ("http://file:8000",)
    assert config.vllm_timeout == 4.0  # env beats file
    assert config.log_level == "error"  # flag beats env
    assert config.engine_targets == ("http://file:8000/metrics",)


def test_repeatable_urls_and_comma_env():
    assert config_from(["--vllm.url", "http://a:1", "--vllm.url", "http://b:2/m"]).vllm_url == (
        "http://a:1", "http://b:2/m")
    env = {"VLLM_CACHE_EXPORTER_VLLM_URL": "http://a:1, http://b:2"}
    assert config_from([], env).engine_targets == ("http://a:1/metrics", "http://b:2/metrics")


@pytest.mark.parametrize("argv, env, field", [
    (["--vllm.timeout", "abc"], {}, "--vllm.timeout"),
    (["--vllm.timeout", "-1"], {}, "--vllm.timeout"),
    (["--vllm.url", "ftp://x"], {}, "--vllm.url"),
    (["--web.listen-address", "nope"], {}, "--web.listen-address"),
    ([], {"VLLM_CACHE_EXPORTER_CALLERS_MAX": "many"}, "VLLM_CACHE_EXPORTER_CALLERS_MAX"),
    (["--log.level", "loud"], {}, "--log.level"),
    (["--tap.listen-address", "127.0.0.1:9"], {}, "--tap.upstream"),
    (["--usage.ingest.token-file", "/nonexistent/token"], {}, "--usage.ingest.token-file"),
])
def test_bad_values_name_the_field(argv, env, field):
    with pytest.raises(ConfigError) as err:
        config_from(argv, env)
    assert str(err.value).startswith(field + ":")


def test_bad_yaml_and_unknown_keys(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("vllm: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        config_from(["--config.file", str(broken)])
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("vllm:\n  urls: [http://x]\n")
    with pytest.raises(ConfigError, match=r"vllm\.urls: unknown setting"):
        config_from(["--config.file", str(unknown)])


def test_token_file_is_read_and_never_printed(tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    assert config_from(["--usage.ingest.token-file", str(token)]).usage_ingest_token == (
        "s3cret-token")
    assert main(["--usage.ingest.token-file", str(token), "--check-config"]) == 0
    out = capsys.readouterr().out
    assert "s3cret-token" not in out
    assert json.loads(out)["usage.ingest.token"] == "<redacted>"


def test_check_config_exit_codes(capsys):
    assert main(["--vllm.url", "http://127.0.0.1:8000", "--check-config"]) == 0
    assert json.loads(capsys.readouterr().out)["vllm.url"] == ["http://127.0.0.1:8000"]
    assert main(["--vllm.timeout", "soon", "--check-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["vllm-cache-exporter: configuration error: --vllm.timeout: expected a "
                   "number, got 'soon'"]


def test_console_script_help_is_grouped():
    result = subprocess.run([sys.executable, "-m", "exporter", "run", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for group in ("Web:", "vLLM engine:", "Usage readers:", "Callers:", "Tap proxy:"):
        assert group in result.stdout
    assert "VLLM_CACHE_EXPORTER_VLLM_URL" in result.stdout


def test_bad_config_exits_2_from_the_command_line():
    result = subprocess.run([sys.executable, "-m", "exporter", "--vllm.url", "nope"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "--vllm.url" in result.stderr
