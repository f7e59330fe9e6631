"""The exposition contract: collectors that render SignalsState, and nothing else.

Collectors never do I/O and never change state; every scrape yields fresh metric families.
The one exception is client_python's standard process and platform collectors
(``process_*`` from /proc, ``python_info``), which every client_python exporter serves and
dashboards expect: ``process_start_time_seconds`` is how a restart of the exporter (and the
reset of its per-caller counters) shows.
The registry is private (never the global one), so registration does no work. Its
exposition, in the text format or OpenMetrics, is written by ``exporter.metrics.exposition``:
the same bytes as client_python's encoders, many times faster at many callers; /metrics gets
its bodies from ``exporter.metrics.scrape``.
"""

from __future__ import annotations

from prometheus_client import PlatformCollector, ProcessCollector

from exporter.metrics.engine import EngineCollector
from exporter.metrics.exposition import ExporterRegistry, generate_text
from exporter.metrics.foresight import ForesightCollector
from exporter.metrics.self import SelfCollector
from exporter.metrics.usage import UsageCollector
from exporter.signals.state import SignalsState

__all__ = ["build_registry", "generate_text"]


def build_registry(state: SignalsState) -> ExporterRegistry:
    registry = ExporterRegistry()
    registry.register(ProcessCollector(registry=None))
    registry.register(PlatformCollector(registry=None))
    registry.register(SelfCollector(state))
    registry.register(EngineCollector(state.engine))
    registry.register(UsageCollector(state.usage))
    registry.register(ForesightCollector(state.engine, state.usage))
    return registry
