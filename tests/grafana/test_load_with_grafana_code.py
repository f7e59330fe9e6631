"""Every dashboard, loaded with Grafana's own published panel code, comes out as designed.

Proving the queries against a real Prometheus (tests/monitoring) says nothing about how
Grafana reads the JSON around them. Here each panel goes through what Grafana runs on load
(the plugin's migration handler, then its option and field-config defaults; see
load_dashboards.mjs) and every reduction, threshold, unit, min/max, mapping and override must
come out as saved. A dashboard with Grafana 6 bar gauge options is the proof that it can fail.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from exporter.monitoring.dashboards.grafana import GRAFANA_VERSION, SCHEMA_VERSION
from tests.monitoring.common import DASHBOARD_DIR

pytestmark = pytest.mark.grafana

DASHBOARDS = sorted(DASHBOARD_DIR.glob("*.json"))
SINGLE_STAT_TYPES = {"stat", "bargauge"}
Loader = Callable[..., dict[str, Any]]


def data_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    nested = [inner for panel in dashboard["panels"] for inner in panel.get("panels", [])]
    return [panel for panel in [*dashboard["panels"], *nested] if panel["type"] != "row"]


def test_every_committed_dashboard_loads_unchanged(load_with_grafana: Loader) -> None:
    assert len(DASHBOARDS) == 2
    report = load_with_grafana(*DASHBOARDS)
    assert report["grafanaVersion"] == GRAFANA_VERSION
    # The schema version the generator writes is the one Grafana's own package declares.
    assert report["schemaVersion"] == SCHEMA_VERSION
    for path, loaded in zip(DASHBOARDS, report["dashboards"], strict=True):
        saved = data_panels(json.loads(path.read_text("utf-8")))
        assert loaded["problems"] == [], (path.name, loaded["problems"])
        assert [panel["id"] for panel in loaded["panels"]] == [panel["id"] for panel in saved]
        for panel in loaded["panels"]:
            assert panel["problems"] == [], (path.name, panel["title"], panel["problems"])
            assert panel["changes"] == [], (path.name, panel["title"], panel["changes"])
        # Not vacuous: every single-stat panel went through Grafana's migration handler.
        migrated = {panel["id"] for panel in loaded["panels"] if panel["migration"]}
        single_stat = {panel["id"] for panel in saved if panel["type"] in SINGLE_STAT_TYPES}
        assert single_stat and migrated == single_stat, path.name


def legacy_overview() -> dict[str, Any]:
    """The overview as grafanalib 0.7 wrote it before: schemaVersion 38, no pluginVersion,
    and the bar gauge's Grafana 6 ``fieldOptions`` block next to the modern keys."""
    dashboard = json.loads((DASHBOARD_DIR / "vllm-cache-overview.json").read_text("utf-8"))
    dashboard["schemaVersion"] = 38
    for panel in data_panels(dashboard):
        panel.pop("pluginVersion")
    bar_gauge = next(p for p in data_panels(dashboard) if p["title"] == "KV pool in use")
    bar_gauge["options"]["fieldOptions"] = {
        "calcs": ["mean"],
        "defaults": {
            "decimals": None,
            "links": [],
            "max": 1.0,
            "min": 0,
            "title": None,
            "unit": "percentunit",
        },
        "limit": None,
        "mappings": [],
        "override": {},
        "values": False,
        "thresholds": [
            {
                "color": "green",
                "index": 0,
                "line": True,
                "op": "gt",
                "value": "null",
                "yaxis": "left",
            },
            {"color": "red", "index": 1, "line": True, "op": "gt", "value": 80.0, "yaxis": "left"},
        ],
    }
    return dashboard


def changes_of(loaded: dict[str, Any], title: str) -> dict[str, Any]:
    panel = next(p for p in loaded["panels"] if p["title"] == title)
    return {change["setting"]: change for change in panel["changes"]}


def test_a_legacy_panel_is_caught(load_with_grafana: Loader, tmp_path: Path) -> None:
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps(legacy_overview()), "utf-8")
    # A current panel whose base threshold is not "minus infinity": Grafana's defaulting
    # step moves it, so a wrong colour below the first step would go unseen.
    based = copy.deepcopy(json.loads((DASHBOARD_DIR / "vllm-cache-caller.json").read_text()))
    hit_ratio = next(p for p in data_panels(based) if p["title"] == "Hit ratio")
    hit_ratio["fieldConfig"]["defaults"]["thresholds"]["steps"][0]["value"] = 0
    based_path = tmp_path / "based.json"
    based_path.write_text(json.dumps(based), "utf-8")

    legacy_report, based_report = load_with_grafana(legacy, based_path)["dashboards"]

    assert any("schemaVersion 38" in problem for problem in legacy_report["problems"])
    bar_gauge = changes_of(legacy_report, "KV pool in use")
    assert bar_gauge["reduction"]["before"]["calcs"] == ["lastNotNull"]
    assert bar_gauge["reduction"]["after"]["calcs"] == ["mean"]
    assert [
        (step["color"], step["value"]) for step in bar_gauge["thresholds"]["after"]["steps"]
    ] == [("green", None), ("red", 80)]
    # Without a pluginVersion a percent stat is taken for a pre-8 panel and gets min/max.
    stat = changes_of(legacy_report, "Engine hit ratio")
    assert (stat["min"]["after"], stat["max"]["after"]) == (0, 1)
    assert all(panel["problems"] for panel in legacy_report["panels"])

    assert based_report["problems"] == []
    threshold = changes_of(based_report, "Hit ratio")["thresholds"]
    assert threshold["before"]["steps"][0]["value"] == 0
    assert threshold["after"]["steps"][0]["value"] is None
