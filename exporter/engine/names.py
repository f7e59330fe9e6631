"""vLLM's metric names across versions, and the signals the exporter derives from them.

Sample names are matched, never TYPE lines: prometheus_client strips ``_total`` from counter
family names and reports ``vllm:`` families whose TYPE it cannot pair as ``unknown``. The
first name found wins; order is newest first. See docs/metrics.md for the history.
"""

from __future__ import annotations

from dataclasses import dataclass

from exporter import values


@dataclass(frozen=True)
class Signal:
    name: str  # one of exporter.values.ENGINE_SIGNALS
    sample_names: tuple[str, ...]  # vLLM sample names, newest first


PREFIX_CACHE_QUERIES = Signal(
    values.PREFIX_CACHE_QUERIES,
    (
        "vllm:prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_queries_total",
        "vllm:prefix_cache_queries",
        "vllm:gpu_prefix_cache_queries",
    ),
)
PREFIX_CACHE_HITS = Signal(
    values.PREFIX_CACHE_HITS,
    (
        "vllm:prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_hits_total",
        "vllm:prefix_cache_hits",
        "vllm:gpu_prefix_cache_hits",
    ),
)
PREEMPTIONS = Signal(values.PREEMPTIONS, ("vllm:num_preemptions_total", "vllm:num_preemptions"))
PROMPT_TOKENS = Signal(values.PROMPT_TOKENS, ("vllm:prompt_tokens_total", "vllm:prompt_tokens"))
PROMPT_TOKENS_CACHED = Signal(
    values.PROMPT_TOKENS_CACHED,
    ("vllm:prompt_tokens_cached_total", "vllm:prompt_tokens_cached"),
)
KV_USAGE = Signal(values.KV_CACHE_USAGE, ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))
REQUESTS_RUNNING = Signal(values.REQUESTS_RUNNING, ("vllm:num_requests_running",))
REQUESTS_WAITING = Signal(values.REQUESTS_WAITING, ("vllm:num_requests_waiting",))
CACHE_CONFIG = Signal(values.CACHE_CONFIG_INFO, ("vllm:cache_config_info",))

# Where prompt tokens came from. A KV connector's counters exist from 0.11.1, the prompt-token
# split by source from 0.16, the cached-token split by tier from 0.32, the waiting requests
# by reason from 0.20.
EXTERNAL_PREFIX_CACHE_QUERIES = Signal(
    values.EXTERNAL_PREFIX_CACHE_QUERIES,
    ("vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_queries"),
)
EXTERNAL_PREFIX_CACHE_HITS = Signal(
    values.EXTERNAL_PREFIX_CACHE_HITS,
    ("vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_hits"),
)
PROMPT_TOKENS_BY_SOURCE = Signal(
    values.PROMPT_TOKENS_BY_SOURCE,
    ("vllm:prompt_tokens_by_source_total", "vllm:prompt_tokens_by_source"),
)
PROMPT_TOKENS_CACHED_BY_SOURCE = Signal(
    values.PROMPT_TOKENS_CACHED_BY_SOURCE,
    ("vllm:prompt_tokens_cached_by_source_total", "vllm:prompt_tokens_cached_by_source"),
)
REQUESTS_WAITING_BY_REASON = Signal(
    values.REQUESTS_WAITING_BY_REASON, ("vllm:num_requests_waiting_by_reason",)
)

# Histograms, by family name (samples are <name>_bucket, _sum, _count, _created). The
# residency ones exist only when vLLM runs with --kv-cache-metrics (0.12+); inter-token
# latency was vllm:time_per_output_token_seconds before 0.10.2 (removed in 0.15).
KV_BLOCK_LIFETIME = Signal(values.KV_BLOCK_LIFETIME, ("vllm:kv_block_lifetime_seconds",))
KV_BLOCK_IDLE_BEFORE_EVICT = Signal(
    values.KV_BLOCK_IDLE_BEFORE_EVICT, ("vllm:kv_block_idle_before_evict_seconds",)
)
KV_BLOCK_REUSE_GAP = Signal(values.KV_BLOCK_REUSE_GAP, ("vllm:kv_block_reuse_gap_seconds",))
REQUEST_QUEUE_TIME = Signal(values.REQUEST_QUEUE_TIME, ("vllm:request_queue_time_seconds",))
REQUEST_PREFILL_TIME = Signal(values.REQUEST_PREFILL_TIME, ("vllm:request_prefill_time_seconds",))
REQUEST_DECODE_TIME = Signal(values.REQUEST_DECODE_TIME, ("vllm:request_decode_time_seconds",))
INTER_TOKEN_LATENCY = Signal(
    values.INTER_TOKEN_LATENCY,
    ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
)
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count", "_created")

# prompt_tokens_cached is derived from the by-source split where only that exists.
CACHED_SOURCES = ("local_cache_hit", "external_kv_transfer")

SIGNALS: tuple[Signal, ...] = (
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    PREEMPTIONS,
    PROMPT_TOKENS,
    PROMPT_TOKENS_CACHED,
    KV_USAGE,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
    CACHE_CONFIG,
    EXTERNAL_PREFIX_CACHE_QUERIES,
    EXTERNAL_PREFIX_CACHE_HITS,
    PROMPT_TOKENS_BY_SOURCE,
    PROMPT_TOKENS_CACHED_BY_SOURCE,
    REQUESTS_WAITING_BY_REASON,
    KV_BLOCK_LIFETIME,
    KV_BLOCK_IDLE_BEFORE_EVICT,
    KV_BLOCK_REUSE_GAP,
    REQUEST_QUEUE_TIME,
    REQUEST_PREFILL_TIME,
    REQUEST_DECODE_TIME,
    INTER_TOKEN_LATENCY,
)
HISTOGRAM_SIGNALS: tuple[Signal, ...] = tuple(
    s for s in SIGNALS if s.name in values.HISTOGRAM_SIGNALS
)
SPLIT_SIGNALS: tuple[Signal, ...] = tuple(s for s in SIGNALS if s.name in values.SPLITS)
SAMPLE_VALUE_SIGNALS: tuple[Signal, ...] = tuple(
    s
    for s in SIGNALS
    if s is not CACHE_CONFIG and s not in HISTOGRAM_SIGNALS and s not in SPLIT_SIGNALS
)


# Counters vLLM registers carry a ``_created`` twin; a changed timestamp marks a restart even
# when the counter has already grown past its old value.
def created_name(sample_name: str) -> str | None:
    if sample_name.endswith("_total"):
        return sample_name[: -len("_total")] + "_created"
    return None


def wanted_sample_names() -> frozenset[str]:
    names: set[str] = set()
    for signal in SIGNALS:
        if signal in HISTOGRAM_SIGNALS:
            names.update(
                family + suffix for family in signal.sample_names for suffix in HISTOGRAM_SUFFIXES
            )
            continue
        names.update(signal.sample_names)
        for sample in signal.sample_names:
            created = created_name(sample)
            if created:
                names.add(created)
    return frozenset(names)
