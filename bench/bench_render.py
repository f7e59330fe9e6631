"""/metrics at 100 and 1,000 callers: our encoders vs client_python's, both formats, gzip.

    python bench/bench_render.py [--callers 100 1000] [--models 1] [--repeats 11]
                                 [--levels 1 3 6 9]

For each caller count, the exporter's state is filled with a realistic mix (every caller
has warm, partial and cold requests with TTFT, and a queue wait), then the same registry is
rendered, rounds interleaved, by:

- ``generate_text`` and ``generate_openmetrics``: the exporter's own encoders
  (``exporter/metrics/exposition.py``) in the steady state of a quiet scrape: nothing
  changed since the previous one, so every series' lines are reused and the time is the
  rest of the work (joining, the small families); and the text one again on a freshly built
  registry ("cold": every series rendered anew, as the first scrape after start, or one
  after every histogram of every caller changed);
- client_python's ``generate_latest`` (0.0.4 text) and
  ``openmetrics.exposition.generate_latest`` over the same registry: the baselines, and the
  reference every body is checked equal to in every round;
- ``render_pieces`` as /metrics runs it: in slices, on an event loop, with a turn of the loop
  between slices (total time, number of slices, longest slice);
- gzip of the text body at each zlib level: size on the wire and CPU time.

Reported: medians, speed-ups over client_python on the same registry, sizes. Times are the
CPU time of the rendering thread (``time.thread_time``; gzip: of the process), which other
work on a shared machine inflates less than wall time. One CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gzip
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exporter import metrics  # noqa: E402
from exporter.config import Config  # noqa: E402
from exporter.metrics import build_registry  # noqa: E402
from exporter.metrics.exposition import (  # noqa: E402
    TEXT,
    Format,
    generate_openmetrics,
    generate_text,
    render_pieces,
)
from exporter.metrics.scrape import GZIP_LEVEL, gzip_compress  # noqa: E402
from exporter.signals.state import SignalsState  # noqa: E402
from exporter.signals.usage import SERIES_PER_PAIR  # noqa: E402
from exporter.values import UsageEvent  # noqa: E402
from exporter.wiring import signals_state  # noqa: E402

# The process_* series read a recorded /proc, as in the tests: the real one changes between
# two renders of the same registry (the renders allocate), and every body is compared.
metrics.ProcessCollector = functools.partial(  # type: ignore[misc]
    ProcessCollector, proc=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "proc")
)

MODEL = "qwen3.8-27b"
# (prompt, cached, ttft): one warm, one partial and one cold turn per caller at G = 2048.
TURNS = ((91_070, 86_016, 6.1), (60_000, 30_720, 25.0), (40_000, 0, 74.0))


def exporter_state(callers: int, models: int = 1) -> SignalsState:
    state = signals_state(
        Config(
            signals_granularity=2048,
            callers_max=callers,
            callers_detailed=callers,
            callers_max_series=callers * models * SERIES_PER_PAIR,
        ),
        clock=lambda: 1_800_000_000.0,
    )
    assert state.usage is not None
    names = [MODEL] + [f"{MODEL}-{index}" for index in range(1, models)]
    for index in range(callers):
        for model in names:
            for prompt, cached, ttft in TURNS:
                state.usage.record(
                    UsageEvent(
                        f"agent-{index}",
                        model,
                        prompt,
                        cached,
                        ttft_seconds=ttft,
                        queue_seconds=0.5,
                    ),
                    "http",
                )
    return state


def timed(
    encoder: Callable[[CollectorRegistry], bytes], registry: CollectorRegistry
) -> tuple[float, bytes]:
    start = time.thread_time()
    body = encoder(registry)
    return time.thread_time() - start, body


def sliced(
    loop: asyncio.AbstractEventLoop, registry: CollectorRegistry, fmt: Format
) -> tuple[float, int, float, bytes]:
    """``render_pieces`` on an event loop: total seconds, slices, longest slice, body."""
    slices: list[float] = []

    async def run() -> bytes:
        last = time.thread_time()

        async def pause() -> None:
            nonlocal last
            now = time.thread_time()
            slices.append(now - last)
            await asyncio.sleep(0)
            last = time.thread_time()

        pieces = await render_pieces(registry, fmt, pause)
        slices.append(time.thread_time() - last)
        return b"".join(pieces)

    start = time.thread_time()
    body = loop.run_until_complete(run())
    return time.thread_time() - start, len(slices), max(slices), body


def median_of(values: list[float]) -> float:
    return statistics.median(values)


def measure(callers: int, models: int, repeats: int, levels: list[int]) -> dict[str, float | int]:
    """Median seconds per encoder, rounds interleaved; every body checked equal."""
    state = exporter_state(callers, models)
    registry = build_registry(state)
    text = generate_latest(registry)  # warm up, and the reference bytes
    openmetrics = openmetrics_latest(registry)
    if generate_text(registry) != text or generate_openmetrics(registry) != openmetrics:
        raise SystemExit(f"our encoders differ from client_python's at {callers} callers")
    times: dict[str, list[float]] = {
        key: []
        for key in ("text", "text_cold", "latest", "om", "om_latest", "sliced", "longest_slice")
    }
    slice_counts: list[int] = []
    loop = asyncio.new_event_loop()
    for _ in range(repeats):
        seconds, body = timed(generate_text, registry)
        times["text"].append(seconds)
        fresh = build_registry(state)  # new collectors: no label text cached yet
        seconds, cold = timed(generate_text, fresh)
        times["text_cold"].append(seconds)
        seconds, reference = timed(generate_latest, registry)
        times["latest"].append(seconds)
        seconds, om_body = timed(generate_openmetrics, registry)
        times["om"].append(seconds)
        seconds, om_reference = timed(openmetrics_latest, registry)
        times["om_latest"].append(seconds)
        seconds, count, longest, sliced_body = sliced(loop, registry, TEXT)
        times["sliced"].append(seconds)
        times["longest_slice"].append(longest)
        slice_counts.append(count)
        if not body == cold == reference == sliced_body == text:
            raise SystemExit(f"text encoders disagree at {callers} callers")
        if not om_body == om_reference == openmetrics:
            raise SystemExit(f"OpenMetrics encoders disagree at {callers} callers")
    loop.close()
    out: dict[str, float | int] = {key: median_of(values) for key, values in times.items()}
    out["slices"] = int(median_of([float(count) for count in slice_counts]))
    out["bytes"] = len(text)
    out["om_bytes"] = len(openmetrics)
    out["samples"] = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    for level in levels:
        runs = []
        for _ in range(repeats):
            start = time.process_time()
            packed = gzip_compress([text], level)
            runs.append(time.process_time() - start)
        if gzip.decompress(packed) != text:
            raise SystemExit("gzip round trip failed")
        out[f"gzip{level}"] = median_of(runs)
        out[f"gzip{level}_bytes"] = len(packed)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--models", type=int, default=1, help="models per caller")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 3, 6, 9])
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    results = {
        callers: measure(callers, args.models, args.repeats, args.levels)
        for callers in args.callers
    }

    print("Encoders (ms, medians; speed-up = client_python / ours on the same registry)")
    print(
        f"{'callers':>8} {'samples':>8} {'text bytes':>11} {'ours':>7} {'cold':>7} "
        f"{'client_python':>14} {'speed-up':>9} | {'OM bytes':>10} {'ours':>7} "
        f"{'client_python':>14} {'speed-up':>9}"
    )
    for callers, m in results.items():
        print(
            f"{callers:>8} {m['samples']:>8,} {m['bytes']:>11,} {m['text'] * 1e3:>7.1f} "
            f"{m['text_cold'] * 1e3:>7.1f} {m['latest'] * 1e3:>14.1f} "
            f"{m['latest'] / m['text']:>8.1f}x | {m['om_bytes']:>10,} {m['om'] * 1e3:>7.1f} "
            f"{m['om_latest'] * 1e3:>14.1f} {m['om_latest'] / m['om']:>8.1f}x"
        )

    print("\nSliced render on an event loop, text (ms, medians; sliced includes the final join)")
    print(f"{'callers':>8} {'one-shot':>9} {'sliced':>8} {'slices':>7} {'longest slice':>14}")
    for callers, m in results.items():
        print(
            f"{callers:>8} {m['text'] * 1e3:>9.1f} {m['sliced'] * 1e3:>8.1f} "
            f"{m['slices']:>7} {m['longest_slice'] * 1e3:>14.2f}"
        )

    print(f"\ngzip of the text body (CPU ms, medians; /metrics uses level {GZIP_LEVEL})")
    print(f"{'callers':>8} {'level':>6} {'bytes':>10} {'ratio':>7} {'CPU ms':>8}")
    for callers, m in results.items():
        for level in args.levels:
            size = int(m[f"gzip{level}_bytes"])
            print(
                f"{callers:>8} {level:>6} {size:>10,} {m['bytes'] / size:>6.1f}x "
                f"{m[f'gzip{level}'] * 1e3:>8.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
