"""The exposition contract: collectors that render SignalsState, and nothing else.

Collectors never do I/O and never change state; every scrape yields fresh metric families.
The registry is private (never the global one), so registration does no work. Its text
exposition is ``exporter.metrics.exposition.generate_text``: the same bytes as client_python's
``generate_latest``, several times faster at many callers.
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
