"""The exposition contract: collectors that render SignalsState, and nothing else.

Collectors never do I/O and never change state; every scrape yields fresh metric families.
The registry is private (never the global one), so registration does no work.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from exporter.metrics.engine import EngineCollector
from exporter.metrics.self import SelfCollector
from exporter.metrics.usage import UsageCollector
from exporter.signals.state import SignalsState


def build_registry(state: SignalsState) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SelfCollector(state))
    registry.register(EngineCollector(state.engine))
    registry.register(UsageCollector(state.usage))
    return registry
