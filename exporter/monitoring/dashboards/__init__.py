"""Grafana dashboards, one module per dashboard; shared panel factories in ``panels``."""

from __future__ import annotations

from grafanalib import core as g

from exporter.monitoring.config import MonitoringConfig
from exporter.monitoring.dashboards import caller, overview


def build_dashboards(config: MonitoringConfig) -> dict[str, g.Dashboard]:
    """File name (under dashboards/) -> dashboard."""
    return {
        overview.FILENAME: overview.build(config),
        caller.FILENAME: caller.build(config),
    }
