"""exporter/families.py is the one table of the exporter's series: what the collectors serve,
what docs/metrics.md lists (row for row, both ways), and what every Series field a
per-caller counter reads is."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from exporter import families
from exporter.config import Config
from exporter.limits import (
    FileDescriptors,
    FollowedFilesCollector,
    LimitsCollector,
    ListenerStats,
    RateLimitedLogs,
    SendStats,
    SendStatsCollector,
    plan_descriptors,
)
from exporter.metrics import build_registry
from exporter.signals.usage import Series
from exporter.usage.event import validate
from exporter.usage.tail import FileFollower
from exporter.web.metrics import WebConfigCollector
from exporter.wiring import signals_state

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
ROW = re.compile(r"^\| `([a-z_:0-9]+)` \| (counter|gauge|histogram)(?: \(=1\))? \|([^|]*)\|", re.M)


@dataclass(frozen=True)
class DocRow:
    name: str  # as the doc writes it: counters with _total
    type: str
    labels: tuple[str, ...]


def doc_rows(text: str) -> list[DocRow]:
    """Every series row of docs/metrics.md (name, type, labels; the recorded series' table
    has no type column and is not one of them)."""
    return [
        DocRow(name, kind, tuple(re.findall(r"`([a-z_]+)`", labels)))
        for name, kind, labels in ROW.findall(text)
    ]


def documented(family: families.Family) -> str:
    return family.total if family.type == families.COUNTER else family.name


def mismatches(table: tuple[families.Family, ...], rows: list[DocRow]) -> list[str]:
    """Every disagreement between the table and the doc's rows, both ways."""
    by_doc_name = {documented(family): family for family in table}
    problems = []
    for row in rows:
        if row.name in families.CLIENT_PYTHON:
            continue
        family = by_doc_name.get(row.name)
        if family is None:
            problems.append(f"docs row {row.name} is no family of exporter/families.py")
            continue
        if (row.type, row.labels) != (family.type, family.labels):
            problems.append(
                f"docs row {row.name}: {row.type} {row.labels}, the table says "
                f"{family.type} {family.labels}"
            )
    rows_named = {row.name for row in rows}
    problems.extend(
        f"family {family.name} has no row in docs/metrics.md"
        for family in table
        if documented(family) not in rows_named
    )
    return problems


def test_every_family_has_its_docs_row_and_every_row_its_family() -> None:
    rows = doc_rows(DOC.read_text("utf-8"))
    assert len(rows) > len(families.FAMILIES) // 2
    assert mismatches(families.FAMILIES, rows) == []


def test_a_missing_row_or_a_missing_family_is_caught() -> None:
    """The check fails both ways: a family without its row, a row without its family."""
    rows = doc_rows(DOC.read_text("utf-8"))
    new = families.Family(
        "vllm_cache_new_tokens", families.COUNTER, families.CALLER, "New.", field="new_tokens"
    )
    assert mismatches((*families.FAMILIES, new), rows) == [
        "family vllm_cache_new_tokens has no row in docs/metrics.md"
    ]
    extra = DocRow("vllm_cache_new_tokens_total", "counter", ("caller", "model"))
    assert mismatches(families.FAMILIES, [*rows, extra]) == [
        "docs row vllm_cache_new_tokens_total is no family of exporter/families.py"
    ]
    relabelled = DocRow("vllm_cache_cached_tokens_total", "counter", ("caller",))
    assert len(mismatches(families.FAMILIES, [*rows, relabelled])) == 1


def every_collector() -> list[object]:
    """Every collector the exporter registers (app and runtime), all its families present."""
    state = signals_state(Config())
    registry = build_registry(state)
    return [
        *registry.collectors(),
        LimitsCollector(
            [ListenerStats("web", 1)],
            RateLimitedLogs(),
            plan_descriptors(1024, {"web": (1, 1)}),
            FileDescriptors(1),
        ),
        SendStatsCollector(SendStats()),
        WebConfigCollector(lambda: []),
        FollowedFilesCollector(
            FileFollower([], validate, lambda events: None, lambda reason: None)
        ),
    ]


def test_the_collectors_serve_exactly_the_table() -> None:
    served = {}
    for collector in every_collector():
        for metric in collector.collect():  # type: ignore[attr-defined]
            served[metric.name] = metric
    ours = {name: metric for name, metric in served.items() if name.startswith("vllm_cache_")}
    assert sorted(ours) == sorted(families.BY_NAME)
    for name, metric in ours.items():
        family = families.BY_NAME[name]
        assert (metric.type, tuple(metric._labelnames), metric.unit) == (
            family.type,
            family.labels,
            family.unit,
        ), name
        if "{" not in family.help:  # a template is filled in by its collector
            assert metric.documentation == family.help, name
    others = {name for name in served if not name.startswith("vllm_cache_")}
    assert others <= {re.sub(r"_total$", "", name) for name in families.CLIENT_PYTHON}


def test_every_per_caller_counter_reads_a_field_the_signals_record() -> None:
    """A per-caller counter in the table is rendered from its Series field: the recording
    step in exporter/signals/usage.py must add that field (a missing one fails here)."""
    series = Series()
    assert families.PER_CALLER_COUNTERS
    for family in families.PER_CALLER_COUNTERS:
        assert family.type == families.COUNTER and family.labels == families.CALLER
        assert isinstance(getattr(series, family.field, None), int), family.name
