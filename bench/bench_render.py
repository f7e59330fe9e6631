"""/metrics render time with 100 and 1,000 callers, against client_python's own metrics.

    python bench/bench_render.py [--callers 100 1000] [--repeats 15]

For each caller count, the exporter's state is filled with a realistic mix (every caller
has warm, partial and cold requests with TTFT, and a queue wait), then the registry is
rendered with client_python's text encoder, as the /metrics handler does. The baseline holds
the very same series as plain ``prometheus_client`` Counter/Histogram objects (what a naive
exporter would keep) and renders them with the same encoder. Reported: the median render
time of each, their ratio, and the size of the exposition. One CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exporter.config import Config  # noqa: E402
from exporter.metrics import build_registry  # noqa: E402
from exporter.signals.classify import STATES  # noqa: E402
from exporter.signals.state import SignalsState  # noqa: E402
from exporter.signals.usage import QUEUE_BUCKETS, TTFT_BUCKETS  # noqa: E402
from exporter.usage.event import UsageEvent  # noqa: E402

MODEL = "qwen3.8-27b"
# (prompt, cached, ttft): one warm, one partial and one cold turn per caller at G = 2048.
TURNS = ((91_070, 86_016, 6.1), (60_000, 30_720, 25.0), (40_000, 0, 74.0))


def exporter_registry(callers: int) -> CollectorRegistry:
    state = SignalsState(Config(signals_granularity=2048, callers_max=callers))
    assert state.usage is not None
    for index in range(callers):
        for prompt, cached, ttft in TURNS:
            state.usage.record(UsageEvent(f"agent-{index}", MODEL, prompt, cached,
                                          ttft_seconds=ttft, queue_seconds=0.5), "http")
    return build_registry(state)


def baseline_registry(callers: int) -> CollectorRegistry:
    """The same series as client_python metric objects (without their _created samples,
    which the exporter does not serve either)."""
    disable_created_metrics()
    registry = CollectorRegistry(auto_describe=False)
    requests = Counter("vllm_cache_requests", "h", ["caller", "model", "state"],
                       registry=registry)
    prompt = Counter("vllm_cache_prompt_tokens", "h", ["caller", "model"], registry=registry)
    cached = Counter("vllm_cache_cached_tokens", "h", ["caller", "model"], registry=registry)
    unreported = Counter("vllm_cache_unreported_prompt_tokens", "h", ["caller", "model"],
                         registry=registry)
    ttft = Histogram("vllm_cache_ttft_seconds", "h", ["caller", "model", "state"],
                     buckets=TTFT_BUCKETS, registry=registry)
    queue = Histogram("vllm_cache_queue_wait_seconds", "h", ["caller", "model"],
                      buckets=QUEUE_BUCKETS, registry=registry)
    for index in range(callers):
        caller = f"agent-{index}"
        for state in STATES:
            requests.labels(caller, MODEL, state)
        for (prompt_tokens, cached_tokens, seconds), state in zip(
                TURNS, ("warm", "partial", "cold"), strict=True):
            requests.labels(caller, MODEL, state).inc()
            prompt.labels(caller, MODEL).inc(prompt_tokens)
            cached.labels(caller, MODEL).inc(cached_tokens)
            unreported.labels(caller, MODEL)
            ttft.labels(caller, MODEL, state).observe(seconds - 0.5)
            queue.labels(caller, MODEL).observe(0.5)
    return registry


def median_render(registry: CollectorRegistry, repeats: int) -> tuple[float, int, int]:
    generate_latest(registry)  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        body = generate_latest(registry)
        times.append(time.perf_counter() - start)
    samples = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return statistics.median(times), len(body), samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    print(f"{'callers':>8} {'samples':>8} {'bytes':>10} {'exporter ms':>12} "
          f"{'client_python ms':>17} {'ratio':>6}")
    for callers in args.callers:
        ours, size, samples = median_render(exporter_registry(callers), args.repeats)
        base, _, base_samples = median_render(baseline_registry(callers), args.repeats)
        print(f"{callers:>8} {samples:>8,} {size:>10,} {ours * 1000:>12.1f} "
              f"{base * 1000:>17.1f} {ours / base:>6.2f}")
        if samples - base_samples != 5:  # the exporter's own series, not in the baseline
            print(f"  (sample counts differ: {samples} vs {base_samples})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
