"""Every series a generated rule, alert or dashboard reads is served or recorded.

Served: a family of exporter/families.py (its sample names: ``_total``, ``_bucket``...),
what client_python's standard collectors add, or ``up`` (Prometheus' own). Recorded: the
``record:`` of a generated rule. The exporter relays no vLLM series under vLLM's names
(``vllm:...``): every engine signal is served under its own ``vllm_cache_engine_`` name, so
a ``vllm:`` name in a query is an error too. A rename in the table that the generators did
not follow, or a rule that was dropped while a panel still reads it, fails here.
"""

from __future__ import annotations

import re
from typing import Any

from exporter import families
from exporter.monitoring.alerts import alert_rule_groups
from exporter.monitoring.config import MonitoringConfig
from exporter.monitoring.dashboards import build_dashboards
from exporter.monitoring.rules import recording_rule_groups
from tests.monitoring.promql_scan import metric_names

PROMETHEUS_SERIES = {"up"}


def served() -> set[str]:
    names = {name for family in families.FAMILIES for name in family.sample_names()}
    return names | set(families.CLIENT_PYTHON) | PROMETHEUS_SERIES


def rule_expressions(config: MonitoringConfig) -> list[str]:
    """Every rule's and alert's expression, and the queries its annotations run."""
    exprs = []
    for group in [*recording_rule_groups(config), *alert_rule_groups(config)]:
        for rule in group["rules"]:
            exprs.append(rule["expr"])
            for text in rule.get("annotations", {}).values():
                exprs.extend(re.findall(r'printf "([^"{]+)\{', text))
    return exprs


def dashboard_expressions(config: MonitoringConfig) -> list[str]:
    exprs = []
    for dashboard in build_dashboards(config).values():
        panels: list[dict[str, Any]] = []
        for panel in dashboard["panels"]:
            panels.extend([panel, *panel.get("panels", [])])
        exprs.extend(target["expr"] for panel in panels for target in panel.get("targets", []))
        for variable in dashboard["templating"]["list"]:
            if variable["type"] == "query":
                inner = re.fullmatch(
                    r"(?:label_values|query_result)\((.*?)(?:, *\w+)?\)", variable["query"]
                )
                assert inner, variable["query"]
                exprs.append(inner.group(1))
    return exprs


def unknown_names(config: MonitoringConfig, known: set[str]) -> dict[str, list[str]]:
    """Name -> the expressions that read it, for every name neither served nor recorded."""
    recorded = {
        rule["record"] for group in recording_rule_groups(config) for rule in group["rules"]
    }
    unknown: dict[str, list[str]] = {}
    for expr in rule_expressions(config) + dashboard_expressions(config):
        names = metric_names(expr)
        assert names, expr
        for name in names - known - recorded:
            unknown.setdefault(name, []).append(expr)
    return unknown


def test_every_series_a_rule_alert_or_panel_reads_is_served_or_recorded() -> None:
    config = MonitoringConfig()
    assert len(rule_expressions(config)) > 50 and len(dashboard_expressions(config)) > 40
    assert unknown_names(config, served()) == {}


def test_a_family_the_exporter_stops_serving_is_caught() -> None:
    """Take one family out of the table: every query that reads it is reported."""
    known = served() - set(families.CACHED_TOKENS.sample_names())
    unknown = unknown_names(MonitoringConfig(), known)
    assert set(unknown) == {families.CACHED_TOKENS.total}
    assert len(unknown[families.CACHED_TOKENS.total]) >= 3  # rules and the thin ratio line


def test_the_shipped_files_are_what_was_checked() -> None:
    """The committed files are these generators' output (``generate --check`` in CI), so
    checking the generators checks what ships."""
    from pathlib import Path

    from exporter.monitoring.cli import drift
    from exporter.monitoring.render import prometheus_files

    root = Path(__file__).resolve().parent.parent.parent
    assert drift(root, prometheus_files(MonitoringConfig())) == []
