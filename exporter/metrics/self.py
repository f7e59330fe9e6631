"""Series about the exporter itself."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from exporter import __version__
from exporter.signals.state import SignalsState


class SelfCollector:
    def __init__(self, state: SignalsState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "vllm_cache_exporter_build_info",
            "A metric with a constant '1' value labelled by the exporter's version.",
            labels=["version"])
        info.add_metric([__version__], 1.0)
        yield info

    def describe(self) -> Iterator[Metric]:
        return iter(())
