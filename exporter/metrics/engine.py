"""Engine series: what the exporter read from each vLLM, in its own names.

Grouped by family: per target (was it read, which signals it has), per engine row (cache
configuration, KV use, counters), where prompt tokens came from (split by source, waiting by
reason), and the histograms (KV residency, request phases). A signal vLLM does not expose has
no series here, never a 0; ``vllm_cache_engine_metric_present`` says which.

Later work may add series here, never rename these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from exporter import families, values
from exporter.signals.engine import EngineRow, EngineState, TargetState

ROW_LABELS = list(families.ROW)

# (family, engine signal)
COUNTERS = (
    (families.ENGINE_PREFIX_CACHE_QUERIES_TOKENS, values.PREFIX_CACHE_QUERIES),
    (families.ENGINE_PREFIX_CACHE_HITS_TOKENS, values.PREFIX_CACHE_HITS),
    (families.ENGINE_PREEMPTIONS, values.PREEMPTIONS),
    (families.ENGINE_PROMPT_TOKENS, values.PROMPT_TOKENS),
    (families.ENGINE_PROMPT_TOKENS_CACHED, values.PROMPT_TOKENS_CACHED),
    (families.ENGINE_EXTERNAL_PREFIX_CACHE_QUERIES_TOKENS, values.EXTERNAL_PREFIX_CACHE_QUERIES),
    (families.ENGINE_EXTERNAL_PREFIX_CACHE_HITS_TOKENS, values.EXTERNAL_PREFIX_CACHE_HITS),
)

# (family, split engine signal): counters with one more label (values.SPLITS[signal].label),
# whose values are capped to the ones vLLM enumerates plus "other".
SPLIT_COUNTERS = (
    (families.ENGINE_PROMPT_TOKENS_BY_SOURCE, values.PROMPT_TOKENS_BY_SOURCE),
    (families.ENGINE_PROMPT_TOKENS_CACHED_BY_SOURCE, values.PROMPT_TOKENS_CACHED_BY_SOURCE),
)

# (family, histogram engine signal): vLLM's own buckets, carried across restarts.
HISTOGRAMS = (
    (families.ENGINE_KV_BLOCK_LIFETIME_SECONDS, values.KV_BLOCK_LIFETIME),
    (families.ENGINE_KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS, values.KV_BLOCK_IDLE_BEFORE_EVICT),
    (families.ENGINE_KV_BLOCK_REUSE_GAP_SECONDS, values.KV_BLOCK_REUSE_GAP),
    (families.ENGINE_REQUEST_QUEUE_TIME_SECONDS, values.REQUEST_QUEUE_TIME),
    (families.ENGINE_REQUEST_PREFILL_TIME_SECONDS, values.REQUEST_PREFILL_TIME),
    (families.ENGINE_REQUEST_DECODE_TIME_SECONDS, values.REQUEST_DECODE_TIME),
    (families.ENGINE_INTER_TOKEN_LATENCY_SECONDS, values.INTER_TOKEN_LATENCY),
)


class _TargetFamilies:
    """The per-target families: whether and how each vLLM was read."""

    def __init__(self) -> None:
        self.up = families.gauge(families.ENGINE_UP)
        self.duration = families.gauge(families.ENGINE_SCRAPE_DURATION_SECONDS)
        self.errors = families.counter(families.ENGINE_SCRAPE_ERRORS)
        self.restarts = families.counter(families.ENGINE_RESTARTS)
        self.invalid = families.counter(families.ENGINE_INVALID_SAMPLES)
        self.folded = families.counter(families.ENGINE_SAMPLES_FOLDED)
        self.present = families.gauge(families.ENGINE_METRIC_PRESENT)

    def add(self, target: str, state: TargetState) -> None:
        self.up.add_metric([target], 1.0 if state.up else 0.0)
        if state.attempted:
            self.duration.add_metric([target], state.last_duration_seconds)
        for reason, count in sorted(state.errors.items()):
            self.errors.add_metric([target, reason], float(count))
        self.restarts.add_metric([target], float(state.restarts))
        for reason, count in sorted(state.invalid.items()):
            self.invalid.add_metric([target, reason], float(count))
        for reason, count in sorted(state.folded.items()):
            self.folded.add_metric([target, reason], float(count))
        if state.up:
            for signal in values.ENGINE_SIGNALS:
                self.present.add_metric([target, signal], 1.0 if state.present.get(signal) else 0.0)

    def families(self) -> Iterator[Metric]:
        yield from (
            self.up,
            self.duration,
            self.errors,
            self.restarts,
            self.invalid,
            self.folded,
            self.present,
        )


class _RowFamilies:
    """The per-(target, model_name, engine) families: cache configuration, KV use, counters."""

    def __init__(self) -> None:
        self.enabled = families.gauge(families.ENGINE_PREFIX_CACHING_ENABLED)
        self.info = families.gauge(families.ENGINE_CACHE_CONFIG_INFO)
        self.block = families.gauge(families.ENGINE_BLOCK_SIZE_TOKENS)
        self.pool = families.gauge(families.ENGINE_KV_POOL_TOKENS)
        self.usage = families.gauge(families.ENGINE_KV_USAGE_RATIO)
        self.used = families.gauge(families.ENGINE_KV_USED_TOKENS)
        self.running = families.gauge(families.ENGINE_REQUESTS_RUNNING)
        self.waiting = families.gauge(families.ENGINE_REQUESTS_WAITING)
        self.counters = {signal: families.counter(family) for family, signal in COUNTERS}

    def add(self, target: str, row: EngineRow) -> None:
        labels = [target, row.model_name, row.engine]
        config = row.cache_config
        pool_tokens = config.pool_tokens if config is not None else None
        if config is not None:
            self.info.add_metric(
                labels + [config.fields.get(key, "") for key in values.CACHE_CONFIG_KEYS], 1.0
            )
            if config.enable_prefix_caching is not None:
                self.enabled.add_metric(labels, 1.0 if config.enable_prefix_caching else 0.0)
            if config.block_size:
                self.block.add_metric(labels, float(config.block_size))
            if pool_tokens:
                self.pool.add_metric(labels, float(pool_tokens))
        ratio = row.gauges.get(values.KV_CACHE_USAGE)
        if ratio is not None:
            self.usage.add_metric(labels, ratio)
            if pool_tokens:
                self.used.add_metric(labels, round(ratio * pool_tokens))
        for signal, gauge_family in (
            (values.REQUESTS_RUNNING, self.running),
            (values.REQUESTS_WAITING, self.waiting),
        ):
            gauge = row.gauges.get(signal)
            if gauge is not None:
                gauge_family.add_metric(labels, gauge)
        for signal, counter_family in self.counters.items():
            total = row.counters.get(signal)
            if total is not None:
                counter_family.add_metric(labels, total)

    def families(self) -> Iterator[Metric]:
        yield from (
            self.enabled,
            self.info,
            self.block,
            self.pool,
            self.usage,
            self.used,
            self.running,
            self.waiting,
        )
        yield from self.counters.values()


class _SourceFamilies:
    """The split families: where prompt tokens came from, and why requests wait."""

    def __init__(self) -> None:
        self.counters = {signal: families.counter(family) for family, signal in SPLIT_COUNTERS}
        self.waiting = families.gauge(families.ENGINE_REQUESTS_WAITING_BY_REASON)

    def add(self, target: str, row: EngineRow) -> None:
        labels = [target, row.model_name, row.engine]
        split: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            **self.counters,
            values.REQUESTS_WAITING_BY_REASON: self.waiting,
        }
        for signal, family in split.items():
            for label_value, number in sorted(
                row.splits.get(signal, {}).items(), key=_known_first(signal)
            ):
                family.add_metric(labels + [label_value], number)

    def families(self) -> Iterator[Metric]:
        yield from self.counters.values()
        yield self.waiting


def _known_first(signal: str) -> Callable[[tuple[str, float]], int]:
    """Label values in vLLM's own order, "other" last."""
    known = values.SPLITS[signal].known
    return lambda item: known.index(item[0]) if item[0] in known else len(known)


class _HistogramFamilies:
    """The histogram families: KV residency and the engine-side request phases."""

    def __init__(self) -> None:
        self.histograms = {signal: families.histogram(family) for family, signal in HISTOGRAMS}

    def add(self, target: str, row: EngineRow) -> None:
        labels = [target, row.model_name, row.engine]
        for signal, family in self.histograms.items():
            histogram = row.histograms.get(signal)
            if histogram is not None:
                pairs = zip(histogram.bounds, histogram.cumulative, strict=True)
                buckets = [(floatToGoString(bound), count) for bound, count in pairs]
                family.add_metric(labels, buckets, histogram.sum)

    def families(self) -> Iterator[Metric]:
        yield from self.histograms.values()


class EngineCollector:
    def __init__(self, engine: EngineState) -> None:
        self.engine = engine

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        targets = _TargetFamilies()
        row_groups = (_RowFamilies(), _SourceFamilies(), _HistogramFamilies())
        for state in sorted(self.engine.targets.values(), key=lambda state: state.shown):
            targets.add(state.shown, state)
            if state.up:
                for row in state.rows:
                    for group in row_groups:
                        group.add(state.shown, row)
        yield from targets.families()
        for group in row_groups:
            yield from group.families()
