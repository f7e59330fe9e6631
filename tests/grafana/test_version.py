"""One Grafana version: the generator's constant is what compose.yaml runs, what the
Grafana-code test installs, and what every committed dashboard is saved for."""

from __future__ import annotations

import json

import yaml

from exporter.monitoring.dashboards.grafana import GRAFANA_VERSION, SCHEMA_VERSION
from tests.grafana.bootstrap import HERE
from tests.monitoring.common import DASHBOARD_DIR, ROOT

GRAFANA_PACKAGES = ("@grafana/data", "@grafana/schema")


def test_compose_runs_the_grafana_the_dashboards_target() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text("utf-8"))
    assert compose["services"]["grafana"]["image"] == f"grafana/grafana:{GRAFANA_VERSION}"


def test_the_grafana_code_test_installs_that_release() -> None:
    package = json.loads((HERE / "package.json").read_text("utf-8"))
    lock = json.loads((HERE / "package-lock.json").read_text("utf-8"))
    for name in GRAFANA_PACKAGES:
        assert package["dependencies"][name] == GRAFANA_VERSION, name
        assert lock["packages"][f"node_modules/{name}"]["version"] == GRAFANA_VERSION, name


def test_committed_dashboards_are_saved_for_that_release() -> None:
    paths = sorted(DASHBOARD_DIR.glob("*.json"))
    assert paths
    for path in paths:
        dashboard = json.loads(path.read_text("utf-8"))
        assert dashboard["schemaVersion"] == SCHEMA_VERSION, path.name
        for panel in dashboard["panels"]:
            if panel["type"] != "row":
                assert panel["pluginVersion"] == GRAFANA_VERSION, (path.name, panel["title"])
