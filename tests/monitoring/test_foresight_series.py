"""The foresight promtool tests hold the series the exporter really served.

alerts/tests/conversations_*.yaml carry what a real exporter state served while the simulator
played each scenario in virtual time (tests/monitoring/foresight_series.py). Here: the
committed input series are exactly the builder's output, so the comments and assertions in
those files, written against the data, describe what the simulator and the exporter do today;
and the builder reads what it claims (the demand the collapse file quotes is the exporter's).
"""

from __future__ import annotations

import pytest

from exporter.monitoring.alerts import alert_rule_groups
from exporter.monitoring.config import MonitoringConfig
from tests.monitoring import foresight_series
from tests.monitoring.common import load_yaml


@pytest.mark.parametrize("filename", sorted(foresight_series.SCENARIOS))
def test_committed_input_series_are_what_the_exporter_served(filename: str) -> None:
    path = foresight_series.ALERTS_TESTS / filename
    text = path.read_text(encoding="utf-8")
    assert foresight_series.render(filename, text) == text, (
        f"{path.name} drifted from what the simulator and the exporter produce: run "
        "`python -m tests.monitoring.foresight_series` and review the diff (and the "
        "hand-written assertions of the overflowing scenarios)")


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
    demand of two live conversations passes the pool less the default headroom at 4m45s,
    when the engine's hit ratio over the last 5 minutes still reads healthy."""
    played = foresight_series.exporter_series("two-agents-collapse")
    series = {name.split("{")[0]: values for name, values in played.series.items()}
    demand = series["vllm_cache_engine_conversations_demand_tokens"]
    active = series["vllm_cache_engine_conversations_active"]
    pool = series["vllm_cache_engine_kv_pool_tokens"]
    headroom = MonitoringConfig().conversations_headroom_tokens
    over = [step for step in range(played.steps + 1)
            if demand[step] is not None and active[step] is not None and active[step] >= 2
            and demand[step] > pool[step] - headroom]
    assert over[0] * foresight_series.STEP_SECONDS == 4 * 60 + 45
    hits = series["vllm_cache_engine_prefix_cache_hits_tokens_total"]
    queries = series["vllm_cache_engine_prefix_cache_queries_tokens_total"]
    window = 5 * 60 // foresight_series.STEP_SECONDS
    start, end = max(0, over[0] - window), over[0]
    ratio = (hits[end] - hits[start]) / (queries[end] - queries[start])  # type: ignore[operator]
    assert ratio > 0.6, "the hit ratio must still look healthy when the demand passes"


def test_the_promtool_files_quote_the_shipped_alert() -> None:
    """The expression the files exercise is the generated one (no copy to drift)."""
    rules = [rule for group in alert_rule_groups(MonitoringConfig()) for rule in group["rules"]
             if rule.get("alert") == "VllmCacheConversationsExceedKVPool"]
    assert len(rules) == 1 and rules[0]["for"] == "2m"
