"""/metrics render time with 100 and 1,000 callers: our text encoder vs client_python's.

    python bench/bench_render.py [--callers 100 1000] [--repeats 21]

For each caller count, the exporter's state is filled with a realistic mix (every caller
has warm, partial and cold requests with TTFT, and a queue wait), then the same registry is
rendered, alternately in each round, by:

- ``generate_text``: the exporter's own 0.0.4 text encoder, what /metrics serves
  (``exporter/metrics/exposition.py``), with its per-series label text cached from the
  previous scrape (the steady state);
- the same on a freshly built registry (nothing cached: the first scrape after start);
- ``generate_latest``: client_python's text encoder over the same registry (what /metrics
  served before, and the reference the bytes are checked against in every round);
- the original baseline: the very same series held as plain ``prometheus_client``
  Counter/Histogram objects (what a naive exporter would keep), rendered by
  ``generate_latest``.

Reported: medians, the speed-up of ``generate_text`` over ``generate_latest`` on the same
registry, and the size of the exposition. One CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
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
from exporter.metrics import build_registry, generate_text  # noqa: E402
from exporter.signals.classify import STATES  # noqa: E402
from exporter.signals.state import SignalsState  # noqa: E402
from exporter.signals.usage import QUEUE_BUCKETS, TTFT_BUCKETS  # noqa: E402
from exporter.values import UsageEvent  # noqa: E402
from exporter.wiring import signals_state

MODEL = "qwen3.8-27b"
# (prompt, cached, ttft): one warm, one partial and one cold turn per caller at G = 2048.
TURNS = ((91_070, 86_016, 6.1), (60_000, 30_720, 25.0), (40_000, 0, 74.0))


def exporter_state(callers: int) -> SignalsState:
    state = signals_state(Config(signals_granularity=2048, callers_max=callers),
                         clock=lambda: 1_800_000_000.0)
    assert state.usage is not None
    for index in range(callers):
        for prompt, cached, ttft in TURNS:
            state.usage.record(UsageEvent(f"agent-{index}", MODEL, prompt, cached,
                                          ttft_seconds=ttft, queue_seconds=0.5), "http")
    return state


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


def timed(encoder: Callable[[CollectorRegistry], bytes],
          registry: CollectorRegistry) -> tuple[float, bytes]:
    start = time.perf_counter()
    body = encoder(registry)
    return time.perf_counter() - start, body


def measure(callers: int, repeats: int) -> dict[str, float | int]:
    """Median seconds per encoder, rounds interleaved; every body checked equal."""
    state = exporter_state(callers)
    registry = build_registry(state)
    baseline = baseline_registry(callers)
    expected = generate_latest(registry)  # warm up, and the reference bytes
    if generate_text(registry) != expected:
        raise SystemExit(f"generate_text differs from generate_latest at {callers} callers")
    generate_latest(baseline)
    times: dict[str, list[float]] = {"text": [], "text_cold": [], "latest": [], "objects": []}
    for _ in range(repeats):
        seconds, body = timed(generate_text, registry)
        times["text"].append(seconds)
        fresh = build_registry(state)  # new collectors: no label text cached yet
        seconds, cold = timed(generate_text, fresh)
        times["text_cold"].append(seconds)
        seconds, reference = timed(generate_latest, registry)
        times["latest"].append(seconds)
        if not body == cold == reference == expected:
            raise SystemExit(f"encoders disagree at {callers} callers")
        times["objects"].append(timed(generate_latest, baseline)[0])
    out: dict[str, float | int] = {key: statistics.median(values)
                                   for key, values in times.items()}
    out["bytes"] = len(expected)
    out["samples"] = sum(1 for line in expected.splitlines()
                         if line and not line.startswith(b"#"))
    out["baseline_samples"] = sum(1 for line in generate_latest(baseline).splitlines()
                                  if line and not line.startswith(b"#"))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    print(f"{'callers':>8} {'samples':>8} {'bytes':>10} {'generate_text ms':>17} "
          f"{'(cold) ms':>10} {'generate_latest ms':>19} {'speed-up':>9} "
          f"{'client_python objects ms':>25}")
    for callers in args.callers:
        m = measure(callers, args.repeats)
        print(f"{callers:>8} {m['samples']:>8,} {m['bytes']:>10,} {m['text'] * 1000:>17.1f} "
              f"{m['text_cold'] * 1000:>10.1f} {m['latest'] * 1000:>19.1f} "
              f"{m['latest'] / m['text']:>8.1f}x {m['objects'] * 1000:>25.1f}")
        if m["samples"] - m["baseline_samples"] != 5:  # the exporter's own series
            print(f"  (sample counts differ: {m['samples']} vs {m['baseline_samples']})")
    print("speed-up: generate_latest / generate_text on the same registry, same bytes "
          "(checked every round)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
