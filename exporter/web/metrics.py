"""The web config reloads and the TLS certificate's expiry as Prometheus series, for the
exporter's registry.

Collected at scrape time from each listener's ``status()``: no I/O, nothing carried
between scrapes. A failed reload keeps serving the previous configuration, so
``..._reloads_total{result="failure"}`` going up (and the success timestamp standing
still) is the only sign that a certificate rotation did not take.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

import exporter.families as families
from exporter.web.listener import ReloadStatus

NOT_AFTER = families.EXPORTER_TLS_CERTIFICATE_NOT_AFTER_TIMESTAMP_SECONDS.name


class WebConfigCollector(Collector):
    """Reload counters of the listeners ``statuses`` returns (called at each scrape)."""

    def __init__(self, statuses: Callable[[], Iterable[ReloadStatus]]) -> None:
        self._statuses = statuses

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield from self._families(())

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield from self._families(tuple(self._statuses()))

    @staticmethod
    def _families(
        statuses: Iterable[ReloadStatus],
    ) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        reloads = families.counter(families.EXPORTER_WEB_CONFIG_RELOADS)
        last = families.gauge(families.EXPORTER_WEB_CONFIG_LAST_RELOAD_SUCCESS_TIMESTAMP_SECONDS)
        not_after = families.gauge(families.EXPORTER_TLS_CERTIFICATE_NOT_AFTER_TIMESTAMP_SECONDS)
        for status in statuses:
            reloads.add_metric([status.listener, "success"], status.successes)
            reloads.add_metric([status.listener, "failure"], status.failures)
            last.add_metric([status.listener], status.last_success_unix)
            if status.certificate_not_after is not None:
                not_after.add_metric([status.listener], status.certificate_not_after)
        yield reloads
        yield last
        yield not_after
