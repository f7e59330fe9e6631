"""Where the tap's CPU goes: the same tap with its own work switched off part by part.

    python bench/bench_tap_parts.py [--rounds 5] [--requests 2000]

``bench_tap.py`` says how far the tap is from a bare aiohttp pass-through; this says what the
difference is made of. One mock vLLM and one bare pass-through (both ``bench_tap.py``'s), and
five taps (``python -m exporter run`` as deployed, each in its own process), each with one
more of its parts replaced by a no-op than the one before (cumulative):

0. the tap as deployed;
1. without the prompt-order diagnosis (hashing the prompt, comparing it with recent ones);
2. and without recording (validating the call's event, counting it);
3. and without reading the answer (the stream reader's event parsing and usage-chunk
   stripping, the whole answer's usage): chunks are relayed as they come;
4. and without reading the request (its facts are computed once per distinct body and
   remembered; no include_usage injection).

What is left at 4 is the proxying itself (header forwarding, the exchange, the process's
connection limits). Only a benchmark: the taps at 2-4 record nothing and, at 3-4, a stream
keeps the usage chunk (so it has one chunk more than at 0-2). CPU per request is each
process's user+system time over a phase divided by its requests; the median over rounds, all
targets in turn in each round, on the same machine load. The differences between neighbours
are what each part costs in the whole process, which is more than it costs in a
micro-benchmark: the code runs with cold caches between aiohttp's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import runpy
import signal
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_tap  # noqa: E402
from harness import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LEVELS = (
    "as deployed",
    "- prompt order",
    "- recording",
    "- reading the answer",
    "- reading the request",
)
PHASES = (("whole c=1", False), ("stream c=1", True))


def serve_tap(level: int, flags: list[str]) -> None:
    """The exporter's ``run``, with the parts of ``LEVELS[1:level + 1]`` made no-ops."""
    from exporter.usage import openai
    from exporter.usage.tap import proxy

    if level >= 1:
        proxy.Tap.record_prompt = lambda self, exchange, event: None  # type: ignore
    if level >= 2:
        proxy.Tap.record = lambda self, exchange: None  # type: ignore

    if level >= 3:

        def feed(self: openai.StreamReader, chunk: bytes, now: float) -> bytes:
            return chunk

        openai.StreamReader.feed = feed  # type: ignore[method-assign]
        proxy.Tap.body_readable = lambda self, upstream: False  # type: ignore[method-assign]
    if level >= 4:
        remembered: dict[bytes, object] = {}
        read_request = proxy.read_request

        async def read_once(body: bytes, endpoint: object) -> object:
            facts = remembered.get(body)
            if facts is None:
                facts = remembered[body] = await read_request(body, endpoint)  # type: ignore
            return facts

        proxy.read_request = read_once  # type: ignore[assignment]
        proxy.with_include_usage = lambda body, facts: body  # type: ignore[assignment]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.argv = ["exporter", "run", *flags]
    runpy.run_module("exporter", run_name="__main__")


async def measure(
    targets: dict[str, tuple[int, int]], rounds: int, requests: int
) -> dict[tuple[str, str], list[float]]:
    found: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for phase, stream in PHASES:
            for name, (port, pid) in targets.items():
                raw = bench_tap.http_request(
                    "/v1/chat/completions", bench_tap.chat_payload(stream, 200), port
                )
                await bench_tap.run_phase(port, raw, requests // 10, 1)
                before = bench_tap.cpu_seconds([pid])
                await bench_tap.run_phase(port, raw, requests, 1)
                spent = bench_tap.cpu_seconds([pid]) - before
                found.setdefault((phase, name), []).append(spent / requests * 1e3)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--serve-tap", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_tap:
        serve_tap(int(args.serve_tap[0]), args.serve_tap[1:])
        return 0
    stack: list[subprocess.Popen] = []
    targets: dict[str, tuple[int, int]] = {}
    try:
        upstream = bench_tap.free_port()
        stack.append(
            subprocess.Popen(
                [sys.executable, bench_tap.__file__, "--serve-upstream", str(upstream)],
                start_new_session=True,
            )
        )
        bench_tap.wait_port(upstream, stack[-1], "mock upstream")
        bare = bench_tap.free_port()
        stack.append(
            subprocess.Popen(
                [
                    sys.executable,
                    bench_tap.__file__,
                    "--serve-passthrough",
                    str(upstream),
                    str(bare),
                    bench_tap.default_loop(),
                ],
                cwd=ROOT,
                start_new_session=True,
            )
        )
        bench_tap.wait_port(bare, stack[-1], "bare pass-through")
        targets["bare"] = (bare, stack[-1].pid)
        for level in range(len(LEVELS)):
            port, web = bench_tap.free_port(), bench_tap.free_port()
            flags = [
                "--web.listen-address",
                f"127.0.0.1:{web}",
                "--tap.listen-address",
                f"127.0.0.1:{port}",
                "--tap.upstream",
                f"http://127.0.0.1:{upstream}",
                "--log.level",
                "error",
            ]
            stack.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--serve-tap", str(level), *flags],
                    cwd=ROOT,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                    start_new_session=True,
                )
            )
            bench_tap.wait_port(port, stack[-1], f"tap {LEVELS[level]}")
            targets[f"tap {level}"] = (port, stack[-1].pid)
        found = asyncio.run(measure(targets, args.rounds, args.requests))
    finally:
        bench_tap.stop_processes(stack)
    print(
        f"machine: {machine()}; {args.rounds} rounds of {args.requests} requests, "
        "CPU ms per request, medians over rounds"
    )
    for phase, _stream in PHASES:
        bare_cpu = statistics.median(found[(phase, "bare")])
        print(f"{phase}: bare pass-through {bare_cpu:.3f}")
        previous = None
        for level, name in enumerate(LEVELS):
            cpu = statistics.median(found[(phase, f"tap {level}")])
            step = "" if previous is None else f"  (the part: {previous - cpu:+.3f})"
            print(f"    tap {level} {name:24s} {cpu:.3f}  x{cpu / bare_cpu:.2f} of bare{step}")
            previous = cpu
    return 0


if __name__ == "__main__":
    sys.exit(main())
