"""NDJSON ingest throughput through the real aiohttp app, against a bare json.loads loop.

    python bench/bench_ingest.py [--batches 100] [--batch-size 1000] [--repeats 5]

Both sides run in this one process, pinned to one CPU: the exporter's app is served on a
real 127.0.0.1 port and an aiohttp client POSTs the batches one after another (so the
client's own cost is inside the measurement: the figure is a floor). The baseline does only
``json.loads`` and a counter increment per line of the same bodies: no HTTP, no validation,
no classification. Reported: the median of the repeats for each, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exporter.config import Config  # noqa: E402
from exporter.server import STATE_KEY, create_app  # noqa: E402

GRANULE = 2048


def make_bodies(batches: int, batch_size: int, callers: int, seed: int) -> list[bytes]:
    """Agent-like traffic: conversations that grow ~2,300 tokens a turn, mostly warm."""
    rng = random.Random(seed)
    prompts = {f"agent-{i}": rng.randrange(3_000, 60_000) for i in range(callers)}
    now = 1_800_000_000.0
    bodies = []
    for _ in range(batches):
        lines = []
        for _ in range(batch_size):
            caller = f"agent-{rng.randrange(callers)}"
            prompt = prompts[caller] = prompts[caller] + rng.randrange(500, 4_000)
            if prompt > 180_000:
                prompt = prompts[caller] = rng.randrange(3_000, 20_000)
            roll = rng.random()
            if roll < 0.8:
                cached = (prompt - 2_500) // GRANULE * GRANULE
            elif roll < 0.9:
                cached = prompt // 2 // GRANULE * GRANULE
            else:
                cached = 0
            now += 0.01
            lines.append(json.dumps({
                "caller": caller, "model": "qwen3.8-27b", "prompt_tokens": prompt,
                "cached_tokens": max(0, cached), "completion_tokens": rng.randrange(50, 800),
                "ttft_seconds": round(rng.uniform(0.5, 90.0), 3),
                "queue_seconds": round(rng.uniform(0.0, 2.0), 3),
                "session": f"{caller}-s{rng.randrange(4)}", "time": round(now, 3),
                "status": 200,
            }, separators=(",", ":")))
        bodies.append("\n".join(lines).encode())
    return bodies


def bare_loop(bodies: list[bytes]) -> tuple[float, int]:
    loads = json.loads
    count = 0
    start = time.perf_counter()
    for body in bodies:
        for line in body.split(b"\n"):
            loads(line)
            count += 1
    return time.perf_counter() - start, count


async def through_app(bodies: list[bytes]) -> tuple[float, int]:
    config = Config()
    app = create_app(config, initial_refresh=False)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}/v1/usage"
    accepted = 0
    try:
        async with aiohttp.ClientSession() as session:
            start = time.perf_counter()
            for body in bodies:
                async with session.post(url, data=body,
                                        headers={"Content-Type": "application/x-ndjson"}) as r:
                    reply = await r.json()
                    accepted += reply["accepted"]
            elapsed = time.perf_counter() - start
        usage = app[STATE_KEY].usage
        assert usage is not None and sum(usage.events.values()) == accepted
    finally:
        await runner.cleanup()
    return elapsed, accepted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--callers", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu", type=int, default=None, help="CPU to pin to (default: one)")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {args.cpu if args.cpu is not None else cpus[-1]})
    bodies = make_bodies(args.batches, args.batch_size, args.callers, seed=3)
    events = args.batches * args.batch_size
    app_rates, bare_rates = [], []
    for _ in range(args.repeats):
        elapsed, bare_count = bare_loop(bodies)
        assert bare_count == events
        bare_rates.append(events / elapsed)
        elapsed, accepted = asyncio.run(through_app(bodies))
        assert accepted == events, accepted
        app_rates.append(events / elapsed)
    app_median = statistics.median(app_rates)
    bare_median = statistics.median(bare_rates)
    print(f"events per run: {events:,} in {args.batches} NDJSON batches of {args.batch_size:,}"
          f" ({sum(map(len, bodies)) / events:.0f} bytes/event), {args.repeats} runs, 1 CPU")
    print(f"POST /v1/usage (HTTP + validate + classify + count): median {app_median:,.0f} "
          f"events/s  (runs: {', '.join(f'{r:,.0f}' for r in app_rates)})")
    print(f"bare json.loads + counter:                          median {bare_median:,.0f} "
          f"events/s  (runs: {', '.join(f'{r:,.0f}' for r in bare_rates)})")
    print(f"ratio app / bare: {app_median / bare_median:.2f}  (target: app >= 50,000 events/s)")
    return 0 if app_median >= 50_000 else 1


if __name__ == "__main__":
    raise SystemExit(main())
