"""Panel factories shared by the dashboards.

Each factory takes the few things that differ between panels (title, description, unit,
queries) and fixes the rest, so every panel gets the ``${datasource}`` variable, a unit and a
description by construction rather than by review. Options grafanalib 0.7 has no argument for
(the bar gauge's and table's ``reduceOptions``/``fieldConfig``, the legend's ``showLegend``)
are given through ``extraJson``; what grafanalib writes that the current schema does not have
is removed afterwards, in one place: ``grafana.to_current_schema``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grafanalib import core as g

from exporter import families
from exporter.monitoring.config import MonitoringConfig
from exporter.monitoring.dashboards.grafana import SCHEMA_VERSION
from exporter.monitoring.promql import PromQL, hit_ratio, number, warm_share
from exporter.monitoring.rules import Names

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
TOKENS = "suffix: tokens"
TOKENS_PER_SECOND = "suffix: tokens/s"
ALL = ".*"

_REF_IDS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


JOB = 'job=~"$job"'
TARGET = 'target=~"$target"'
MODEL_NAME = 'model_name=~"$model"'
MODEL = 'model=~"$model"'
CALLER = 'caller=~"$caller"'
WARM = 'state="warm"'


# The dashboards' own variables: a topology label of the same name gets no variable.
VARIABLES = ("datasource", "job", "target", "model", "caller")


def topology_labels(config: MonitoringConfig) -> tuple[str, ...]:
    """The topology labels (cluster, namespace) that are dashboard variables, in order."""
    return tuple(label for label in config.topology_labels if label not in VARIABLES)


class Filters:
    """Label matchers for dashboard queries: the configured selector plus the variables,
    the topology ones (cluster, namespace) first in every query, so one cluster's panels
    never show another's series. "All" is ``.*``, which also matches a series without the
    label: a Prometheus without topology labels loses nothing."""

    def __init__(self, config: MonitoringConfig) -> None:
        self.promql = PromQL(config)
        self.topology = tuple(f'{label}=~"${label}"' for label in topology_labels(config))

    def selector(self, *extra: str) -> str:
        """The configured selector alone (plus ``extra``): for the variables' own queries."""
        return self.promql.sel(*extra)

    def engine(self, *extra: str) -> str:
        return self.promql.sel(*self.topology, JOB, TARGET, MODEL_NAME, *extra)

    def target(self, *extra: str) -> str:
        return self.promql.sel(*self.topology, JOB, TARGET, *extra)

    def caller(self, *extra: str) -> str:
        return self.promql.sel(*self.topology, JOB, MODEL, CALLER, *extra)

    def model(self, *extra: str) -> str:
        return self.promql.sel(*self.topology, JOB, MODEL, *extra)

    def job(self, *extra: str) -> str:
        return self.promql.sel(*self.topology, JOB, *extra)

    def topology_only(self, *extra: str) -> str:
        """The selector and the topology variables: what the job variable is chosen from."""
        return self.promql.sel(*self.topology, *extra)


def topology_variables(config: MonitoringConfig) -> list[g.Template]:
    """One variable per topology label, each chosen among the values the ones before it
    leave (a namespace of the selected cluster), from the exporters' build info."""
    filters = Filters(config)
    variables = []
    for index, label in enumerate(topology_labels(config)):
        before = filters.topology[:index]
        variables.append(
            query_variable(
                label,
                label.replace("_", " ").capitalize(),
                f"label_values({families.EXPORTER_BUILD_INFO.series}"
                f"{filters.selector(*before)}, {label})",
            )
        )
    return variables


def job_variable(config: MonitoringConfig) -> g.Template:
    return query_variable(
        "job",
        "Job",
        f"label_values({families.EXPORTER_BUILD_INFO.series}"
        f"{Filters(config).topology_only()}, job)",
    )


def target(expr: str, legend: str = "", instant: bool = False) -> g.Target:
    return g.Target(
        expr=expr,
        legendFormat=legend,
        instant=instant,
        datasource=DATASOURCE,
        format="table" if instant else "time_series",
        intervalFactor=1,
    )


def _with_ref_ids(targets: list[g.Target]) -> list[g.Target]:
    for index, item in enumerate(targets):
        item.refId = _REF_IDS[index]
    return targets


def datasource_variable() -> g.Template:
    return g.Template(
        name="datasource",
        label="Data source",
        type="datasource",
        query="prometheus",
        default=None,
        refresh=1,
    )


def query_variable(
    name: str, label: str, query: str, regex: str | None = None, multi: bool = True
) -> g.Template:
    variable = g.Template(
        name=name,
        label=label,
        query=query,
        dataSource=DATASOURCE,
        includeAll=True,
        allValue=ALL,
        multi=multi,
        refresh=g.REFRESH_ON_TIME_RANGE_CHANGE,
        regex=regex,
        sort=1,
    )
    # Start on "All"; Grafana wants lists for a multi-value variable's current value.
    variable._current = {
        "selected": True,
        "text": ["All"] if multi else "All",
        "value": ["$__all"] if multi else "$__all",
    }
    return variable


def value_mapping(*pairs: tuple[str, str, str]) -> list[dict[str, Any]]:
    """(value, text, color) -> one Grafana 'value' mapping."""
    return [
        {
            "type": "value",
            "options": {
                value: {"text": text, "color": color, "index": index}
                for index, (value, text, color) in enumerate(pairs)
            },
        }
    ]


@dataclass
class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping as needed."""

    x: int = 0
    y: int = 0
    row_height: int = 0
    panels: list[Any] = field(default_factory=list)

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(g.RowPanel(title=title, gridPos=g.GridPos(h=1, w=24, x=0, y=self.y)))
        self.y += 1

    def add(self, panel: Any, width: int, height: int) -> None:
        if self.x + width > 24:
            self._newline()
        panel.gridPos = g.GridPos(h=height, w=width, x=self.x, y=self.y)
        self.panels.append(panel)
        self.x += width
        self.row_height = max(self.row_height, height)

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_height
        self.x, self.row_height = 0, 0

    def numbered(self) -> list[Any]:
        for index, panel in enumerate(self.panels, start=1):
            panel.id = index
        return self.panels


def timeseries(
    title: str,
    description: str,
    unit: str,
    targets: list[g.Target],
    stacked: bool = False,
    bars: bool = False,
    min_value: int | None = None,
    max_value: int | None = None,
) -> g.TimeSeries:
    return g.TimeSeries(
        title=title,
        description=description,
        unit=unit,
        dataSource=DATASOURCE,
        targets=_with_ref_ids(targets),
        legendDisplayMode="table",
        legendPlacement="right",
        legendCalcs=["lastNotNull", "max"],
        tooltipMode="multi",
        tooltipSort="desc",
        drawStyle="bars" if bars else "line",
        fillOpacity=60 if bars else 10,
        stacking={"mode": "normal" if stacked else "none", "group": "A"},
        valueMin=min_value,
        valueMax=max_value,
        spanNulls=False,
        extraJson={"options": {"legend": {"showLegend": True}}},
    )


def stat(
    title: str,
    description: str,
    unit: str,
    targets: list[g.Target],
    mappings: list[dict[str, Any]] | None = None,
    decimals: int | None = None,
    thresholds: list[tuple[str, float | None]] | None = None,
) -> g.Stat:
    steps = [{"color": color, "value": value} for color, value in (thresholds or [("green", None)])]
    return g.Stat(
        title=title,
        description=description,
        format=unit,
        dataSource=DATASOURCE,
        targets=_with_ref_ids(targets),
        reduceCalc="lastNotNull",
        graphMode="none",
        colorMode="background" if mappings or thresholds else "value",
        mappings=mappings or [],
        decimals=decimals,
        noValue="no data",
        extraJson={
            "fieldConfig": {"defaults": {"thresholds": {"mode": "absolute", "steps": steps}}}
        },
    )


def alert_below(config: MonitoringConfig, baseline: str, legend: str) -> g.Target:
    """The line a collapse alert's ratio must stay under: ``collapse_drop_factor`` x the
    recorded ``baseline`` selection, drawn beside the ratio it bounds."""
    return target(f"{number(config.collapse_drop_factor)} * {baseline}", f"{legend} alert below")


def bands(fair: float, good: float) -> list[tuple[str, float | None]]:
    """Red below ``fair``, orange from it, green from ``good`` (the config's colour bands)."""
    return [("red", None), ("orange", fair), ("green", good)]


def hit_ratio_thresholds(config: MonitoringConfig) -> list[tuple[str, float | None]]:
    return bands(config.hit_ratio_fair, config.hit_ratio_good)


def warm_share_thresholds(config: MonitoringConfig) -> list[tuple[str, float | None]]:
    return bands(config.warm_share_fair, config.warm_share_good)


def caller_hit_ratio_stat(config: MonitoringConfig, title: str, description: str) -> g.Stat:
    """The selected callers' hit ratio now, from the usage each response reports, over the
    recorded per-caller rates: one definition for every dashboard that shows it."""
    names = Names(config)
    callers = Filters(config).caller()
    return stat(
        title,
        description + " (only responses that report cached tokens count).",
        "percentunit",
        [
            target(
                hit_ratio(
                    f"sum({names.caller_cached[names.short]}{callers})",
                    f"sum({names.caller_prompt[names.short]}{callers})",
                )
            )
        ],
        thresholds=hit_ratio_thresholds(config),
    )


def warm_share_stat(config: MonitoringConfig, title: str, description: str) -> g.Stat:
    """The selected callers' share of warm turns now, over the recorded per-state rates."""
    filters = Filters(config)
    requests = Names(config).caller_state_requests
    classified, warm = filters.caller(PromQL.states_matcher()), filters.caller(WARM)
    return stat(
        title,
        description,
        "percentunit",
        [target(warm_share(f"sum({requests}{warm})", f"sum({requests}{classified})"))],
        thresholds=warm_share_thresholds(config),
    )


def table(
    title: str,
    description: str,
    unit: str,
    targets: list[g.Target],
    renames: dict[str, str],
    overrides: list[dict[str, Any]] | None = None,
    mappings: list[dict[str, Any]] | None = None,
) -> g.Table:
    """Instant queries merged into one row per label set, value columns renamed."""
    return g.Table(
        title=title,
        description=description,
        unit=unit,
        dataSource=DATASOURCE,
        targets=_with_ref_ids(targets),
        overrides=overrides or [],
        filterable=True,
        transformations=[
            {"id": "merge", "options": {}},
            {
                "id": "organize",
                "options": {"excludeByName": {"Time": True}, "renameByName": renames},
            },
        ],
        extraJson={
            "fieldConfig": {
                "defaults": {
                    "mappings": mappings or [],
                    "thresholds": {
                        "mode": "absolute",
                        "steps": [{"color": "green", "value": None}],
                    },
                }
            }
        },
    )


def bargauge(
    title: str,
    description: str,
    unit: str,
    targets: list[g.Target],
    max_value: float = 1.0,
    thresholds: list[tuple[str, float | None]] | None = None,
) -> g.BarGauge:
    steps = [{"color": color, "value": value} for color, value in (thresholds or [("green", None)])]
    return g.BarGauge(
        title=title,
        description=description,
        format=unit,
        dataSource=DATASOURCE,
        targets=_with_ref_ids(targets),
        displayMode="gradient",
        orientation="horizontal",
        min=0,
        max=max_value,
        extraJson={
            "fieldConfig": {
                "defaults": {
                    "unit": unit,
                    "min": 0,
                    "max": max_value,
                    "thresholds": {"mode": "absolute", "steps": steps},
                },
                "overrides": [],
            },
            "options": {
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "showUnfilled": True,
            },
        },
    )


def dashboard(
    config: MonitoringConfig,
    title: str,
    uid: str,
    description: str,
    variables: list[g.Template],
    layout: Layout,
) -> g.Dashboard:
    """A dashboard of the set: shared tags, datasource variable, and a link to the others
    of the set that carries the variables and the time range along."""
    links = [
        g.DashboardLink(
            type="dashboards",
            tags=["vllm-cache-exporter"],
            includeVars=True,
            keepTime=True,
            title="vllm-cache-exporter",
        )
    ]
    return g.Dashboard(
        title=title,
        uid=uid,
        description=description,
        tags=["vllm", "vllm-cache-exporter"],
        templating=g.Templating(list=[datasource_variable(), *variables]),
        panels=layout.numbered(),
        timezone="browser",
        refresh="30s",
        schemaVersion=SCHEMA_VERSION,
        graphTooltip=1,
        links=links,
        time=g.Time("now-3h", "now"),
    )
