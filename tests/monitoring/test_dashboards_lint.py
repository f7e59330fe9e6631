"""Dashboard lint: what makes a shipped dashboard work on someone else's Grafana.

One ``datasource`` variable used by every panel and target (file provisioning cannot resolve
``${DS_PROMETHEUS}``), a unit and a description on every panel, ``$__rate_interval`` in every
rate, modern panel types, stable uids, and no query naming a series that neither the
exporter documents (docs/metrics.md) nor the recording rules produce: the field reports' "a
metric name that does not exist reads as a silent 0".
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from exporter.monitoring.config import MonitoringConfig
from exporter.monitoring.rules import recorded_names
from tests.monitoring.common import DASHBOARD_DIR, METRICS_DOC, RULES_FILE, rules
from tests.monitoring.promql_scan import metric_names, rate_windows, scan

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
MODERN_TYPES = {"timeseries", "stat", "table", "bargauge", "row"}
# Series Prometheus itself adds at scrape time.
PROMETHEUS_SERIES = {"up"}
DASHBOARDS = sorted(DASHBOARD_DIR.glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def data_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in panels(dashboard) if panel["type"] != "row"]


def targets(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [target for panel in data_panels(dashboard) for target in panel["targets"]]


def known_series() -> set[str]:
    documented = set(re.findall(r"`(vllm_cache_[a-z0-9_]+)`", METRICS_DOC.read_text("utf-8")))
    return documented | set(recorded_names(MonitoringConfig())) | PROMETHEUS_SERIES


def is_known(name: str, known: set[str]) -> bool:
    """Histogram series are documented under their family name."""
    return name in known or re.sub(r"_(bucket|sum|count)$", "", name) in known


def variable_queries(dashboard: dict[str, Any]) -> list[str]:
    return [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def test_both_dashboards_are_shipped() -> None:
    assert [p.name for p in DASHBOARDS] == ["vllm-cache-caller.json", "vllm-cache-overview.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_one_datasource_variable_used_everywhere(path: Path) -> None:
    dashboard = load(path)
    assert "DS_" not in path.read_text("utf-8")  # no ${DS_PROMETHEUS}-style inputs
    assert "__inputs" not in dashboard  # file provisioning has no import step to fill them
    sources = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert len(sources) == 1
    assert sources[0]["name"] == "datasource" and sources[0]["query"] == "prometheus"
    for panel in data_panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE, variable["name"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_has_title_description_unit_and_a_modern_type(path: Path) -> None:
    for panel in panels(load(path)):
        assert panel["type"] in MODERN_TYPES, (panel["title"], panel["type"])
        assert panel["title"], panel
        if panel["type"] == "row":
            continue
        assert panel["description"] and len(panel["description"]) > 30, panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_rate_uses_rate_interval(path: Path) -> None:
    dashboard = load(path)
    seen = 0
    for target in targets(dashboard):
        for window in rate_windows(target["expr"]):
            seen += 1
            assert window == "$__rate_interval", target["expr"]
        # and no other hard-coded range: recorded rates carry their window in their name
        _, windows = scan(target["expr"])
        assert all(w == "$__rate_interval" for w in windows), target["expr"]
    assert seen > 10


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_queried_series_is_documented_or_recorded(path: Path) -> None:
    dashboard = load(path)
    known = known_series()
    queried: set[str] = set()
    for target in targets(dashboard):
        names = metric_names(target["expr"])
        assert names, target["expr"]
        queried |= names
    for query in variable_queries(dashboard):
        inner = re.fullmatch(r"(?:label_values|query_result)\((.*?)(?:, *\w+)?\)", query)
        assert inner, query
        queried |= metric_names(inner.group(1))
    unknown = sorted(name for name in queried if not is_known(name, known))
    assert unknown == [], f"not in docs/metrics.md nor the recording rules: {unknown}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_variables_are_defined_and_used(path: Path) -> None:
    dashboard = load(path)
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    text = json.dumps([t["expr"] for t in targets(dashboard)] + variable_queries(dashboard))
    used = set(re.findall(r"\$\{?([a-zA-Z_]\w*)", text)) - {"__rate_interval", "__all"}
    assert used <= defined, used - defined
    assert defined - {"datasource"} <= used, defined - used
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            # multi-value variables must be matched with =~ (e2e substitutes .* for them)
            assert variable["includeAll"] and variable["allValue"] == ".*"
    assert not re.search(r'[a-z_]+="\$', text), "a variable matched with = instead of =~"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_stable_uid_ids_and_layout(path: Path) -> None:
    dashboard = load(path)
    config = MonitoringConfig()
    assert dashboard["uid"] in (config.overview_uid, config.caller_uid)
    assert "id" not in dashboard  # Grafana assigns its own; the uid is the stable name
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)) and all(ids)
    cells: set[tuple[int, int]] = set()
    for panel in panels(dashboard):
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        area = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area


def test_overview_and_caller_cover_the_issue() -> None:
    """The issue's list: hit ratio engine-wide and per caller, warm vs cold TTFT, states per
    caller, KV used vs pool in tokens, preemptions, running and waiting, prefix caching
    on/off per engine, granularity; and a per-caller drill-down."""
    overview_targets = targets(load(DASHBOARD_DIR / "vllm-cache-overview.json"))
    # A panel that reads a recorded series reads what its rule (and the rules it builds on)
    # reads: the dashboards read recorded series wherever a rule records them.
    recorded = {rule["record"]: rule["expr"] for rule in rules(RULES_FILE)}
    pending = [t["expr"] for t in overview_targets]
    read: list[str] = []
    while pending:
        expr = pending.pop()
        read.append(expr)
        pending.extend(recorded.pop(name) for name in metric_names(expr) if name in recorded)
    overview = " ".join(read)
    for series in (
        "vllm_cache_engine_prefix_cache_hits_tokens_total",
        "vllm_cache_cached_tokens_total",
        "vllm_cache_ttft_seconds_bucket",
        "vllm_cache_requests_total",
        "vllm_cache_engine_kv_used_tokens",
        "vllm_cache_engine_kv_pool_tokens",
        "vllm_cache_engine_preemptions_total",
        "vllm_cache_engine_requests_running",
        "vllm_cache_engine_requests_waiting",
        "vllm_cache_engine_prefix_caching_enabled",
        "vllm_cache_granularity_tokens",
    ):
        assert series in overview, series
    caller = load(DASHBOARD_DIR / "vllm-cache-caller.json")
    assert {v["name"] for v in caller["templating"]["list"]} >= {"datasource", "caller"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_table_overrides_name_columns_that_exist_after_renaming(path: Path) -> None:
    """Grafana applies field overrides after transformations: an override naming a column
    by its pre-rename name ("Value #C") silently does nothing."""
    for panel in data_panels(load(path)):
        renames: dict[str, str] = {}
        for step in panel.get("transformations", []):
            if step["id"] == "organize":
                renames.update(step["options"].get("renameByName", {}))
        for override in panel["fieldConfig"].get("overrides", []):
            if override["matcher"]["id"] == "byName" and renames:
                name = override["matcher"]["options"]
                assert name not in renames, f"{panel['title']}: override on renamed {name!r}"
                assert name in renames.values(), f"{panel['title']}: no column {name!r}"
