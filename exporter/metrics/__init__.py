"""The exposition contract: collectors that render SignalsState, and nothing else.

Collectors never do I/O and never change state; every scrape yields fresh metric families.
The registry is private (never the global one), so registration does no work. Its
exposition, in the text format or OpenMetrics, is written by ``exporter.metrics.exposition``:
the same bytes as client_python's encoders, many times faster at many callers; /metrics gets
its bodies from ``exporter.metrics.scrape``.
"""

from __future__ import annotations

from exporter.metrics.engine import EngineCollector
from exporter.metrics.exposition import ExporterRegistry, generate_text
from exporter.metrics.self import SelfCollector
from exporter.metrics.usage import UsageCollector
from exporter.signals.state import SignalsState

__all__ = ["build_registry", "generate_text"]


def build_registry(state: SignalsState) -> ExporterRegistry:
    registry = ExporterRegistry()
    registry.register(SelfCollector(state))
    registry.register(EngineCollector(state.engine))
    registry.register(UsageCollector(state.usage))
    return registry
