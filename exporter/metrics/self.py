"""Series about the exporter itself."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from exporter import __version__, families
from exporter.signals.state import SignalsState


class SelfCollector:
    def __init__(self, state: SignalsState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        info = families.gauge(families.EXPORTER_BUILD_INFO)
        info.add_metric([__version__], 1.0)
        yield info

    def describe(self) -> Iterator[Metric]:
        return iter(())
