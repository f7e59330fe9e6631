"""Per-caller signals (issue #3 contract). Later work may add series here, never rename these.

Counters only: ratios (hit ratio, warm share) are PromQL over a window. Every (caller, model)
pair gets all ``state`` values of ``vllm_cache_requests_total`` from its first event on, so
``rate(...{state="cold"})`` reads 0 rather than "no data"; histograms exist per state only
once that state has a timed event, which keeps a 1,000-caller scrape small.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from exporter.signals.classify import STATES
from exporter.signals.usage import QUEUE_BUCKETS, TTFT_BUCKETS, Histogram, UsageState

_TTFT_LE = [floatToGoString(b) for b in TTFT_BUCKETS] + ["+Inf"]
_QUEUE_LE = [floatToGoString(b) for b in QUEUE_BUCKETS] + ["+Inf"]


def _histogram(samples: list[Sample], name: str, labels: dict[str, str], hist: Histogram,
               les: list[str]) -> None:
    """Append one histogram's _bucket, _count and _sum samples (cumulative buckets)."""
    bucket = name + "_bucket"
    running = 0
    for le, count in zip(les, hist.counts, strict=True):
        running += count
        samples.append(Sample(bucket, {**labels, "le": le}, running))
    samples.append(Sample(name + "_count", labels, running))
    samples.append(Sample(name + "_sum", labels, hist.total))


class UsageCollector:
    def __init__(self, usage: UsageState) -> None:
        self.usage = usage

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        usage = self.usage
        requests = CounterMetricFamily(
            "vllm_cache_requests",
            "Requests reported by the proxy, by cache outcome: warm (as full a hit as the "
            "prompt allows), partial, cold (nothing reused where something could be), short "
            "(too short to hold one cache granule; never a failure), unknown (cached tokens "
            "not reported), error (non-2xx; counted nowhere else).",
            labels=["caller", "model", "state"])
        prompt = CounterMetricFamily(
            "vllm_cache_prompt_tokens",
            "Prompt tokens of successful requests that reported cached tokens "
            "(the denominator of the per-caller hit ratio).",
            labels=["caller", "model"])
        cached = CounterMetricFamily(
            "vllm_cache_cached_tokens",
            "Prompt tokens served from vLLM's prefix cache, per the responses' "
            "usage.prompt_tokens_details.cached_tokens.",
            labels=["caller", "model"])
        unreported = CounterMetricFamily(
            "vllm_cache_unreported_prompt_tokens",
            "Prompt tokens of successful requests whose cached tokens were not reported "
            "(vLLM without --enable-prompt-tokens-details); not in the hit ratio.",
            labels=["caller", "model"])
        ttft = HistogramMetricFamily(
            "vllm_cache_ttft_seconds",
            "Engine-side time to first token (the proxy's TTFT minus its admission queue wait "
            "when known), by cache outcome.",
            labels=["caller", "model", "state"])
        queue = HistogramMetricFamily(
            "vllm_cache_queue_wait_seconds",
            "Admission wait at the proxy before the request reached vLLM.",
            labels=["caller", "model"])

        # Samples are appended directly rather than through add_metric(): at 1,000 callers
        # that is ~80,000 samples per scrape, and add_metric's per-call copies were a quarter
        # of the render time (bench/bench_render.py).
        requests_samples, prompt_samples = requests.samples, prompt.samples
        cached_samples, unreported_samples = cached.samples, unreported.samples
        for (caller, model), series in sorted(usage.series.items()):
            pair = {"caller": caller, "model": model}
            counts = series.requests
            for state in STATES:
                requests_samples.append(Sample(
                    "vllm_cache_requests_total",
                    {"caller": caller, "model": model, "state": state}, counts[state]))
            prompt_samples.append(Sample("vllm_cache_prompt_tokens_total", pair,
                                         series.prompt_tokens))
            cached_samples.append(Sample("vllm_cache_cached_tokens_total", pair,
                                         series.cached_tokens))
            unreported_samples.append(Sample("vllm_cache_unreported_prompt_tokens_total", pair,
                                             series.unreported_prompt_tokens))
            for state in STATES:
                hist = series.ttft.get(state)
                if hist is not None:
                    _histogram(ttft.samples, "vllm_cache_ttft_seconds",
                               {"caller": caller, "model": model, "state": state}, hist,
                               _TTFT_LE)
            if series.queue is not None:
                _histogram(queue.samples, "vllm_cache_queue_wait_seconds", pair, series.queue,
                           _QUEUE_LE)

        granularity = GaugeMetricFamily(
            "vllm_cache_granularity_tokens",
            "Cache granularity in tokens used to classify this model's requests, and where it "
            "came from: configured (--signals.granularity), learned (gcd of reported cached "
            "counts), block_size (vLLM's prefix_match_unit or block_size).",
            labels=["model", "source"])
        for model, value, source in usage.granularities():
            granularity.add_metric([model, source], float(value))

        events = CounterMetricFamily(
            "vllm_cache_usage_events",
            "Usage events accepted (and counted in vllm_cache_requests_total), by reader.",
            labels=["reader"])
        for reader, count in sorted(usage.events.items()):
            events.add_metric([reader], count)
        rejected = CounterMetricFamily(
            "vllm_cache_usage_events_rejected",
            "Usage events a reader could not use, by reader and reason (see docs/metrics.md).",
            labels=["reader", "reason"])
        for (reader, reason), count in sorted(usage.rejected.items()):
            rejected.add_metric([reader, reason], count)
        last = GaugeMetricFamily(
            "vllm_cache_usage_last_event_timestamp_seconds",
            "Unix time the exporter last accepted an event from this reader.",
            labels=["reader"])
        for reader, when in sorted(usage.last_event_time.items()):
            last.add_metric([reader], when)
        refused = CounterMetricFamily(
            "vllm_cache_usage_ingest_requests_rejected",
            "POST /v1/usage requests refused as a whole (unauthorized, body_too_large, "
            "bad_body, bad_format); their events are not counted anywhere else.",
            labels=["reason"])
        for reason, count in sorted(usage.ingest_requests_rejected.items()):
            refused.add_metric([reason], count)
        overflowed = CounterMetricFamily(
            "vllm_cache_callers_overflowed",
            "Events counted under caller=\"__other__\" because the caller cap "
            "(--callers.max) was reached.")
        overflowed.add_metric([], usage.callers_overflowed)

        yield requests
        yield prompt
        yield cached
        yield unreported
        yield ttft
        yield queue
        yield granularity
        yield events
        yield rejected
        yield last
        yield refused
        yield overflowed
