"""Grafana's own schema models (grafana-foundation-sdk) read every committed dashboard and
keep every key and value of it.

The SDK's models are generated from Grafana's dashboard and panel schemas. Reading a
dashboard into them and writing it back drops whatever the schema has no field for (a
legacy key is silently lost) and fails on what the schema cannot hold (a null where an object
belongs). The SDK may add the schema's defaults on the way out; it may not lose or change
anything the dashboard says. The pinned build is the SDK's "next" flavour, generated from
Grafana's main branch: it has no flavour for Grafana 12.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.monitoring.common import DASHBOARD_DIR

sdk_dashboard = pytest.importorskip(
    "grafana_foundation_sdk.models.dashboard", reason="grafana-foundation-sdk needs Python 3.11+"
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder  # noqa: E402
from grafana_foundation_sdk.cog.plugins import register_default_plugins  # noqa: E402

DASHBOARDS = sorted(DASHBOARD_DIR.glob("*.json"))


def round_trip(dashboard: dict[str, Any]) -> dict[str, Any]:
    register_default_plugins()
    model = sdk_dashboard.Dashboard.from_json(dashboard)
    return json.loads(json.dumps(model, cls=JSONEncoder))


def lost(saved: Any, read: Any, path: str = "") -> list[str]:
    """Where ``read`` drops or changes something ``saved`` has (added keys are fine)."""
    if isinstance(saved, dict) and isinstance(read, dict):
        return [
            problem
            for key, value in saved.items()
            for problem in (
                lost(value, read[key], f"{path}/{key}")
                if key in read
                else [f"{path}/{key}: dropped"]
            )
        ]
    if isinstance(saved, list) and isinstance(read, list) and len(saved) == len(read):
        return [
            problem
            for index, (item, again) in enumerate(zip(saved, read, strict=True))
            for problem in lost(item, again, f"{path}[{index}]")
        ]
    return [] if saved == read else [f"{path}: {saved!r} became {read!r}"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_schema_models_read_the_dashboard_and_keep_all_of_it(path: Path) -> None:
    dashboard = json.loads(path.read_text("utf-8"))
    assert lost(dashboard, round_trip(dashboard)) == []


def test_a_legacy_key_is_noticed() -> None:
    """The check can fail: keys grafanalib 0.7 wrote and the schema lacks are reported."""
    dashboard = json.loads((DASHBOARD_DIR / "vllm-cache-overview.json").read_text("utf-8"))
    dashboard["rows"] = []
    bar_gauge = next(p for p in dashboard["panels"] if p["type"] == "bargauge")
    bar_gauge["options"]["fieldOptions"] = {"calcs": ["mean"]}
    bar_gauge["targets"][0]["step"] = 10
    where = f"/panels[{dashboard['panels'].index(bar_gauge)}]"
    assert sorted(lost(dashboard, round_trip(dashboard))) == [
        f"{where}/options/fieldOptions: dropped",
        f"{where}/targets[0]/step: dropped",
        "/rows: dropped",
    ]
