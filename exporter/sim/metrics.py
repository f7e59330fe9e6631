"""The simulator's /metrics, shaped like vLLM 0.32.0's: same names, types, labels, buckets.

vLLM renders its metrics with prometheus_client (counters with ``_total`` and ``_created``,
histograms, an info-style gauge for the cache configuration), so this does the same on a
private registry: whatever parses a real vLLM scrape parses this one. The values follow
vLLM's accounting (vllm-metrics.md section 1.4): prefix-cache queries and hits are counted when
a request is first admitted (not again after a preemption, and not at all with caching
off), the prompt-token split when its first token is out, the per-request histograms when it
finishes. With ``--kv-cache-metrics`` the three KV-residency histograms exist (at 0 before
the first eviction, as vLLM pre-creates them) and each sampled block's eviction is observed.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from exporter.sim.engine import (
    Admitted,
    Engine,
    EngineConfig,
    EngineEvent,
    Evicted,
    Finished,
    FirstToken,
    Preempted,
)
from exporter.sim.kvcache import RESIDENCY_BUCKETS

ENGINE = "0"
LABELS = ("model_name", "engine")

# vllm/v1/metrics/buckets.py (identical from 0.9.1 to 0.33.0)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

# Every key of vllm:cache_config_info in the 0.32.0 capture, in its order.
CACHE_CONFIG_KEYS = (
    "_block_size_resolved",
    "block_size",
    "cache_dtype",
    "cache_hit_alignment_tokens",
    "effective_attention_block_size",
    "enable_mamba_shared_prefix_checkpoint",
    "enable_prefix_caching",
    "gpu_memory_utilization",
    "hash_block_size",
    "is_attention_free",
    "kv_cache_dtype_skip_layers",
    "kv_cache_layout",
    "kv_cache_max_concurrency",
    "kv_cache_memory_bytes",
    "kv_cache_size_tokens",
    "kv_offloading_backend",
    "kv_offloading_size",
    "kv_sharing_fast_prefill",
    "mamba_block_size",
    "mamba_cache_dtype",
    "mamba_cache_mode",
    "mamba_page_size_padded",
    "mamba_ssm_cache_dtype",
    "num_cpu_blocks",
    "num_gpu_blocks",
    "num_gpu_blocks_override",
    "prefix_cache_retention_interval",
    "prefix_caching_hash_algo",
    "prefix_match_unit",
    "replayssm_buffer_len",
    "skip_page_size_padded",
    "sliding_window",
    "swa_bounded_replay",
    "use_kda_recoverssm",
    "use_replayssm",
    "user_specified_block_size",
)

# Bytes of KV per token we pretend the model has, only to fill kv_cache_memory_bytes.
_KV_BYTES_PER_TOKEN = 1024
# What vLLM 0.32 prints as mamba_block_size on a hybrid server with prefix caching on.
STALE_MAMBA_BLOCK_SIZE = "16"


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series of token-count buckets, capped at max_model_len."""
    out: list[float] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            value = step * scale
            if value > max_model_len:
                return tuple(out)
            out.append(float(value))
        scale *= 10


def cache_config_labels(config: EngineConfig) -> dict[str, str]:
    """What vLLM 0.32.0 prints for its CacheConfig, as str() of each field."""
    hybrid = config.hybrid
    caching = config.prefix_caching
    if hybrid:
        mamba_mode = "align" if caching else "none"
        # With caching off vLLM sizes mamba blocks to the whole context (reference 3); with it
        # on, vLLM 0.32 prints a stale 16 whatever the block (the granule is block_size).
        mamba_block = STALE_MAMBA_BLOCK_SIZE if caching else str(config.context_limit)
    else:
        mamba_mode, mamba_block = "none", "None"
    values = {
        "_block_size_resolved": "True",
        "block_size": str(config.block_size),
        "cache_dtype": config.cache_dtype,
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(config.block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": str(caching),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        # Full-length requests the pool holds: num_gpu_blocks / blocks_per_request, printed
        # as vLLM does (str of a float), so that the pool, the blocks and the concurrency
        # agree as a real vLLM's do.
        "kv_cache_max_concurrency": str(config.kv_pool_tokens / config.context_limit),
        "kv_cache_memory_bytes": str(config.pool_tokens * _KV_BYTES_PER_TOKEN),
        # vLLM prints the pool it sized from memory ("GPU KV cache size: N tokens"), which on
        # a hybrid model is no multiple of the block size; blocks are whole below it.
        "kv_cache_size_tokens": str(config.kv_pool_tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": mamba_block,
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": mamba_mode,
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(config.num_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        # A hybrid's block is vLLM's choice (raised until a page holds a state page).
        "user_specified_block_size": str(not hybrid),
    }
    return {key: values[key] for key in CACHE_CONFIG_KEYS}


class SimMetrics:
    """A private registry fed by engine events; ``render`` gives the exposition text."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.model = config.served_model_name
        labels = list(LABELS)

        def counter(name: str, help_text: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, help_text, labels + list(extra), registry=registry)

        def gauge(name: str, help_text: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, help_text, labels + list(extra), registry=registry)

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, help_text, labels, buckets=buckets, registry=registry)

        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.waiting_by_reason = gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            ("reason",),
        )
        self.sleep_state = gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.",
            ("sleep_state",),
        )
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in "
            "terms of number of queried tokens.",
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in "
            "terms of number of cached tokens.",
        )
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_by_source = counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",)
        )
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.cached_by_source = counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
            "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            ("source",),
        )
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.success = counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ("finished_reason",),
        )
        token_hist = token_buckets(config.context_limit)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_hist
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_hist
        )
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_hist,
        )
        self.params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_hist,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            LATENCY_BUCKETS,
        )
        self.request_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            PREEMPTION_BUCKETS,
        )
        self.kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_hist,
        )
        self.residency = self._residency_histograms(histogram) if config.kv_cache_metrics else ()
        cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*CACHE_CONFIG_KEYS, "engine"],
            registry=registry,
        )
        cache_info.labels(**cache_config_labels(config), engine=ENGINE).set(1)

        # vLLM creates every labelled child up front, so they read 0 before any traffic.
        model = self.model
        for child in (
            self.queries,
            self.hits,
            self.external_queries,
            self.external_hits,
            self.preemptions,
            self.prompt_tokens,
            self.prompt_cached,
            self.generation_tokens,
        ):
            child.labels(model, ENGINE)
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            self.prompt_by_source.labels(model, ENGINE, source)
        for source in ("device", "host", "p2p", "disk", "external_unspecified"):
            self.cached_by_source.labels(model, ENGINE, source)
        for reason in ("stop", "length", "abort", "error", "repetition"):
            self.success.labels(model, ENGINE, reason)
        for histogram_metric in (
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.max_generation_tokens,
            self.params_n,
            self.params_max_tokens,
            self.ttft,
            self.itl,
            self.tpot,
            self.e2e,
            self.queue_time,
            self.inference_time,
            self.prefill_time,
            self.decode_time,
            self.request_preemptions,
            self.kv_computed,
            *self.residency,
        ):
            histogram_metric.labels(model, ENGINE)
        for reason in ("capacity", "deferred"):
            self.waiting_by_reason.labels(model, ENGINE, reason).set(0)
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            self.sleep_state.labels(model, ENGINE, state).set(value)
        self.set_gauges(0, 0, 0.0)

    @staticmethod
    def _residency_histograms(
        histogram: Callable[[str, str, tuple[float, ...]], Histogram],
    ) -> tuple[Histogram, ...]:
        """vLLM's three KV-residency histograms, declared as vLLM 0.32/0.33 declares them."""
        sampled = "Sampled metrics (controlled by --kv-cache-metrics-sample)."
        return (
            histogram(
                "vllm:kv_block_lifetime_seconds",
                "Histogram of KV cache block lifetime from allocation to eviction. " + sampled,
                RESIDENCY_BUCKETS,
            ),
            histogram(
                "vllm:kv_block_idle_before_evict_seconds",
                "Histogram of idle time before KV cache block eviction. " + sampled,
                RESIDENCY_BUCKETS,
            ),
            histogram(
                "vllm:kv_block_reuse_gap_seconds",
                "Histogram of time gaps between consecutive KV cache block accesses. "
                "Only the most recent accesses are recorded (ring buffer). " + sampled,
                RESIDENCY_BUCKETS,
            ),
        )

    def observe(self, event: EngineEvent) -> None:
        """Fold one engine event into the counters and histograms."""
        seq = event.seq
        model = self.model
        if isinstance(event, Admitted):
            if not event.resumed and self.config.prefix_caching:
                self.queries.labels(model, ENGINE).inc(seq.prompt_tokens)
                self.hits.labels(model, ENGINE).inc(event.hit_tokens)
                self.cached_by_source.labels(model, ENGINE, "device").inc(event.hit_tokens)
        elif isinstance(event, FirstToken):
            hit = seq.hit_tokens
            self.prompt_tokens.labels(model, ENGINE).inc(seq.prompt_tokens)
            self.prompt_by_source.labels(model, ENGINE, "local_compute").inc(
                seq.prompt_tokens - hit
            )
            self.prompt_by_source.labels(model, ENGINE, "local_cache_hit").inc(hit)
            self.prompt_cached.labels(model, ENGINE).inc(hit)
            self.ttft.labels(model, ENGINE).observe(event.time - seq.arrival)
        elif isinstance(event, Preempted):
            self.preemptions.labels(model, ENGINE).inc()
        elif isinstance(event, Finished):
            self._finished(event)
        elif isinstance(event, Evicted) and self.residency:
            lifetime, idle, reuse_gap = (item.labels(model, ENGINE) for item in self.residency)
            lifetime.observe(event.residency.lifetime)
            idle.observe(event.residency.idle)
            for gap in event.residency.reuse_gaps:
                reuse_gap.observe(gap)
        # A Rejected request never reached vLLM's engine (its API server answers 400 before
        # scheduling), so vLLM counts it nowhere; neither do we.

    def _finished(self, event: Finished) -> None:
        seq = event.seq
        model = self.model
        generated = seq.generated_tokens
        self.success.labels(model, ENGINE, event.reason).inc()
        self.generation_tokens.labels(model, ENGINE).inc(generated)
        if seq.admitted_at is None:  # aborted while waiting
            return
        self.request_prompt_tokens.labels(model, ENGINE).observe(seq.prompt_tokens)
        self.request_generation_tokens.labels(model, ENGINE).observe(generated)
        self.max_generation_tokens.labels(model, ENGINE).observe(seq.max_tokens)
        self.params_n.labels(model, ENGINE).observe(1)
        self.params_max_tokens.labels(model, ENGINE).observe(seq.max_tokens)
        self.e2e.labels(model, ENGINE).observe(event.time - seq.arrival)
        self.queue_time.labels(model, ENGINE).observe(seq.admitted_at - seq.arrival)
        self.inference_time.labels(model, ENGINE).observe(event.time - seq.admitted_at)
        self.request_preemptions.labels(model, ENGINE).observe(seq.preemptions)
        self.kv_computed.labels(model, ENGINE).observe(seq.computed_on_admission)
        if seq.first_token_at is None:
            return
        self.prefill_time.labels(model, ENGINE).observe(seq.first_token_at - seq.admitted_at)
        decode = event.time - seq.first_token_at
        self.decode_time.labels(model, ENGINE).observe(decode)
        if generated > 1:
            per_token = decode / (generated - 1)
            self.tpot.labels(model, ENGINE).observe(per_token)
            itl = self.itl.labels(model, ENGINE)
            for _ in range(generated - 1):
                itl.observe(per_token)

    def set_gauges(self, running: int, waiting: int, kv_usage: float) -> None:
        model = self.model
        self.running.labels(model, ENGINE).set(running)
        self.waiting.labels(model, ENGINE).set(waiting)
        self.waiting_by_reason.labels(model, ENGINE, "capacity").set(waiting)
        self.kv_usage.labels(model, ENGINE).set(kv_usage)

    def render(self, engine: Engine) -> bytes:
        """The exposition text, with the gauges read from the engine now."""
        self.set_gauges(engine.num_running, engine.num_waiting, engine.kv_usage)
        return generate_latest(self.registry)
