"""What users route and click on: alert names, labels, annotations, runbook sections, and
that every alert has promtool tests showing it both silent before ``for:`` and firing."""

from __future__ import annotations

import re
from collections import defaultdict

import yaml

from exporter.monitoring.alerts import ALERT_NAMES, runbook_anchor
from exporter.monitoring.config import SEVERITIES, MonitoringConfig, duration_seconds
from exporter.monitoring.render import prometheus_files
from tests.monitoring.common import (
    ALERTS_FILE,
    PROMTOOL_TESTS,
    RULES_FILE,
    RUNBOOK,
    load_yaml,
    rules,
)
from tests.monitoring.promql_scan import scan

ISSUE_ALERTS = {
    "VllmCachePrefixCollapse",
    "VllmCacheWarmTTFTCollapse",
    "VllmCachePrefixCachingDisabled",
    "VllmCacheCachedTokensNotReported",
    "VllmCachePreemptions",
    "VllmCacheKVPoolNearFull",
    "VllmCacheEngineDown",
    "VllmCacheEngineMetricAbsent",
    # foresight: the collapse seen coming
    "VllmCacheConversationsExceedKVPool",
    # prompt order: something variable at the top of the prompt (the tap)
    "VllmCachePromptVariableTop",
}
# Alerts whose expression's value is a number worth reading (the others are 0/1 states).
VALUED = {
    "VllmCachePrefixCollapse",
    "VllmCacheWarmTTFTCollapse",
    "VllmCacheCachedTokensNotReported",
    "VllmCachePreemptions",
    "VllmCacheKVPoolNearFull",
    "VllmCacheConversationsExceedKVPool",
    "VllmCachePromptVariableTop",
}


def alerts() -> list[dict]:
    return rules(ALERTS_FILE)


def test_alert_names_are_the_issue_s_plus_the_exporter_s_own_health() -> None:
    names = {rule["alert"] for rule in alerts()}
    assert ISSUE_ALERTS <= names
    own = {
        "VllmCacheExporterDown",
        "VllmCacheExporterAbsent",
        "VllmCacheDuplicateTarget",
        "VllmCacheUnseenHistory",
        "VllmCacheConversationsDropped",
    }
    assert names == set(ALERT_NAMES) == ISSUE_ALERTS | own
    for name in names:
        assert re.fullmatch(r"VllmCache[A-Z][A-Za-z]+", name)


def test_collapse_is_the_page() -> None:
    for rule in alerts():
        expected = "critical" if rule["alert"] == "VllmCachePrefixCollapse" else "warning"
        assert rule["labels"]["severity"] == expected, rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES
    scopes = {
        rule["labels"].get("scope")
        for rule in alerts()
        if rule["alert"] == "VllmCachePrefixCollapse"
    }
    assert scopes == {"engine", "caller", "caller_target"}


def test_annotations() -> None:
    config = MonitoringConfig()
    uids = {config.overview_uid, config.caller_uid}
    for rule in alerts():
        notes = rule["annotations"]
        assert set(notes) == {"summary", "description", "runbook_url", "dashboard_url"}
        summary = notes["summary"]
        assert "{{" not in summary and summary.endswith(".") and summary.count(". ") == 0
        assert "{{ $labels." in notes["description"], rule["alert"]
        if rule["alert"] in VALUED:  # the number that fired, humanized
            assert re.search(r"\$value \| humanize", notes["description"]), rule["alert"]
        assert notes["runbook_url"] == f"{config.runbook_url}#{runbook_anchor(rule['alert'])}"
        match = re.fullmatch(r"http://localhost:3000/d/([\w-]+)(\?.*)?", notes["dashboard_url"])
        assert match and match.group(1) in uids, notes["dashboard_url"]


def test_every_selector_carries_the_configured_selector() -> None:
    for rule in rules(RULES_FILE) + alerts():
        selectors, _ = scan(rule["expr"])
        assert selectors, rule
        for selector in selectors:
            assert 'job="vllm-cache-exporter"' in selector.matchers, (rule["expr"], selector)


def test_recording_rules_are_level_metric_operations() -> None:
    for rule in rules(RULES_FILE):
        level, metric, operations = rule["record"].split(":")
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", level), rule["record"]
        assert metric.startswith("vllm_cache_"), rule["record"]
        assert re.fullmatch(r"[a-z0-9_]+", operations), rule["record"]


def test_ratios_are_guarded_against_zero_denominators() -> None:
    recorded = {rule["record"]: rule["expr"] for rule in rules(RULES_FILE)}
    for name, expr in recorded.items():
        if not re.search(r"(ratio|share)", name):
            continue
        if "/" not in expr:  # a baseline: a quantile over time of a ratio recorded before it
            source = re.fullmatch(
                r"quantile_over_time\([0-9.]+, ([\w:]+)\{[^}]*\}\[\w+:\w+\]\)", expr
            )
            assert source and source.group(1) in recorded, name
            assert list(recorded).index(source.group(1)) < list(recorded).index(name), name
            expr = recorded[source.group(1)]
        denominator = expr.rsplit("/", 1)[1]
        assert denominator.strip().endswith("> 0)"), name


def test_runbook_has_a_section_per_alert_with_a_silence_example() -> None:
    text = RUNBOOK.read_text(encoding="utf-8")
    sections = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    for name in ALERT_NAMES:
        assert name in sections, f"docs/runbook.md has no '## {name}' section"
        assert runbook_anchor(name) == name.lower()  # GitHub's anchor for '## Name'
        body = sections[name]
        assert re.search(r"amtool .*silence add", body), f"{name}: no silence example"
        assert f"alertname={name}" in body, name


def test_every_alert_has_promtool_tests_silent_before_for_then_firing() -> None:
    firing: dict[str, list[float]] = defaultdict(list)
    silent: dict[str, list[float]] = defaultdict(list)
    for path in PROMTOOL_TESTS:
        for test in load_yaml(path)["tests"]:
            for case in test.get("alert_rule_test", []):
                seconds = duration_seconds(case["eval_time"])
                bucket = firing if case.get("exp_alerts") else silent
                bucket[case["alertname"]].append(seconds)
    for name in ALERT_NAMES:
        assert firing[name], f"no promtool test shows {name} firing"
        assert silent[name], f"no promtool test shows {name} silent"
        assert min(silent[name]) < min(firing[name]), name


def test_generated_yaml_round_trips() -> None:
    """Multi-line PromQL is written as literal blocks and reads back unchanged."""
    files = prometheus_files(MonitoringConfig())
    for relative in ("alerts/vllm-cache-rules.yaml", "alerts/vllm-cache-alerts.yaml"):
        data = yaml.safe_load(files[relative])
        assert data == load_yaml(RULES_FILE if "rules" in relative else ALERTS_FILE)


def test_runbook_appendix_lists_every_recorded_series() -> None:
    text = RUNBOOK.read_text(encoding="utf-8").split("## Appendix: recorded series", 1)[1]
    listed: set[str] = set()
    for cell in re.findall(r"^\| (.+?) \| [^|]+ \|$", text, flags=re.M):
        names = re.findall(r"`([^`]+)`", cell)
        base = ""
        for name in names:
            if name.startswith(":"):  # `x:y:rate5m`, `:rate1h` shorthand
                name = base.rsplit(":", 1)[0] + name
            base = name
            listed.add(name)
    recorded = {rule["record"] for rule in rules(RULES_FILE)}
    assert recorded == listed, (recorded - listed, listed - recorded)
