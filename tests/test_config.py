"""Flags, environment and YAML layer into one validated Config; bad input exits 2 with one
line naming the field."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from exporter.cli import build_parser, main
from exporter.config import (
    COMMANDS,
    FLAGS,
    FLAGS_BY_DEST,
    Config,
    ConfigError,
    build_config,
    flags_for,
)


def config_from(argv: list[str], environ: dict[str, str] | None = None) -> Config:
    args = build_parser().parse_args(["run", *argv])
    return build_config(args, environ=environ or {})


def test_every_run_setting_has_a_config_field_and_back():
    fields = {f.name: f for f in dataclasses.fields(Config)}
    assert set(FLAGS_BY_DEST) == set(fields)
    for dest, flag in FLAGS_BY_DEST.items():  # the default is the table's, written once
        assert fields[dest].default == flag.default, dest


def test_one_table_for_every_command():
    """Each flag once per command, one name per setting: the same env var wherever used."""
    for command in COMMANDS:
        names = [flag.name for flag in flags_for(command)]
        assert len(names) == len(set(names)), command
    assert len({flag.name for flag in FLAGS}) == len(FLAGS)
    for flag in FLAGS:
        assert flag.env == "VLLM_CACHE_EXPORTER_" + flag.dest.upper()
        assert flag.commands <= set(COMMANDS)
        # dotted component settings, or a command's own single words
        assert flag.name == flag.name.lower() and " " not in flag.name


@pytest.mark.parametrize(
    "argv, message",
    [
        (["simulate", "--speed", "-1"], "--speed: must be greater than 0"),
        (["drive", "--drive.base-url", "ftp://x"], "--drive.base-url: expected an http(s) URL"),
        (["demo", "--refresh", "0"], "--refresh: must be greater than 0"),
        (["check", "--vllm.timeout", "soon"], "--vllm.timeout: expected a number"),
        (["generate", "--format", "helm"], "--format: must be one of"),
    ],
)
def test_subcommand_settings_are_validated_by_the_same_table(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_subcommands_read_their_environment_variables(monkeypatch):
    from exporter.cli import build_parser
    from exporter.config import settings

    args = build_parser().parse_args(["drive"])
    env = {"VLLM_CACHE_EXPORTER_USAGE_INGEST_TOKEN": "tok", "VLLM_CACHE_EXPORTER_SPEED": "3"}
    resolved = settings("drive", args, env)
    assert resolved.usage_ingest_token == "tok" and resolved.speed == 3.0
    assert resolved.scenario == "two-agents-fit" and resolved.drive_exporter_url == ""


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["--vllm-url", "http://x"], "--vllm-url: did you mean --vllm.url?"),
        (["--vllm.ulr", "http://x"], "--vllm.ulr: did you mean --vllm.url?"),
        (["demo", "--senario", "x"], "--senario: did you mean --scenario?"),
        (["chek"], "unknown command 'chek'"),
    ],
)
def test_mistyped_flags_and_commands_get_a_suggestion(argv, hint, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert hint in capsys.readouterr().err


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
        "http://a:1",
        "http://b:2/m",
    )
    env = {"VLLM_CACHE_EXPORTER_VLLM_URL": "http://a:1, http://b:2"}
    assert config_from([], env).engine_targets == ("http://a:1/metrics", "http://b:2/metrics")


@pytest.mark.parametrize(
    "argv, env, field",
    [
        (["--vllm.timeout", "abc"], {}, "--vllm.timeout"),
        (["--vllm.timeout", "-1"], {}, "--vllm.timeout"),
        (["--vllm.url", "ftp://x"], {}, "--vllm.url"),
        (["--web.listen-address", "nope"], {}, "--web.listen-address"),
        ([], {"VLLM_CACHE_EXPORTER_CALLERS_MAX": "many"}, "VLLM_CACHE_EXPORTER_CALLERS_MAX"),
        (["--log.level", "loud"], {}, "--log.level"),
        (["--tap.listen-address", "127.0.0.1:9"], {}, "--tap.upstream"),
        (["--usage.ingest.token-file", "/nonexistent/token"], {}, "--usage.ingest.token-file"),
    ],
)
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
        "s3cret-token"
    )
    assert main(["--usage.ingest.token-file", str(token), "--check-config"]) == 0
    out = capsys.readouterr().out
    assert "s3cret-token" not in out
    assert json.loads(out)["usage.ingest.token"] == "<redacted>"


def test_check_config_exit_codes(capsys):
    assert main(["--vllm.url", "http://127.0.0.1:8000", "--check-config"]) == 0
    assert json.loads(capsys.readouterr().out)["vllm.url"] == ["http://127.0.0.1:8000"]
    assert main(["--vllm.timeout", "soon", "--check-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "vllm-cache-exporter: configuration error: --vllm.timeout: expected a number, got 'soon'"
    ]


def test_console_script_help_is_grouped():
    result = subprocess.run(
        [sys.executable, "-m", "exporter", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    for group in ("Web:", "vLLM engine:", "Usage readers:", "Callers:", "Tap proxy:"):
        assert group in result.stdout
    assert "VLLM_CACHE_EXPORTER_VLLM_URL" in result.stdout


def test_bad_config_exits_2_from_the_command_line():
    result = subprocess.run(
        [sys.executable, "-m", "exporter", "--vllm.url", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "--vllm.url" in result.stderr


# --- --vllm.url: one endpoint, one target ------------------------------------------------


@pytest.mark.parametrize(
    "typed, read",
    [
        ("http://h:8000", "http://h:8000/metrics"),
        ("HTTP://VLLM.example:8000/", "http://vllm.example:8000/metrics"),
        ("http://h:80", "http://h/metrics"),
        ("https://h:443/prefix/metrics", "https://h/prefix/metrics"),
        ("http://h:8000/metrics#top", "http://h:8000/metrics"),
        ("http://[::1]:8000", "http://[::1]:8000/metrics"),
    ],
)
def test_a_target_url_is_read_and_labelled_in_one_normal_form(typed, read):
    assert config_from(["--vllm.url", typed]).engine_targets == (read,)


@pytest.mark.parametrize(
    "first, second",
    [
        ("http://h:8000", "http://h:8000/metrics"),
        ("http://h:8000/", "HTTP://H:8000"),
        ("http://h:80/metrics", "http://h/metrics/"),
        ("http://user:pw@h:8000", "http://h:8000/metrics"),
    ],
)
def test_one_vllm_given_twice_is_a_configuration_error(first, second, capsys):
    """Read twice, its counters would count twice in every sum over targets: refused at start
    with exit 2 and one line that names both, as every configuration error is."""
    assert main(["--vllm.url", first, "--vllm.url", second, "--check-config"]) == 2
    err = capsys.readouterr().err
    assert "--vllm.url:" in err and "same vLLM endpoint" in err and err.count("\n") == 1
    assert "pw" not in err


def test_different_ports_or_paths_are_different_targets():
    config = config_from(
        [
            "--vllm.url",
            "http://h:8000",
            "--vllm.url",
            "http://h:8001",
            "--vllm.url",
            "http://h:8000/other/metrics",
        ]
    )
    assert len(config.engine_targets) == 3


def test_localhost_and_127_0_0_1_for_one_port_are_warned_about():
    from exporter.config import loopback_aliases

    warnings = loopback_aliases(
        [
            "http://localhost:8000",
            "http://127.0.0.1:8000/metrics",
            "http://127.0.0.1:8001",
            "http://10.0.0.7:8000",
        ]
    )
    assert len(warnings) == 1
    assert "localhost:8000" in warnings[0] and "127.0.0.1:8000" in warnings[0]
    assert loopback_aliases(["http://localhost:8000", "http://[::1]:8001"]) == []
