"""Grafana dashboards, one module per dashboard; shared panel factories in ``panels``."""

from __future__ import annotations

from typing import Any

from exporter.monitoring.config import MonitoringConfig
from exporter.monitoring.dashboards import caller, overview
from exporter.monitoring.dashboards.grafana import to_current_schema


def build_dashboards(config: MonitoringConfig) -> dict[str, dict[str, Any]]:
    """File name (under dashboards/) -> the dashboard's JSON data, in the schema of the
    Grafana the stack runs."""
    return {
        overview.FILENAME: to_current_schema(overview.build(config)),
        caller.FILENAME: to_current_schema(caller.build(config)),
    }
