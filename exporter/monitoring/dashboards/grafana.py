"""The Grafana the dashboards are made for, and the one pass that fits grafanalib's output to it.

``GRAFANA_VERSION`` is stated here and nowhere else: compose.yaml runs that image and the
npm packages the Grafana-code test loads are that release (tests check both). A panel saved
with a ``pluginVersion`` other than the running Grafana's goes through the panel plugin's
migration handler on every load, and the stat and bar gauge handler treats a panel without
one as a Grafana 6.1 panel: it rewrites a legacy ``options.fieldOptions`` block (reduction
``mean``, thresholds green/red at 80) and adds min/max to percent units. A dashboard whose
``schemaVersion`` is older than the running Grafana's goes through every schema migration in
between. Saved with this release's numbers, neither runs.

grafanalib 0.7 (the last release, 2024-01) writes the Grafana 5-7 JSON around the modern
panels: ``None`` for every unset field, dashboard ``rows``/``style``/``sharedCrosshair``,
targets with ``query``/``step``/``metric``, a bar gauge ``options.fieldOptions``, angular
table keys. ``to_current_schema`` removes exactly those, in this one place, so the factories
in ``panels`` stay declarative. What is left is checked against Grafana's own schema models
(grafana-foundation-sdk) and loaded through Grafana's own panel code (tests/grafana/).
"""

from __future__ import annotations

import json
from typing import Any

from grafanalib import core as g
from grafanalib._gen import DashboardEncoder

GRAFANA_VERSION = "12.1.1"
# The dashboard schema version Grafana GRAFANA_VERSION writes (@grafana/schema's
# defaultDashboard.schemaVersion of that release; tests/grafana/ checks it).
SCHEMA_VERSION = 41

# Keys grafanalib writes that the current dashboard schema has no field for.
_LEGACY_DASHBOARD_KEYS = ("__inputs", "hideControls", "rows", "sharedCrosshair", "style")
_LEGACY_TIMEPICKER_KEYS = ("time_options",)
_LEGACY_PANEL_KEYS = ("editable", "error", "height", "minSpan", "span")
# The angular table's layout, replaced by fieldConfig in Grafana 7.
_LEGACY_TABLE_KEYS = ("color", "columns", "fontSize", "mappings")
# Grafana 6 bar gauge layout; the show* pair belongs to the gauge panel.
_LEGACY_BARGAUGE_OPTIONS = ("fieldOptions", "showThresholdLabels", "showThresholdMarkers")
# Graphite-era target fields; ``query`` duplicates ``expr``.
_LEGACY_TARGET_KEYS = ("metric", "query", "step", "target")
_LEGACY_VARIABLE_KEYS = ("tagValuesQuery", "tagsQuery", "useTags")
# What a row panel is in the current schema: the rest grafanalib gives it belongs to data panels.
_ROW_KEYS = ("collapsed", "gridPos", "id", "panels", "repeat", "title", "type")


def to_current_schema(dashboard: g.Dashboard) -> dict[str, Any]:
    """The dashboard as plain JSON data in Grafana GRAFANA_VERSION's schema."""
    data = _without_nulls(json.loads(json.dumps(dashboard.to_json_data(), cls=DashboardEncoder)))
    _drop(data, _LEGACY_DASHBOARD_KEYS)
    _drop(data.get("timepicker", {}), _LEGACY_TIMEPICKER_KEYS)
    data["panels"] = [_current_panel(panel) for panel in data["panels"]]
    for variable in data["templating"]["list"]:
        _drop(variable, _LEGACY_VARIABLE_KEYS)
        current = variable.get("current", {})
        _drop(current, ("tags",))
        if set(current) <= {"selected"}:  # no value chosen: Grafana picks the default
            variable.pop("current", None)
    return data


def _current_panel(panel: dict[str, Any]) -> dict[str, Any]:
    if panel["type"] == "row":
        row = {key: panel[key] for key in _ROW_KEYS if key in panel}
        row["panels"] = [_current_panel(inner) for inner in row.get("panels", [])]
        return row
    _drop(panel, _LEGACY_PANEL_KEYS)
    panel["pluginVersion"] = GRAFANA_VERSION
    for target in panel.get("targets", []):
        _drop(target, _LEGACY_TARGET_KEYS)
    if panel["type"] == "table":
        _drop(panel, _LEGACY_TABLE_KEYS)
        custom = panel["fieldConfig"]["defaults"].setdefault("custom", {})
        display_mode = custom.pop("displayMode", "auto")
        custom.setdefault("cellOptions", {"type": display_mode})
    if panel["type"] == "bargauge":
        _drop(panel["options"], _LEGACY_BARGAUGE_OPTIONS)
    return panel


def _drop(data: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        data.pop(key, None)


def _without_nulls(data: Any) -> Any:
    """grafanalib's ``None`` means "not set": Grafana's schema has no null field but a
    threshold step's ``value``, where null is the base step (minus infinity)."""
    if isinstance(data, dict):
        is_threshold_step = set(data) == {"color", "value"}
        return {
            key: _without_nulls(value)
            for key, value in data.items()
            if value is not None or (is_threshold_step and key == "value")
        }
    if isinstance(data, list):
        return [_without_nulls(item) for item in data]
    return data
