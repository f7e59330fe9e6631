"""Engine series: what the exporter read from each vLLM, in its own names.

Grouped by family: per target (was it read, which signals it has), per engine row (cache
configuration, KV use, counters), where prompt tokens came from (split by source, waiting by
reason), and the histograms (KV residency, request phases). A signal vLLM does not expose has
no series here, never a 0; ``vllm_cache_engine_metric_present`` says which.

Later work may add series here, never rename these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from exporter import values
from exporter.signals.engine import EngineRow, EngineState, TargetState

ROW_LABELS = ["target", "model_name", "engine"]

# (exported name without _total, HELP, engine signal)
COUNTERS = (
    ("vllm_cache_engine_prefix_cache_queries_tokens",
     "Prompt tokens vLLM looked up in its local prefix cache (vllm:prefix_cache_queries_total, "
     "vllm:gpu_prefix_cache_queries_total before 0.9.2), carried across vLLM restarts.",
     values.PREFIX_CACHE_QUERIES),
    ("vllm_cache_engine_prefix_cache_hits_tokens",
     "Prompt tokens vLLM found in its local prefix cache (vllm:prefix_cache_hits_total, "
     "vllm:gpu_prefix_cache_hits_total before 0.9.2), carried across vLLM restarts.",
     values.PREFIX_CACHE_HITS),
    ("vllm_cache_engine_preemptions",
     "Preemption events in vLLM (vllm:num_preemptions_total), carried across vLLM restarts.",
     values.PREEMPTIONS),
    ("vllm_cache_engine_prompt_tokens",
     "Prompt tokens whose prefill completed, cached ones included (vllm:prompt_tokens_total).",
     values.PROMPT_TOKENS),
    ("vllm_cache_engine_prompt_tokens_cached",
     "Prompt tokens served from a cache, local or external (vllm:prompt_tokens_cached_total, "
     "else the cache sources of vllm:prompt_tokens_by_source_total; vLLM >= 0.16).",
     values.PROMPT_TOKENS_CACHED),
    ("vllm_cache_engine_external_prefix_cache_queries_tokens",
     "Prompt tokens vLLM looked up in a KV connector's cache (LMCache, offloading, P/D) "
     "after the local prefix cache (vllm:external_prefix_cache_queries_total; vLLM >= "
     "0.11.1), carried across vLLM restarts.",
     values.EXTERNAL_PREFIX_CACHE_QUERIES),
    ("vllm_cache_engine_external_prefix_cache_hits_tokens",
     "Prompt tokens a KV connector supplied from its cache "
     "(vllm:external_prefix_cache_hits_total; vLLM >= 0.11.1), carried across vLLM restarts.",
     values.EXTERNAL_PREFIX_CACHE_HITS),
)

# (exported name without _total, HELP, split engine signal): counters with one more label,
# whose values are capped to the ones vLLM enumerates plus "other".
SPLIT_COUNTERS = (
    ("vllm_cache_engine_prompt_tokens_by_source",
     "Prompt tokens whose prefill completed, by where their KV came from: source is "
     "local_compute, local_cache_hit, external_kv_transfer or other "
     "(vllm:prompt_tokens_by_source_total; vLLM >= 0.16), carried across vLLM restarts.",
     values.PROMPT_TOKENS_BY_SOURCE),
    ("vllm_cache_engine_prompt_tokens_cached_by_source",
     "Cached prompt tokens by the cache tier that held them, counted at admission: source "
     "is device, host, p2p, disk, external_unspecified or other "
     "(vllm:prompt_tokens_cached_by_source_total; vLLM >= 0.32), carried across vLLM "
     "restarts.",
     values.PROMPT_TOKENS_CACHED_BY_SOURCE),
)

# (exported name, HELP, histogram engine signal): vLLM's own buckets, carried across restarts.
HISTOGRAMS = (
    ("vllm_cache_engine_kv_block_lifetime_seconds",
     "Sampled KV blocks' time from allocation to eviction (vllm:kv_block_lifetime_seconds; "
     "vLLM started with --kv-cache-metrics), carried across vLLM restarts.",
     values.KV_BLOCK_LIFETIME),
    ("vllm_cache_engine_kv_block_idle_before_evict_seconds",
     "Sampled KV blocks' time since their last use when evicted "
     "(vllm:kv_block_idle_before_evict_seconds; vLLM started with --kv-cache-metrics), "
     "carried across vLLM restarts.",
     values.KV_BLOCK_IDLE_BEFORE_EVICT),
    ("vllm_cache_engine_kv_block_reuse_gap_seconds",
     "Gaps between consecutive prefix-cache hits on a sampled KV block, observed when it is "
     "evicted, its last 3 gaps at most (vllm:kv_block_reuse_gap_seconds; vLLM started with "
     "--kv-cache-metrics), carried across vLLM restarts.",
     values.KV_BLOCK_REUSE_GAP),
    ("vllm_cache_engine_request_queue_time_seconds",
     "Finished requests' time waiting in vLLM's queue before first scheduled "
     "(vllm:request_queue_time_seconds), carried across vLLM restarts.",
     values.REQUEST_QUEUE_TIME),
    ("vllm_cache_engine_request_prefill_time_seconds",
     "Finished requests' time from first scheduled to first token, preemptions included "
     "(vllm:request_prefill_time_seconds), carried across vLLM restarts.",
     values.REQUEST_PREFILL_TIME),
    ("vllm_cache_engine_request_decode_time_seconds",
     "Finished requests' time from first to last token (vllm:request_decode_time_seconds), "
     "carried across vLLM restarts.",
     values.REQUEST_DECODE_TIME),
    ("vllm_cache_engine_inter_token_latency_seconds",
     "Time between successive output tokens (vllm:inter_token_latency_seconds, "
     "vllm:time_per_output_token_seconds before 0.10.2), carried across vLLM restarts.",
     values.INTER_TOKEN_LATENCY),
)


class _TargetFamilies:
    """The per-target families: whether and how each vLLM was read."""

    def __init__(self) -> None:
        self.up = GaugeMetricFamily(
            "vllm_cache_engine_up",
            "1 if the last read of this vLLM's /metrics succeeded, else 0.", labels=["target"])
        self.duration = GaugeMetricFamily(
            "vllm_cache_engine_scrape_duration_seconds",
            "Seconds the last read of this vLLM's /metrics took, failed or not.",
            labels=["target"])
        self.errors = CounterMetricFamily(
            "vllm_cache_engine_scrape_errors",
            "Failed reads of a vLLM /metrics, by reason (connect, timeout, http_status, "
            "truncated, body_too_large, parse, http_error, internal).",
            labels=["target", "reason"])
        self.restarts = CounterMetricFamily(
            "vllm_cache_engine_restarts",
            "vLLM restarts the exporter saw (a newer _created time, or, without one, counters "
            "of two families falling, or of the only one that moved).",
            labels=["target"])
        self.invalid = CounterMetricFamily(
            "vllm_cache_engine_invalid_samples",
            "vLLM samples dropped, by reason: an impossible value (not_finite, negative, "
            "above_one, too_large: above 2^53, bad_histogram), or a reading not believed "
            "(implausible_increase, fell_without_restart, created_went_back).",
            labels=["target", "reason"])
        self.folded = CounterMetricFamily(
            "vllm_cache_engine_samples_folded",
            "vLLM samples counted under model_name or engine \"__other__\", by reason: "
            "too_long (a label value over 128 characters; a cache_config_info value that long "
            "is shown as __other__), model_name_cap (past 4 values), "
            "engine_cap (past 32), row_cap (past 32 (model_name, engine) rows).",
            labels=["target", "reason"])
        self.present = GaugeMetricFamily(
            "vllm_cache_engine_metric_present",
            "1 if this vLLM exposes the metric behind a signal under any known name, 0 if not "
            "(then that signal's series is absent, never a made-up 0).",
            labels=["target", "signal"])

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
                self.present.add_metric([target, signal],
                                        1.0 if state.present.get(signal) else 0.0)

    def families(self) -> Iterator[Metric]:
        yield from (self.up, self.duration, self.errors, self.restarts, self.invalid,
                    self.folded, self.present)


class _RowFamilies:
    """The per-(target, model_name, engine) families: cache configuration, KV use, counters."""

    def __init__(self) -> None:
        self.enabled = GaugeMetricFamily(
            "vllm_cache_engine_prefix_caching_enabled",
            "1 if vLLM runs with prefix caching on (vllm:cache_config_info "
            "enable_prefix_caching), else 0.", labels=ROW_LABELS)
        self.info = GaugeMetricFamily(
            "vllm_cache_engine_cache_config_info",
            "vLLM's cache configuration (allow-listed labels of vllm:cache_config_info; "
            "'None' where vLLM reports none, absent keys empty). Always 1.",
            labels=ROW_LABELS + list(values.CACHE_CONFIG_KEYS))
        self.block = GaugeMetricFamily(
            "vllm_cache_engine_block_size_tokens",
            "vLLM's KV-cache block size in tokens (vllm:cache_config_info block_size).",
            labels=ROW_LABELS)
        self.pool = GaugeMetricFamily(
            "vllm_cache_engine_kv_pool_tokens",
            "Tokens the KV-cache pool holds (kv_cache_size_tokens, else num_gpu_blocks x "
            "block_size, from vllm:cache_config_info).", labels=ROW_LABELS)
        self.usage = GaugeMetricFamily(
            "vllm_cache_engine_kv_usage_ratio",
            "Fraction of the KV-cache pool in use, 0 to 1 (vllm:kv_cache_usage_perc, "
            "vllm:gpu_cache_usage_perc before 0.9.2).", labels=ROW_LABELS)
        self.used = GaugeMetricFamily(
            "vllm_cache_engine_kv_used_tokens",
            "Tokens of the KV-cache pool in use: kv_usage_ratio x kv_pool_tokens.",
            labels=ROW_LABELS)
        self.running = GaugeMetricFamily(
            "vllm_cache_engine_requests_running",
            "Requests in vLLM's running batch (vllm:num_requests_running).", labels=ROW_LABELS)
        self.waiting = GaugeMetricFamily(
            "vllm_cache_engine_requests_waiting",
            "Requests waiting in vLLM (vllm:num_requests_waiting).", labels=ROW_LABELS)
        self.counters = {signal: CounterMetricFamily(name, help_text, labels=ROW_LABELS)
                         for name, help_text, signal in COUNTERS}

    def add(self, target: str, row: EngineRow) -> None:
        labels = [target, row.model_name, row.engine]
        config = row.cache_config
        pool_tokens = config.pool_tokens if config is not None else None
        if config is not None:
            self.info.add_metric(
                labels + [config.fields.get(key, "") for key in values.CACHE_CONFIG_KEYS], 1.0)
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
        for signal, gauge_family in ((values.REQUESTS_RUNNING, self.running),
                                     (values.REQUESTS_WAITING, self.waiting)):
            gauge = row.gauges.get(signal)
            if gauge is not None:
                gauge_family.add_metric(labels, gauge)
        for signal, counter_family in self.counters.items():
            total = row.counters.get(signal)
            if total is not None:
                counter_family.add_metric(labels, total)

    def families(self) -> Iterator[Metric]:
        yield from (self.enabled, self.info, self.block, self.pool, self.usage, self.used,
                    self.running, self.waiting)
        yield from self.counters.values()


class _SourceFamilies:
    """The split families: where prompt tokens came from, and why requests wait."""

    def __init__(self) -> None:
        self.counters = {
            signal: CounterMetricFamily(name, help_text,
                                        labels=ROW_LABELS + [values.SPLITS[signal].label])
            for name, help_text, signal in SPLIT_COUNTERS}
        self.waiting = GaugeMetricFamily(
            "vllm_cache_engine_requests_waiting_by_reason",
            "Requests waiting in vLLM by reason: capacity (for KV or batch room), deferred "
            "(LoRA budget, KV transfer, blocked), other (vllm:num_requests_waiting_by_reason; "
            "vLLM >= 0.20).", labels=ROW_LABELS + ["reason"])

    def add(self, target: str, row: EngineRow) -> None:
        labels = [target, row.model_name, row.engine]
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            **self.counters, values.REQUESTS_WAITING_BY_REASON: self.waiting}
        for signal, family in families.items():
            for label_value, number in sorted(row.splits.get(signal, {}).items(),
                                              key=_known_first(signal)):
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
        self.histograms = {signal: HistogramMetricFamily(name, help_text, labels=ROW_LABELS)
                           for name, help_text, signal in HISTOGRAMS}

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
