"""The foresight promtool tests hold the series the exporter really served.

alerts/tests/conversations_*.yaml carry what a real exporter state served while the simulator
played each scenario in virtual time (tests/monitoring/foresight_series.py). Here: the
committed input series are exactly the builder's output, so the comments and assertions in
those files, written against the data, describe what the simulator and the exporter do today;
and the builder reads what it claims (the demand the collapse file quotes is the exporter's).
"""

from __future__ import annotations

import re

import pytest

from exporter.cli import parse
from exporter.config import build_config
from exporter.demo import exporter_config
from exporter.monitoring.alerts import alert_rule_groups
from exporter.monitoring.config import MonitoringConfig
from exporter.sim import scenario as scenarios
from exporter.wiring import foresight_settings, usage_settings
from tests.deploy.helpers import ROOT, command_args, flag_value, resolved_compose
from tests.monitoring import foresight_series
from tests.monitoring.common import load_yaml

COLLAPSE_FILE = foresight_series.ALERTS_TESTS / foresight_series.filename("two-agents-collapse")
NUMBER_WORDS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
)


@pytest.mark.parametrize("filename", sorted(foresight_series.SCENARIOS))
def test_committed_input_series_are_what_the_exporter_served(filename: str) -> None:
    path = foresight_series.ALERTS_TESTS / filename
    text = path.read_text(encoding="utf-8")
    assert foresight_series.render(filename, text) == text, (
        f"{path.name} drifted from what the simulator and the exporter produce: run "
        "`python -m tests.monitoring.foresight_series` and review the diff (and the "
        "hand-written assertions of the overflowing scenarios)"
    )


def test_every_scenario_file_runs_the_series_through_the_shipped_rules() -> None:
    for filename in foresight_series.SCENARIOS:
        data = load_yaml(foresight_series.ALERTS_TESTS / filename)
        assert data["rule_files"] == ["../vllm-cache-rules.yaml", "../vllm-cache-alerts.yaml"]
        (test,) = data["tests"]
        assert test["interval"] == f"{foresight_series.STEP_SECONDS}s"
        names = {item["series"].split("{")[0] for item in test["input_series"]}
        assert names == set(foresight_series.SERIES), filename


def test_the_collapse_is_seen_in_the_demand_before_the_hit_ratio() -> None:
    """The data behind conversations_two_agents_collapse.yaml, read without promtool: the
    demand of two live conversations passes the exporter's admission budget at 7m (once
    agent-b's second turn has ended: one request alone is no conversation yet), when the
    engine's hit ratio over the last 5 minutes still reads healthy."""
    played = foresight_series.exporter_series("two-agents-collapse")
    series = {name.split("{")[0]: values for name, values in played.series.items()}
    demand = series["vllm_cache_engine_conversations_demand_tokens"]
    active = series["vllm_cache_engine_conversations_active"]
    budget = series["vllm_cache_engine_admission_budget_tokens"]
    over = [
        step
        for step in range(played.steps + 1)
        if demand[step] is not None
        and active[step] is not None
        and active[step] >= 2
        and demand[step] > budget[step]
    ]
    assert over[0] * foresight_series.STEP_SECONDS == 7 * 60
    hits = series["vllm_cache_engine_prefix_cache_hits_tokens_total"]
    queries = series["vllm_cache_engine_prefix_cache_queries_tokens_total"]
    window = 5 * 60 // foresight_series.STEP_SECONDS
    start, end = max(0, over[0] - window), over[0]
    ratio = (hits[end] - hits[start]) / (queries[end] - queries[start])  # type: ignore[operator]
    # Over half, agent-b's cold first read in it (0 at the collapse): nothing alarming yet.
    assert ratio > 0.5, "the hit ratio must still look healthy when the demand passes"


def test_the_promtool_files_quote_the_shipped_alert() -> None:
    """The expression the files exercise is the generated one (no copy to drift)."""
    rules = [
        rule
        for group in alert_rule_groups(MonitoringConfig())
        for rule in group["rules"]
        if rule.get("alert") == "VllmCacheConversationsExceedKVPool"
    ]
    assert len(rules) == 1 and rules[0]["for"] == "2m"


def _seconds(text: str) -> int:
    """A promtool duration of minutes and seconds ("4m45s", "13m") in seconds."""
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", text)
    assert match, text
    return int(match[1] or 0) * 60 + int(match[2] or 0)


def _warning_and_page() -> tuple[int, int]:
    """From the collapse scenario's promtool file (which test_promtool runs, so these are the
    times the shipped rules give): when the demand alert's expression first holds (pending),
    and when VllmCachePrefixCollapse first fires; each checked against the evaluation before
    it, which must show neither."""
    (test,) = load_yaml(COLLAPSE_FILE)["tests"]
    pending = sorted(
        (_seconds(item["eval_time"]), bool(item["exp_samples"]))
        for item in test["promql_expr_test"]
        if item["expr"] == 'ALERTS{alertname="VllmCacheConversationsExceedKVPool"}'
    )
    pages = sorted(
        (_seconds(item["eval_time"]), bool(item["exp_alerts"]))
        for item in test["alert_rule_test"]
        if item["alertname"] == "VllmCachePrefixCollapse"
    )
    times = []
    for checks in (pending, pages):
        first = next(index for index, (_, seen) in enumerate(checks) if seen)
        assert first > 0 and not checks[first - 1][1], checks
        assert checks[first][0] - checks[first - 1][0] == foresight_series.STEP_SECONDS
        times.append(checks[first][0])
    return times[0], times[1]


def test_the_minutes_before_the_page_that_the_docs_quote_are_measured():
    """docs/monitoring.md and the runbook say how long before VllmCachePrefixCollapse pages the
    demand alert's expression is true, in report 000's replay: the whole minutes between the
    two times the promtool file asserts (and the demand series, read here, agrees on the
    first)."""
    warning, page = _warning_and_page()
    played = foresight_series.exporter_series("two-agents-collapse")
    series = {name.split("{")[0]: values for name, values in played.series.items()}
    demand = series["vllm_cache_engine_conversations_demand_tokens"]
    budget = series["vllm_cache_engine_admission_budget_tokens"]
    first = next(
        step
        for step, value in enumerate(demand)
        if value is not None and value > (budget[step] or 0)
    )
    assert first * foresight_series.STEP_SECONDS == warning
    words = NUMBER_WORDS[(page - warning) // 60]
    readme = " ".join((ROOT / "docs" / "monitoring.md").read_text(encoding="utf-8").split())
    assert (
        f"its expression is true {words} minutes before `VllmCachePrefixCollapse` pages" in readme
    )
    runbook = " ".join((ROOT / "docs" / "runbook.md").read_text(encoding="utf-8").split())
    assert f"stays true the {words} minutes until `VllmCachePrefixCollapse` pages" in runbook
    header = COLLAPSE_FILE.read_text(encoding="utf-8")
    assert f"- name: the demand alert is true {words} minutes before the collapse pages" in header


def test_compose_and_the_demo_give_the_same_fit_signal():
    """compose.yaml starts the exporter with no scenario-specific flag, and so does the demo:
    the same usage and foresight settings, so the same demand and the same warning times
    (those of the committed promtool file) on the scenario compose's simulator plays."""
    services = resolved_compose()["services"]
    exporter = services["exporter"]
    compose = build_config(parse(command_args(exporter)), environ=exporter.get("environment") or {})
    name = flag_value(command_args(services["simulator"]), "--scenario") or ""
    demo = exporter_config(scenarios.load(name), "http://127.0.0.1:8000")
    assert foresight_settings(compose) == foresight_settings(demo)
    assert compose.signals_state_tokens == ()
    for setting in ("granularity", "warm_tail_granules", "missing_cached_as_zero"):
        assert getattr(usage_settings(compose), setting) == getattr(usage_settings(demo), setting)
    served = {
        config_name: foresight_series.exporter_series(name, config).series
        for config_name, config in (("compose", compose), ("demo", demo))
    }
    keep = (
        "vllm_cache_engine_conversations_demand_tokens",
        "vllm_cache_engine_conversations_active",
        "vllm_cache_engine_kv_pool_tokens",
    )
    picked = {
        config_name: {key: values for key, values in series.items() if key.startswith(keep)}
        for config_name, series in served.items()
    }
    assert picked["compose"] == picked["demo"] and len(picked["demo"]) == 3
    if name == "two-agents-collapse":
        committed = foresight_series.exporter_series(name).series
        assert {key: values for key, values in committed.items() if key.startswith(keep)} == picked[
            "demo"
        ]
