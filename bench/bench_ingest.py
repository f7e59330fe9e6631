"""NDJSON ingest: events per exporter CPU-second, against a bare json.loads loop, same run.

    python bench/bench_ingest.py [--batches 100] [--batch-size 1000] [--repeats 5]

The exporter runs as deployed (``python -m exporter run``, its own process); this process
POSTs the batches to ``/v1/usage`` one after another on one keep-alive connection and reads
the exporter's CPU time (user + system, /proc) before and after each repeat, so the figure
is the exporter's whole cost per event: HTTP, splitting, decoding, validation,
classification, counting, and whatever else its event loop does meanwhile. The floor, in
this process between the exporter's repeats: the stdlib ``json.loads`` and a counter
increment per line of the same bodies (CPU time of this process), nothing else. Reported:
the median of the repeats for each, and their ratio. Each repeat starts a fresh exporter,
so every repeat sees the same callers arrive.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
from harness import ExporterProcess, commit, cpu_seconds, machine

GRANULE = 2048
GOAL_EVENTS = 150_000
GOAL_RATIO = 0.8


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
    """CPU seconds of this process for json.loads + a counter over every line."""
    loads = json.loads
    count = 0
    start = time.process_time()
    for body in bodies:
        for line in body.split(b"\n"):
            loads(line)
            count += 1
    return time.process_time() - start, count


def exporter_cpu(exporter: ExporterProcess) -> float:
    spent = cpu_seconds(exporter.pid)
    if spent is None:
        raise RuntimeError(f"the exporter exited; see {exporter.log_path}")
    return spent


def events_counted(text: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith('vllm_cache_usage_events_total{reader="http"}'):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def through_exporter(bodies: list[bytes], exporter_args: list[str],
                           root: Path | None = None) -> tuple[float, int]:
    """(exporter CPU seconds, events accepted) for POSTing every body once."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    exporter = (ExporterProcess(workdir, exporter_args) if root is None
                else ExporterProcess(workdir, exporter_args, root=root))
    exporter.start()
    accepted = 0
    try:
        url = exporter.base_url + "/v1/usage"
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            before = exporter_cpu(exporter)
            for body in bodies:
                async with session.post(url, data=body, headers={
                        "Content-Type": "application/x-ndjson"}) as response:
                    reply = await response.json()
                    accepted += reply["accepted"]
            spent = exporter_cpu(exporter) - before
            async with session.get(exporter.base_url + "/metrics") as response:
                counted = events_counted(await response.text())
        assert counted == accepted, (counted, accepted)
    finally:
        exporter.stop()
    return spent, accepted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--callers", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", type=Path, default=None,
                        help="also measure the exporter in this checkout (e.g. the main "
                             "branch), between the others")
    parser.add_argument("--exporter-args", default="",
                        help="more flags for the exporter, e.g. '--callers.max 1000'")
    parser.add_argument("--also-args", default=None,
                        help="also measure this checkout's exporter with these flags instead "
                             "(e.g. '--no-web.uvloop'), between the others")
    args = parser.parse_args()
    bodies = make_bodies(args.batches, args.batch_size, args.callers, seed=3)
    events = args.batches * args.batch_size
    exporter_args = ["--callers.max", str(max(100, args.callers)), "--log.level", "warning",
                     *args.exporter_args.split()]
    app_rates: list[float] = []
    bare_rates: list[float] = []
    before_rates: list[float] = []
    also_rates: list[float] = []
    also_args = None if args.also_args is None else [*exporter_args, *args.also_args.split()]
    for _ in range(args.repeats):
        spent, bare_count = bare_loop(bodies)
        assert bare_count == events
        bare_rates.append(events / spent)
        spent, accepted = asyncio.run(through_exporter(bodies, exporter_args))
        assert accepted == events, accepted
        app_rates.append(events / spent)
        if args.before is not None:
            spent, accepted = asyncio.run(through_exporter(bodies, exporter_args, args.before))
            assert accepted == events, accepted
            before_rates.append(events / spent)
        if also_args is not None:
            spent, accepted = asyncio.run(through_exporter(bodies, also_args))
            assert accepted == events, accepted
            also_rates.append(events / spent)
    app_median = statistics.median(app_rates)
    bare_median = statistics.median(bare_rates)
    ratio = app_median / bare_median
    print(f"machine: {machine()}; exporter at {commit()}")
    print(f"events per run: {events:,} in {args.batches} NDJSON batches of {args.batch_size:,}"
          f" ({sum(map(len, bodies)) / events:.0f} bytes/event), {args.repeats} runs")
    print(f"POST /v1/usage, per exporter CPU-second (HTTP + decode + validate + classify + "
          f"count): median {app_median:,.0f} events  "
          f"(runs: {', '.join(f'{r:,.0f}' for r in app_rates)})")
    print(f"bare json.loads + counter, per CPU-second:                             "
          f"median {bare_median:,.0f} events  "
          f"(runs: {', '.join(f'{r:,.0f}' for r in bare_rates)})")
    if before_rates:
        before_median = statistics.median(before_rates)
        print(f"the exporter in {args.before}, same bodies:                               "
              f"median {before_median:,.0f} events  "
              f"(runs: {', '.join(f'{r:,.0f}' for r in before_rates)}); ratio to bare "
              f"{before_median / bare_median:.2f}")
    if also_rates:
        also_median = statistics.median(also_rates)
        print(f"this exporter with {args.also_args!r}:                       "
              f"median {also_median:,.0f} events  "
              f"(runs: {', '.join(f'{r:,.0f}' for r in also_rates)}); ratio to bare "
              f"{also_median / bare_median:.2f}")
    met = app_median >= GOAL_EVENTS and ratio >= GOAL_RATIO
    print(f"ratio exporter / bare: {ratio:.2f}  (goal: >= {GOAL_EVENTS:,} events per CPU-second"
          f" and ratio >= {GOAL_RATIO}: {'met' if met else 'MISSED'})")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
