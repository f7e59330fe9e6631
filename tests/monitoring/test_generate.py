"""``vllm-cache-exporter generate``: deterministic output, --check, --config, operator format."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from exporter.cli import main
from exporter.monitoring.config import (
    MonitoringConfig,
    MonitoringConfigError,
    config_from_mapping,
    duration_seconds,
    load_config,
)
from exporter.monitoring.render import ALERTS_PATH, RULES_PATH, prometheus_files
from exporter.signals.history import Windows
from tests.monitoring.common import ROOT
from tests.monitoring.promql_scan import scan


def write_config(tmp_path: Path, data: object) -> str:
    path = tmp_path / "monitoring.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data, "utf-8")
    return str(path)


def generated_exprs(files: dict[str, str]) -> list[str]:
    exprs = []
    for relative in (RULES_PATH, ALERTS_PATH):
        for group in yaml.safe_load(files[relative])["groups"]:
            exprs.extend(rule["expr"] for rule in group["rules"])
    for relative, content in files.items():
        if relative.startswith("dashboards/"):
            for panel in json.loads(content)["panels"]:
                exprs.extend(target["expr"] for target in panel.get("targets", []))
    return exprs


def test_committed_files_are_what_the_generators_produce(capsys) -> None:
    """What CI runs: a hand edit or a forgotten regeneration fails here."""
    assert main(["generate", "--check", "--output-dir", str(ROOT)]) == 0, capsys.readouterr().err


def test_output_is_deterministic() -> None:
    first, second = prometheus_files(MonitoringConfig()), prometheus_files(MonitoringConfig())
    assert first == second
    for relative, content in first.items():
        if relative.endswith(".json"):
            assert content == json.dumps(json.loads(content), sort_keys=True, indent=2) + "\n"


def test_generate_writes_then_check_passes(tmp_path: Path, capsys) -> None:
    assert main(["generate", "--output-dir", str(tmp_path)]) == 0
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(prometheus_files(MonitoringConfig()))
    capsys.readouterr()
    assert main(["generate", "--check", "--output-dir", str(tmp_path)]) == 0
    assert "up to date" in capsys.readouterr().out


def test_check_reports_every_kind_of_drift(tmp_path: Path, capsys) -> None:
    assert main(["generate", "--output-dir", str(tmp_path)]) == 0
    alerts = tmp_path / ALERTS_PATH
    alerts.write_text(alerts.read_text("utf-8").replace("for: 5m", "for: 1m", 1), "utf-8")
    (tmp_path / "dashboards" / "vllm-cache-caller.json").unlink()
    (tmp_path / "dashboards" / "hand-made.json").write_text("{}", "utf-8")
    capsys.readouterr()
    assert main(["generate", "--check", "--output-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{ALERTS_PATH}: differs" in err
    assert "-    for: 1m" in err and "+    for: 5m" in err  # a unified diff, both sides
    assert "dashboards/vllm-cache-caller.json: missing" in err
    assert "dashboards/hand-made.json: stale" in err
    assert f"3 of {len(prometheus_files(MonitoringConfig()))} file(s) out of date" in err
    # --check wrote nothing
    assert not (tmp_path / "dashboards" / "vllm-cache-caller.json").exists()


def test_config_overrides_reach_every_expression(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        {
            "selector": 'job="llm-cache", cluster="eu-1"',
            "extra_group_labels": ["namespace"],
            "short_window": "10m",
            "long_window": "2h",
            "baseline_window": "7d",
            "exporter_absent_window": "2h",
            "collapse_severity": "warning",
            "collapse_for": "15m",
            "collapse_keep_firing_for": "0s",
            "warm_ttft_keep_firing_for": "20m",
            "runbook_url": "https://runbooks.example/vllm.md",
            "dashboard_url": "https://grafana.example/",
            "caller_uid": "my-callers",
        },
    )
    config = load_config(path)
    files = prometheus_files(config)
    exprs = generated_exprs(files)
    assert exprs
    for expr in exprs:
        selectors, windows = scan(expr)
        for selector in selectors:
            assert 'job="llm-cache"' in selector.matchers, (expr, selector)
            assert 'cluster="eu-1"' in selector.matchers, (expr, selector)
        for window in windows:
            # the baseline reads 288 instants of the week: one every 35 minutes
            assert window in ("10m", "2h", "7d", "7d:35m", "$__rate_interval"), (expr, window)
    # Rules keep the selector's labels and the extra ones in every aggregation, so two
    # clusters are never summed into one ratio.
    rule_exprs = generated_exprs({k: v for k, v in files.items() if k.startswith("alerts/")})
    groupings = [
        set(map(str.strip, g.split(",")))
        for expr in rule_exprs
        for g in re.findall(r"\bby \(([^)]*)\)", expr)
    ]
    assert groupings
    for grouping in groupings:
        assert {"job", "cluster", "namespace"} <= grouping, grouping
    alerts = [
        rule for group in yaml.safe_load(files[ALERTS_PATH])["groups"] for rule in group["rules"]
    ]
    collapse = [rule for rule in alerts if rule["alert"] == "VllmCachePrefixCollapse"]
    assert {rule["labels"]["severity"] for rule in collapse} == {"warning"}
    assert {rule["for"] for rule in collapse} == {"15m"}
    assert "caller_model:vllm_cache_hit_ratio:rate10m" in collapse[1]["expr"]
    assert "caller_model:vllm_cache_hit_ratio:p90_7d_rate2h" in collapse[1]["expr"]
    # keep_firing_for: "0s" leaves the key out (Prometheus' default); others are written.
    assert all("keep_firing_for" not in rule for rule in collapse)
    (warm_ttft,) = [rule for rule in alerts if rule["alert"] == "VllmCacheWarmTTFTCollapse"]
    assert warm_ttft["keep_firing_for"] == "20m"
    assert [rule["alert"] for rule in alerts if "keep_firing_for" in rule] == [
        "VllmCacheWarmTTFTCollapse"
    ]
    for rule in alerts:
        assert rule["annotations"]["runbook_url"].startswith("https://runbooks.example/vllm.md#")
        assert rule["annotations"]["dashboard_url"].startswith("https://grafana.example/d/")
    assert collapse[1]["annotations"]["dashboard_url"].startswith(
        "https://grafana.example/d/my-callers?"
    )
    assert json.loads(files["dashboards/vllm-cache-caller.json"])["uid"] == "my-callers"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"colapse_for": "5m"}, "colapse_for: unknown setting"),
        ({"collapse_for": "five minutes"}, "collapse_for: expected a Prometheus duration"),
        (
            {"collapse_severity": "page"},
            "collapse_severity: must be one of critical, warning, info",
        ),
        ({"short_window": "2h"}, "short_window: must be shorter than long_window"),
        ({"baseline_window": "30m"}, "long_window: must be shorter than baseline_window"),
        ({"caller_long_interval": "10m"}, "caller_long_interval: must be at most 5m"),
        ({"caller_detail_interval": "6m"}, "caller_detail_interval: must be at most 5m"),
        ({"caller_interval": "6m"}, "caller_interval: must be at most 5m"),
        ({"caller_long_interval": "0s"}, "caller_long_interval: must be longer than 0"),
        (
            {"collapse_keep_firing_for": "soon"},
            "collapse_keep_firing_for: expected a Prometheus duration",
        ),
        ({"collapse_drop_factor": 2}, "collapse_drop_factor: must be in (0, 1]"),
        ({"collapse_drop_factor": "half"}, "collapse_drop_factor: expected a number"),
        ({"selector": "job=vllm"}, "selector: expected label matchers"),
        ({"extra_group_labels": ["bad-label"]}, "extra_group_labels: 'bad-label' is not a label"),
        ({"caller_uid": "vllm-cache-overview"}, "caller_uid: must differ from overview_uid"),
        ({"dashboard_url": "grafana:3000"}, "dashboard_url: must be an http(s) URL"),
        ({"required_signals": []}, "required_signals: must name at least one signal"),
        ({"hit_ratio_good": 0.2}, "hit_ratio_good: must be above hit_ratio_fair (0.3)"),
        ({"warm_share_fair": 0}, "warm_share_fair: must be in (0, 1]"),
        (
            {"conversations_headroom_tokens": 8192},
            "conversations_headroom_tokens: removed: VllmCacheConversationsExceedKVPool reads the "
            "exporter's vllm_cache_engine_admission_budget_tokens",
        ),
        ("- a list\n", "must hold a mapping of settings"),
        ("key: [unclosed\n", "not valid YAML at line"),
    ],
)
def test_bad_config_is_one_clear_line_and_exit_2(
    tmp_path: Path, capsys, data: object, message: str
) -> None:
    path = write_config(tmp_path, data)
    assert main(["generate", "--monitoring.config-file", path, "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "alerts").exists()


def test_flags_that_do_not_go_together(tmp_path: Path, capsys) -> None:
    assert main(["generate", "--output", str(tmp_path / "x.yaml")]) == 2
    assert "--output goes with --format prometheus-operator" in capsys.readouterr().err
    assert main(["generate", "--format", "prometheus-operator", "--check"]) == 2
    assert "needs --output FILE" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()


def test_missing_config_file(tmp_path: Path, capsys) -> None:
    assert main(["generate", "--monitoring.config-file", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_config_block_defaults_validate_and_types_are_kept() -> None:
    config = config_from_mapping({"collapse_for": "90s", "preemptions_per_minute": 3})
    assert config.collapse_for == "90s"
    assert config.preemptions_per_minute == 3.0
    assert config.group_labels == ("job", "cluster", "namespace")
    assert config_from_mapping({"topology_labels": []}).group_labels == ("job",)
    with pytest.raises(MonitoringConfigError):
        MonitoringConfig(long_window="0s")


def test_prometheus_operator_manifest(tmp_path: Path, capsys) -> None:
    assert main(["generate", "--format", "prometheus-operator"]) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["metadata"]["name"] == "vllm-cache-exporter"
    files = prometheus_files(MonitoringConfig())
    expected = (
        yaml.safe_load(files[RULES_PATH])["groups"] + yaml.safe_load(files[ALERTS_PATH])["groups"]
    )
    assert manifest["spec"]["groups"] == expected

    config = write_config(
        tmp_path, {"prometheus_rule_namespace": "llm", "prometheus_rule_labels": {"release": "kps"}}
    )
    output = tmp_path / "rule.yaml"
    args = [
        "generate",
        "--format",
        "prometheus-operator",
        "--monitoring.config-file",
        config,
        "--output",
        str(output),
    ]
    assert main(args) == 0
    written = yaml.safe_load(output.read_text("utf-8"))
    assert written["metadata"] == {
        "name": "vllm-cache-exporter",
        "namespace": "llm",
        "labels": {"release": "kps"},
    }
    assert main([*args, "--check"]) == 0
    output.write_text("stale\n", "utf-8")
    assert main([*args, "--check"]) == 1


def test_check_outside_the_repository_says_where_it_looked(tmp_path, capsys):
    assert main(["generate", "--check", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "--output-dir" in err
    assert "missing" not in err


def test_every_sum_of_the_exporter_s_series_folds_an_ha_pair_s_copies_first() -> None:
    """An HA pair of Prometheus servers writing into one store gives each of the exporter's
    series twice, told apart by ``prometheus_replica``: no rule or alert sums (or counts) one
    of the exporter's own series without ``max without (prometheus_replica)`` around it, or
    it reads double (alerts/tests/fleet.yaml has the figures)."""
    files = prometheus_files(MonitoringConfig())
    exprs = generated_exprs({k: v for k, v in files.items() if k.startswith("alerts/")})
    unfolded = re.compile(
        r"\b(?:sum|count) by \([^)]*\) \((?:rate|min_over_time)?\(?(?:vllm_cache_\w+|up)\{"
    )
    folded = re.compile(r"\b(?:sum|count) by \([^)]*\) \(max without \(prometheus_replica\)")
    assert any(folded.search(expr) for expr in exprs)
    for expr in exprs:
        assert not unfolded.search(expr), expr


@pytest.mark.parametrize(
    "windows",
    [
        {},
        {"short_window": "15s", "long_window": "2m", "baseline_window": "10m"},
        {"baseline_window": "7d"},
        {"short_window": "1h", "long_window": "2h", "baseline_window": "3h"},
    ],
)
def test_the_baseline_reads_the_instants_the_status_page_reads(windows: dict[str, str]) -> None:
    """One answer: every baseline rule is the quantile of the long-window ratio at the
    instants the page keeps (exporter/signals/history.py), a subquery whose step is the page's
    baseline interval (aligned to its multiples in both), not one sample per evaluation."""
    config = config_from_mapping(windows)
    page = Windows(config.short_seconds, config.long_seconds, config.baseline_seconds)
    assert duration_seconds(config.baseline_step) == page.baseline_interval
    groups = yaml.safe_load(prometheus_files(config)[RULES_PATH])["groups"]
    baselines = [
        rule["expr"]
        for group in groups
        for rule in group["rules"]
        if "quantile_over_time" in rule["expr"]
    ]
    assert len(baselines) == 3  # the caller's hit ratio and warm share, the engine's ratio
    for expr in baselines:
        assert expr.endswith(f"[{config.baseline_window}:{config.baseline_step}])"), expr


def test_the_long_window_group_has_its_own_interval() -> None:
    """Per caller, only the collapse alert's short-window ratio is evaluated every
    caller_interval (30 s: every 15 s it is over 10% of the interval at 10,000 callers x 3
    models); the rest of the short window every caller_detail_interval, the long windows and
    baselines every caller_long_interval; the engine rules every rule_interval (else
    Prometheus' global interval)."""
    for settings, intervals in (
        (
            {},
            {
                "vllm-cache-caller.rules": "30s",
                "vllm-cache-caller-detail.rules": "2m",
                "vllm-cache-caller-long.rules": "2m",
            },
        ),
        (
            {
                "rule_interval": "30s",
                "caller_interval": "1m",
                "caller_detail_interval": "45s",
                "caller_long_interval": "2m",
            },
            {
                "vllm-cache-caller.rules": "1m",
                "vllm-cache-caller-detail.rules": "45s",
                "vllm-cache-caller-long.rules": "2m",
                "vllm-cache-engine.rules": "30s",
            },
        ),
    ):
        files = prometheus_files(config_from_mapping(settings))
        groups = yaml.safe_load(files[RULES_PATH])["groups"]
        assert {
            group["name"]: group.get("interval") for group in groups if "interval" in group
        } == (intervals)
