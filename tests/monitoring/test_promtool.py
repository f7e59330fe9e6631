"""The proof that the rules work: promtool on the committed files and on fresh output.

``promtool test rules`` runs alerts/tests/*.yaml: every alert silent before its ``for:``,
then firing with exact labels and annotations, and the healthy series that must stay silent.
Running them on freshly generated files as well means a generator change that breaks an
alert fails here even before anyone regenerates the committed files.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from exporter.monitoring.config import MonitoringConfig, config_from_mapping
from exporter.monitoring.render import ALERTS_PATH, RULES_PATH, prometheus_files
from exporter.signals.foresight import admission_budget
from tests.monitoring.common import (
    ALERTS_DIR,
    ALERTS_FILE,
    PROMTOOL_TESTS,
    ROOT,
    RULES_FILE,
    require_tool,
)
from tests.monitoring.workloads import SCENARIOS

DAY_LONG_SCENARIOS = {name for name, build in SCENARIOS.items() if build()[1] >= 24 * 60}


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=300)


def test_every_alert_file_has_promtool_tests() -> None:
    assert len(PROMTOOL_TESTS) >= 6, PROMTOOL_TESTS


def test_committed_rules_pass_promtool_check() -> None:
    promtool = require_tool("promtool")
    result = run(promtool, "check", "rules", str(RULES_FILE), str(ALERTS_FILE))
    assert result.returncode == 0, result.stdout + result.stderr


def test_committed_rules_pass_promtool_tests() -> None:
    promtool = require_tool("promtool")
    result = run(promtool, "test", "rules", *map(str, PROMTOOL_TESTS), cwd=ALERTS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(PROMTOOL_TESTS), result.stdout


def test_freshly_generated_rules_pass_promtool(tmp_path: Path) -> None:
    """Byte-identical rule files are the inputs the committed-file test already ran, so then
    the day-long scenarios are not run a second time; any difference runs them all."""
    promtool = require_tool("promtool")
    files = prometheus_files(MonitoringConfig())
    for relative, content in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    shutil.copytree(ALERTS_DIR / "tests", tmp_path / "alerts" / "tests")
    generated = tmp_path / "alerts"
    check = run(
        promtool,
        "check",
        "rules",
        str(generated / RULES_FILE.name),
        str(generated / ALERTS_FILE.name),
    )
    assert check.returncode == 0, check.stdout + check.stderr
    unchanged = all(
        files[relative] == (ROOT / relative).read_text(encoding="utf-8")
        for relative in (RULES_PATH, ALERTS_PATH)
    )
    tests = sorted(
        str(path)
        for path in (generated / "tests").glob("*.yaml")
        if not (unchanged and path.name in DAY_LONG_SCENARIOS)
    )
    assert tests
    result = run(promtool, "test", "rules", *tests, cwd=generated)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_tests_catch_a_broken_alert(tmp_path: Path) -> None:
    """The tests are not vacuous: an alert that can never fire fails them."""
    promtool = require_tool("promtool")
    shutil.copytree(ALERTS_DIR, tmp_path / "alerts")
    alerts = tmp_path / "alerts" / ALERTS_FILE.name
    text = alerts.read_text(encoding="utf-8")
    broken = text.replace("> 0.3)\n", "> 1.5)\n")  # no baseline is ever above 150%
    assert broken != text
    alerts.write_text(broken, encoding="utf-8")
    result = run(promtool, "test", "rules", "tests/prefix_collapse.yaml", cwd=tmp_path / "alerts")
    assert result.returncode != 0
    assert "VllmCachePrefixCollapse" in result.stdout + result.stderr


def _without_caller_unless(alerts: str) -> str:
    """The caller_target alert without its ``unless`` of the caller-wide collapse."""
    start = alerts.index("unless on", alerts.index("caller_model_target:vllm_cache_hit_ratio"))
    return alerts[:start] + alerts[alerts.index("\n    for:", start) :]


@pytest.mark.parametrize(
    ("file", "break_it", "fails_in"),
    [
        # Summed without target, the replica's ratio is the caller's blended 59%: no page.
        (
            RULES_FILE.name,
            lambda rules: rules.replace("caller, model, target)", "caller, model)"),
            "one replica of three evicts agent-a",
        ),
        # Without the unless, a caller collapsed everywhere pages once per replica too.
        (ALERTS_FILE.name, _without_caller_unless, "agent-b collapses on every replica"),
    ],
    ids=["no-target", "no-unless"],
)
def test_caller_target_test_fails_when_the_rule_breaks(
    tmp_path: Path, file: str, break_it: Callable[[str], str], fails_in: str
) -> None:
    """alerts/tests/caller_target_collapse.yaml is not vacuous: each half of the rule (the
    per-replica ratio, the one page per caller) is needed for it to pass."""
    promtool = require_tool("promtool")
    shutil.copytree(ALERTS_DIR, tmp_path / "alerts")
    path = tmp_path / "alerts" / file
    text = path.read_text(encoding="utf-8")
    broken = break_it(text)
    assert broken != text
    path.write_text(broken, encoding="utf-8")
    result = run(
        promtool, "test", "rules", "tests/caller_target_collapse.yaml", cwd=tmp_path / "alerts"
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert f"name: {fails_in}" in output, output


@pytest.mark.parametrize(
    ("override", "fails_at"),
    [
        # A baseline that remembers only 90 minutes becomes the collapse, as the 1h one did:
        # the pages resolve while the cache is still broken.
        ({"baseline_window": "90m"}, "time: 4h59m"),
        # Without keep_firing_for, B's pause resolves the pages and they page again after it.
        ({"collapse_keep_firing_for": "0s", "warm_ttft_keep_firing_for": "0s"}, "time: 3h25m"),
    ],
)
def test_long_collapse_test_fails_without_the_pinned_baseline_or_keep_firing_for(
    tmp_path: Path, override: dict[str, str], fails_at: str
) -> None:
    """alerts/tests/long_collapse.yaml holds the rules to what the issue asked for: each
    half of the design is needed for it to pass."""
    promtool = require_tool("promtool")
    alerts_dir = tmp_path / "alerts"
    (alerts_dir / "tests").mkdir(parents=True)
    for relative, content in prometheus_files(config_from_mapping(override)).items():
        if relative in (RULES_PATH, ALERTS_PATH):
            (tmp_path / relative).write_text(content, encoding="utf-8")
    shutil.copy(ALERTS_DIR / "tests" / "long_collapse.yaml", alerts_dir / "tests")
    result = run(promtool, "test", "rules", "tests/long_collapse.yaml", cwd=alerts_dir)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    # Not firing at all at that point of the collapse (not merely other annotation text).
    not_firing = re.compile(
        rf"alertname: VllmCachePrefixCollapse, {fails_at}, \n"
        rf"\s+exp:\[(?:(?!alertname: ).)*?\], \n\s+got:\[\]\n",
        re.S,
    )
    assert not_firing.search(output), output


def test_deploy_configs_are_valid(tmp_path: Path) -> None:
    """deploy/prometheus.yml beside the rule files, as compose mounts them; and the
    Alertmanager config."""
    promtool = require_tool("promtool")
    shutil.copy(ROOT / "deploy" / "prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copytree(ALERTS_DIR, tmp_path / "alerts")
    result = run(promtool, "check", "config", str(tmp_path / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 rule files found" in result.stdout + result.stderr
    amtool = require_tool("amtool")
    result = run(amtool, "check-config", str(ROOT / "deploy" / "alertmanager.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def _budget_alert_test(headroom: int) -> dict[str, object]:
    """Two conversations needing 90,000 tokens of a 100,000-token pool, with the admission
    budget the exporter serves for ``headroom`` (its --signals.admission-headroom)."""
    labels = (
        'job="vllm-cache-exporter", instance="exporter:10123", '
        'target="http://vllm:8000/metrics", model_name="m"'
    )
    budget = admission_budget(100_000, headroom)
    series = {
        "vllm_cache_engine_kv_pool_tokens": 100_000,
        "vllm_cache_engine_kv_pool_min_tokens": 100_000,
        "vllm_cache_engine_admission_budget_tokens": budget,
        "vllm_cache_engine_conversations_active": 2,
        "vllm_cache_engine_conversations_demand_tokens": 90_000,
    }
    per_engine = ("pool_tokens", "pool_min_tokens", "budget_tokens")
    return {
        "interval": "15s",
        "input_series": [
            {
                "series": f"{name}{{{labels}"
                + (', engine="0"' if name.endswith(per_engine) else "")
                + "}",
                "values": f"{value}x40",
            }
            for name, value in series.items()
        ],
        "promql_expr_test": [
            {
                "expr": 'count(ALERTS{alertname="VllmCacheConversationsExceedKVPool", '
                'alertstate="firing"}) or vector(0)',
                "eval_time": "5m",
                "exp_samples": [{"labels": "{}", "value": 1 if budget < 90_000 else 0}],
            }
        ],
    }


@pytest.mark.parametrize("headroom", [4_096, 20_000])
def test_the_demand_alert_fires_where_the_exporter_s_headroom_puts_the_budget(
    tmp_path: Path, headroom: int
) -> None:
    """VllmCacheConversationsExceedKVPool reads the exporter's own admission budget: the same
    demand and pool stay silent under the default headroom (budget 95,904) and fire under a
    headroom of 20,000 (budget 80,000), with no change to the monitoring config."""
    promtool = require_tool("promtool")
    alerts_dir = tmp_path / "alerts"
    (alerts_dir / "tests").mkdir(parents=True)
    for relative, content in prometheus_files(MonitoringConfig()).items():
        if relative in (RULES_PATH, ALERTS_PATH):
            (tmp_path / relative).write_text(content, encoding="utf-8")
    test_file = alerts_dir / "tests" / "budget.yaml"
    test_file.write_text(
        yaml.safe_dump(
            {
                "rule_files": ["../vllm-cache-rules.yaml", "../vllm-cache-alerts.yaml"],
                "evaluation_interval": "15s",
                "tests": [_budget_alert_test(headroom)],
            }
        ),
        "utf-8",
    )
    result = run(promtool, "test", "rules", "tests/budget.yaml", cwd=alerts_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    # And the other expectation fails: the test tells the two budgets apart.
    data = yaml.safe_load(test_file.read_text("utf-8"))
    sample = data["tests"][0]["promql_expr_test"][0]["exp_samples"][0]
    sample["value"] = 1 - sample["value"]
    test_file.write_text(yaml.safe_dump(data), "utf-8")
    assert run(promtool, "test", "rules", "tests/budget.yaml", cwd=alerts_dir).returncode != 0


@pytest.mark.parametrize(
    ("override", "wrong"),
    [
        # Without the replica fold, an HA pair's two copies double every absolute sum.
        (
            {"replica_labels": []},
            'target_model:vllm_cache_admission_budget_tokens:min7d", cluster="a", '
            'job="vllm-cache-exporter", model_name="m", target="http://vllm-0:8000/metrics"} '
            "3.991808E+06",
        ),
        # Without the topology labels, cluster a's and b's agent-a are one caller: 50%.
        (
            {"topology_labels": []},
            'caller_model:vllm_cache_hit_ratio:rate5m", caller="agent-a", '
            'job="vllm-cache-exporter", model="m"} 5E-01',
        ),
    ],
)
def test_fleet_test_fails_without_the_replica_fold_or_the_topology_labels(
    tmp_path: Path, override: dict[str, list[str]], wrong: str
) -> None:
    """alerts/tests/fleet.yaml holds the rules to a fleet's store: each setting is what keeps
    its figures right (the HA pair's budget read twice, 3,991,808 instead of 1,995,904; two
    clusters' callers merged into one of 50%)."""
    promtool = require_tool("promtool")
    alerts_dir = tmp_path / "alerts"
    (alerts_dir / "tests").mkdir(parents=True)
    for relative, content in prometheus_files(config_from_mapping(override)).items():
        if relative in (RULES_PATH, ALERTS_PATH):
            (tmp_path / relative).write_text(content, encoding="utf-8")
    shutil.copy(ALERTS_DIR / "tests" / "fleet.yaml", alerts_dir / "tests")
    result = run(promtool, "test", "rules", "tests/fleet.yaml", cwd=alerts_dir)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert wrong in output, output


@pytest.mark.parametrize(
    ("override", "break_rules", "wrong"),
    [
        # Without the replica fold, the HA pair's copies double the caller's cached tokens
        # (the prefill rate, a ratio of two doubled sums, does not move): 2 s saved, not 1.
        (
            {"replica_labels": []},
            None,
            '{caller="agent-a", cluster="a", job="vllm-cache-exporter", model="m"} 2E+00',
        ),
        # The same doubles the callers' tokens on vllm-0: 800 tokens/s bypassed, not 400.
        (
            {"replica_labels": []},
            None,
            'model_name="m", target="http://vllm-0:8000/metrics"} 8E+02',
        ),
        # Joined on model_name as the callers spell it (no label_replace): no caller has one,
        # so no figure at all.
        (
            {},
            lambda rules: rules.replace('"model", "$1", "model_name", "(.*)"', '"x", "", "", ""'),
            "got: nil",
        ),
    ],
    ids=["no-replica-fold", "no-replica-fold-bypassed", "no-model-join"],
)
def test_prefill_test_fails_without_the_replica_fold_or_the_model_join(
    tmp_path: Path,
    override: dict[str, list[str]],
    break_rules: Callable[[str], str] | None,
    wrong: str,
) -> None:
    """alerts/tests/prefill_and_cross_check.yaml holds the prefill and bypass rules to the
    HA fold, and the saved and lost seconds to the join of the callers' model with vLLM's
    model_name (without it they vanish: promtool's "got: nil")."""
    promtool = require_tool("promtool")
    alerts_dir = tmp_path / "alerts"
    (alerts_dir / "tests").mkdir(parents=True)
    for relative, content in prometheus_files(config_from_mapping(override)).items():
        if relative in (RULES_PATH, ALERTS_PATH):
            if break_rules is not None and relative == RULES_PATH:
                broken = break_rules(content)
                assert broken != content
                content = broken
            (tmp_path / relative).write_text(content, encoding="utf-8")
    shutil.copy(ALERTS_DIR / "tests" / "prefill_and_cross_check.yaml", alerts_dir / "tests")
    result = run(promtool, "test", "rules", "tests/prefill_and_cross_check.yaml", cwd=alerts_dir)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert wrong in output, output
