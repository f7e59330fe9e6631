"""vLLM's metric names across versions, and the signals the exporter derives from them.

Sample names are matched, never TYPE lines: prometheus_client strips ``_total`` from counter
family names and reports ``vllm:`` families whose TYPE it cannot pair as ``unknown``. The
first name found wins; order is newest first. See docs/metrics.md for the history.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Signal:
    name: str  # value of the ``signal`` label of vllm_cache_engine_metric_present
    sample_names: tuple[str, ...]  # vLLM sample names, newest first
    counter: bool = False


PREFIX_CACHE_QUERIES = Signal(
    "prefix_cache_queries",
    ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total",
     "vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    counter=True,
)
PREFIX_CACHE_HITS = Signal(
    "prefix_cache_hits",
    ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total",
     "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    counter=True,
)
PREEMPTIONS = Signal(
    "preemptions", ("vllm:num_preemptions_total", "vllm:num_preemptions"), counter=True)
PROMPT_TOKENS = Signal(
    "prompt_tokens", ("vllm:prompt_tokens_total", "vllm:prompt_tokens"), counter=True)
PROMPT_TOKENS_CACHED = Signal(
    "prompt_tokens_cached",
    ("vllm:prompt_tokens_cached_total", "vllm:prompt_tokens_cached"),
    counter=True,
)
KV_USAGE = Signal("kv_cache_usage", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))
REQUESTS_RUNNING = Signal("requests_running", ("vllm:num_requests_running",))
REQUESTS_WAITING = Signal("requests_waiting", ("vllm:num_requests_waiting",))
CACHE_CONFIG = Signal("cache_config_info", ("vllm:cache_config_info",))

# prompt_tokens_cached is derived from the by-source split where only that exists.
PROMPT_TOKENS_BY_SOURCE = ("vllm:prompt_tokens_by_source_total", "vllm:prompt_tokens_by_source")
CACHED_SOURCES = ("local_cache_hit", "external_kv_transfer")

SIGNALS: tuple[Signal, ...] = (
    PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, PREEMPTIONS, PROMPT_TOKENS, PROMPT_TOKENS_CACHED,
    KV_USAGE, REQUESTS_RUNNING, REQUESTS_WAITING, CACHE_CONFIG,
)
SAMPLE_VALUE_SIGNALS: tuple[Signal, ...] = tuple(s for s in SIGNALS if s is not CACHE_CONFIG)

# The labels of vllm:cache_config_info the exporter reads (the full set changes per release).
CACHE_CONFIG_KEYS = (
    "block_size", "num_gpu_blocks", "kv_cache_size_tokens", "enable_prefix_caching",
    "prefix_match_unit", "mamba_block_size", "mamba_cache_mode", "cache_dtype",
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
        names.update(signal.sample_names)
        for sample in signal.sample_names:
            created = created_name(sample)
            if created:
                names.add(created)
    names.update(PROMPT_TOKENS_BY_SOURCE)
    return frozenset(names)
