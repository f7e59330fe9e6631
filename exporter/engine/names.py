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
    ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total",
     "vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
)
PREFIX_CACHE_HITS = Signal(
    values.PREFIX_CACHE_HITS,
    ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total",
     "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
)
PREEMPTIONS = Signal(
    values.PREEMPTIONS, ("vllm:num_preemptions_total", "vllm:num_preemptions"))
PROMPT_TOKENS = Signal(
    values.PROMPT_TOKENS, ("vllm:prompt_tokens_total", "vllm:prompt_tokens"))
PROMPT_TOKENS_CACHED = Signal(
    values.PROMPT_TOKENS_CACHED,
    ("vllm:prompt_tokens_cached_total", "vllm:prompt_tokens_cached"),
)
KV_USAGE = Signal(values.KV_CACHE_USAGE, ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))
REQUESTS_RUNNING = Signal(values.REQUESTS_RUNNING, ("vllm:num_requests_running",))
REQUESTS_WAITING = Signal(values.REQUESTS_WAITING, ("vllm:num_requests_waiting",))
CACHE_CONFIG = Signal(values.CACHE_CONFIG_INFO, ("vllm:cache_config_info",))

# prompt_tokens_cached is derived from the by-source split where only that exists.
PROMPT_TOKENS_BY_SOURCE = ("vllm:prompt_tokens_by_source_total", "vllm:prompt_tokens_by_source")
CACHED_SOURCES = ("local_cache_hit", "external_kv_transfer")

SIGNALS: tuple[Signal, ...] = (
    PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, PREEMPTIONS, PROMPT_TOKENS, PROMPT_TOKENS_CACHED,
    KV_USAGE, REQUESTS_RUNNING, REQUESTS_WAITING, CACHE_CONFIG,
)
SAMPLE_VALUE_SIGNALS: tuple[Signal, ...] = tuple(s for s in SIGNALS if s is not CACHE_CONFIG)


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
