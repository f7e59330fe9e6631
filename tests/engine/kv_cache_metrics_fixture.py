"""The vLLM 0.33 exposition with KV-residency metrics on, derived from the 0.33 sample.

``tests/fixtures/vllm-0.33.0-sample.prom`` declares every family vLLM 0.33.0 registers by
default, but vLLM registers its three KV-residency histograms only when started with
``--kv-cache-metrics``. This builds them as vLLM 0.33.0 declares them
(``vllm/v1/metrics/loggers.py``: name, help text, labels ``model_name, engine``, the
``kv_cache_residency`` buckets of ``vllm/v1/metrics/buckets.py``) with the real
prometheus_client, feeds them sampled evictions, and inserts them where vLLM's registry puts
them: after ``vllm:request_prefill_kv_computed_tokens``. ``_created`` times are the sample's.

The evictions tell the collapse seen from the inside: conversations come back about every
45 s, but blocks are evicted after 2 to 30 s of idleness, before their conversation returns.

``python -m tests.engine.kv_cache_metrics_fixture`` rewrites the fixture;
``test_kv_cache_metrics_fixture_is_the_builders_output`` fails if the two ever differ.
"""

from __future__ import annotations

import random
import re
from itertools import pairwise

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tests.helpers import FIXTURES, fixture_text

SAMPLE = "vllm-0.33.0-sample.prom"
FIXTURE = "vllm-0.33.0-kv-cache-metrics.prom"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CREATED = "1.7644608e+09"
INSERT_BEFORE = "# HELP vllm:cache_config_info "

# vllm/v1/metrics/buckets.py KV_CACHE_RESIDENCY_BUCKETS (0.32.0 and 0.33.0)
KV_CACHE_RESIDENCY_BUCKETS = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1,
    2,
    5,
    10,
    20,
    30,
    60,
    120,
    300,
    600,
    1200,
    1800,
)
FAMILIES = (
    (
        "vllm:kv_block_lifetime_seconds",
        "Histogram of KV cache block lifetime from allocation to eviction. "
        "Sampled metrics (controlled by --kv-cache-metrics-sample).",
    ),
    (
        "vllm:kv_block_idle_before_evict_seconds",
        "Histogram of idle time before KV cache block eviction. "
        "Sampled metrics (controlled by --kv-cache-metrics-sample).",
    ),
    (
        "vllm:kv_block_reuse_gap_seconds",
        "Histogram of time gaps between consecutive KV cache block accesses. Only the most "
        "recent accesses are recorded (ring buffer). Sampled metrics (controlled by "
        "--kv-cache-metrics-sample).",
    ),
)
EVICTIONS = 150


def residency_families() -> str:
    registry = CollectorRegistry()
    lifetime, idle, gap = (
        Histogram(
            name,
            documentation,
            ["model_name", "engine"],
            buckets=KV_CACHE_RESIDENCY_BUCKETS,
            registry=registry,
        ).labels(MODEL, "0")
        for name, documentation in FAMILIES
    )
    rng = random.Random(330)
    for _ in range(EVICTIONS):
        # vLLM's KVCacheMetricsCollector: reuse gaps between the last 4 accesses, idle time
        # since the last access (or allocation), lifetime since allocation.
        first_use = rng.uniform(0.05, 3.0)
        accesses = [first_use]
        for _ in range(rng.randint(0, 5)):
            accesses.append(accesses[-1] + rng.gauss(45.0, 8.0))
        recent = accesses[-4:]
        for earlier, later in pairwise(recent):
            gap.observe(later - earlier)
        idle_seconds = rng.uniform(2.0, 30.0)
        idle.observe(idle_seconds)
        lifetime.observe(accesses[-1] + idle_seconds)
    text = generate_latest(registry).decode()
    return re.sub(r"^(vllm:\S+_created\{[^}]*\}) \S+$", rf"\1 {CREATED}", text, flags=re.M)


def build() -> str:
    sample = fixture_text(SAMPLE)
    at = sample.index(INSERT_BEFORE)
    return sample[:at] + residency_families() + sample[at:]


if __name__ == "__main__":
    (FIXTURES / FIXTURE).write_text(build(), encoding="utf-8")
