"""Engine signals (issue #2 contract). Later work may add series here, never rename these."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporter.engine import names
from exporter.signals.engine import EngineState

ROW_LABELS = ["target", "model_name", "engine"]

# (exported name without _total, HELP, signal)
COUNTERS = (
    ("vllm_cache_engine_prefix_cache_queries_tokens",
     "Prompt tokens vLLM looked up in its local prefix cache (vllm:prefix_cache_queries_total, "
     "vllm:gpu_prefix_cache_queries_total before 0.9.2), carried across vLLM restarts.",
     names.PREFIX_CACHE_QUERIES.name),
    ("vllm_cache_engine_prefix_cache_hits_tokens",
     "Prompt tokens vLLM found in its local prefix cache (vllm:prefix_cache_hits_total, "
     "vllm:gpu_prefix_cache_hits_total before 0.9.2), carried across vLLM restarts.",
     names.PREFIX_CACHE_HITS.name),
    ("vllm_cache_engine_preemptions",
     "Preemption events in vLLM (vllm:num_preemptions_total), carried across vLLM restarts.",
     names.PREEMPTIONS.name),
    ("vllm_cache_engine_prompt_tokens",
     "Prompt tokens whose prefill completed, cached ones included (vllm:prompt_tokens_total).",
     names.PROMPT_TOKENS.name),
    ("vllm_cache_engine_prompt_tokens_cached",
     "Prompt tokens served from a cache, local or external (vllm:prompt_tokens_cached_total, "
     "else the cache sources of vllm:prompt_tokens_by_source_total; vLLM >= 0.16).",
     names.PROMPT_TOKENS_CACHED.name),
)


class EngineCollector:
    def __init__(self, engine: EngineState) -> None:
        self.engine = engine

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("vllm_cache_engine_up",
                               "1 if the last read of this vLLM's /metrics succeeded, else 0.",
                               labels=["target"])
        duration = GaugeMetricFamily(
            "vllm_cache_engine_scrape_duration_seconds",
            "Seconds the last read of this vLLM's /metrics took, failed or not.",
            labels=["target"])
        errors = CounterMetricFamily(
            "vllm_cache_engine_scrape_errors",
            "Failed reads of a vLLM /metrics, by reason (connect, timeout, http_status, "
            "truncated, body_too_large, parse, http_error, internal).",
            labels=["target", "reason"])
        restarts = CounterMetricFamily(
            "vllm_cache_engine_restarts",
            "vLLM restarts the exporter saw (a counter fell or its _created time changed).",
            labels=["target"])
        invalid = CounterMetricFamily(
            "vllm_cache_engine_invalid_samples",
            "vLLM samples dropped for an impossible value (NaN, negative, usage above 1).",
            labels=["target"])
        present = GaugeMetricFamily(
            "vllm_cache_engine_metric_present",
            "1 if this vLLM exposes the metric behind a signal under any known name, 0 if not "
            "(then that signal's series is absent, never a made-up 0).",
            labels=["target", "signal"])
        enabled = GaugeMetricFamily(
            "vllm_cache_engine_prefix_caching_enabled",
            "1 if vLLM runs with prefix caching on (vllm:cache_config_info "
            "enable_prefix_caching), else 0.", labels=ROW_LABELS)
        info = GaugeMetricFamily(
            "vllm_cache_engine_cache_config_info",
            "vLLM's cache configuration (allow-listed labels of vllm:cache_config_info; "
            "'None' where vLLM reports none, absent keys empty). Always 1.",
            labels=ROW_LABELS + list(names.CACHE_CONFIG_KEYS))
        block = GaugeMetricFamily(
            "vllm_cache_engine_block_size_tokens",
            "vLLM's KV-cache block size in tokens (vllm:cache_config_info block_size).",
            labels=ROW_LABELS)
        pool = GaugeMetricFamily(
            "vllm_cache_engine_kv_pool_tokens",
            "Tokens the KV-cache pool holds (kv_cache_size_tokens, else num_gpu_blocks x "
            "block_size, from vllm:cache_config_info).", labels=ROW_LABELS)
        usage = GaugeMetricFamily(
            "vllm_cache_engine_kv_usage_ratio",
            "Fraction of the KV-cache pool in use, 0 to 1 (vllm:kv_cache_usage_perc, "
            "vllm:gpu_cache_usage_perc before 0.9.2).", labels=ROW_LABELS)
        used = GaugeMetricFamily(
            "vllm_cache_engine_kv_used_tokens",
            "Tokens of the KV-cache pool in use: kv_usage_ratio x kv_pool_tokens.",
            labels=ROW_LABELS)
        running = GaugeMetricFamily("vllm_cache_engine_requests_running",
                                    "Requests in vLLM's running batch (vllm:num_requests_running).",
                                    labels=ROW_LABELS)
        waiting = GaugeMetricFamily("vllm_cache_engine_requests_waiting",
                                    "Requests waiting in vLLM (vllm:num_requests_waiting).",
                                    labels=ROW_LABELS)
        counters = {signal: CounterMetricFamily(name, help_text, labels=ROW_LABELS)
                    for name, help_text, signal in COUNTERS}

        for target, state in sorted(self.engine.targets.items()):
            up.add_metric([target], 1.0 if state.up else 0.0)
            if state.attempted:
                duration.add_metric([target], state.last_duration_seconds)
            for reason, count in sorted(state.errors.items()):
                errors.add_metric([target, reason], float(count))
            restarts.add_metric([target], float(state.restarts))
            invalid.add_metric([target], float(state.invalid_samples))
            if not state.up:
                continue
            for signal in names.SIGNALS:
                present.add_metric([target, signal.name],
                                   1.0 if state.present.get(signal.name) else 0.0)
            for row in state.rows:
                labels = [target, row.model_name, row.engine]
                config = row.cache_config
                pool_tokens = config.pool_tokens if config else None
                if config is not None:
                    info.add_metric(labels + [config.fields.get(key, "")
                                              for key in names.CACHE_CONFIG_KEYS], 1.0)
                    if config.enable_prefix_caching is not None:
                        enabled.add_metric(labels, 1.0 if config.enable_prefix_caching else 0.0)
                    if config.block_size:
                        block.add_metric(labels, float(config.block_size))
                    if pool_tokens:
                        pool.add_metric(labels, float(pool_tokens))
                ratio = row.gauges.get(names.KV_USAGE.name)
                if ratio is not None:
                    usage.add_metric(labels, ratio)
                    if pool_tokens:
                        used.add_metric(labels, round(ratio * pool_tokens))
                if names.REQUESTS_RUNNING.name in row.gauges:
                    running.add_metric(labels, row.gauges[names.REQUESTS_RUNNING.name])
                if names.REQUESTS_WAITING.name in row.gauges:
                    waiting.add_metric(labels, row.gauges[names.REQUESTS_WAITING.name])
                for signal, family in counters.items():
                    if signal in row.counters:
                        family.add_metric(labels, row.counters[signal])
        yield up
        yield duration
        yield errors
        yield restarts
        yield invalid
        yield present
        yield enabled
        yield info
        yield block
        yield pool
        yield usage
        yield used
        yield running
        yield waiting
        yield from counters.values()
