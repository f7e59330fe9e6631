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

from exporter.web.listener import ReloadStatus

RELOADS = "vllm_cache_exporter_web_config_reloads"
LAST_SUCCESS = "vllm_cache_exporter_web_config_last_reload_success_timestamp_seconds"
NOT_AFTER = "vllm_cache_exporter_tls_certificate_not_after_timestamp_seconds"


class WebConfigCollector(Collector):
    """Reload counters of the listeners ``statuses`` returns (called at each scrape)."""

    def __init__(self, statuses: Callable[[], Iterable[ReloadStatus]]) -> None:
        self._statuses = statuses

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield from self._families(())

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield from self._families(tuple(self._statuses()))

    @staticmethod
    def _families(statuses: Iterable[ReloadStatus],
                  ) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        reloads = CounterMetricFamily(
            RELOADS, "Re-reads of the web config file (on a change or SIGHUP) by result; a "
            "failure keeps the previous configuration.", labels=["listener", "result"])
        last = GaugeMetricFamily(
            LAST_SUCCESS, "Unix time the listener's web config was last loaded (at start or "
            "by a reload).", labels=["listener"])
        not_after = GaugeMetricFamily(
            NOT_AFTER, "Unix time the TLS certificate the listener serves expires (the "
            "earliest notAfter of the chain in its certificate file); it is served even "
            "once expired.", labels=["listener"])
        for status in statuses:
            reloads.add_metric([status.listener, "success"], status.successes)
            reloads.add_metric([status.listener, "failure"], status.failures)
            last.add_metric([status.listener], status.last_success_unix)
            if status.certificate_not_after is not None:
                not_after.add_metric([status.listener], status.certificate_not_after)
        yield reloads
        yield last
        yield not_after
