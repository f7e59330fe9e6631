"""Soak: steady usage ingest with a scrape every second, for minutes; RSS must stay flat and
every event must be counted.

    python bench/bench_soak.py [--minutes 10] [--rate 2000] [--callers 500]
        [--sessions 5000] [--exporter-args='--flag value ...'] [--json]

Starts the exporter as deployed (``python -m exporter run --web.listen-address
127.0.0.1:<port>`` plus ``--exporter-args``) and, for ``--warmup`` seconds and then
``--minutes`` minutes:

- sends ``--rate`` events/s as NDJSON batches to POST /v1/usage, one batch every
  ``--batch-interval`` seconds on one keep-alive connection (a late batch is sent at once, so
  the rate holds on average): multi-turn agent conversations, ``--sessions`` of them spread
  over ``--callers`` callers, prompts growing every turn, cached counts whole granules of
  2,048 (mostly warm, some partial or evicted, a conversation restarting once it is long);
  deterministic from ``--seed``;
- scrapes /metrics every second with Prometheus' headers (OpenMetrics preferred, gzip), on
  a keep-alive connection, skipping ticks a slow scrape overran, as Prometheus does;
- reads the exporter's VmRSS every second.

Reported: RSS at the start (the end of the warm-up), at every minute and at the end, the
least-squares slope after the warm-up, events sent against
``vllm_cache_usage_events_total{reader="http"}`` plus every
``vllm_cache_usage_events_rejected_total{reader="http"}`` (they must be equal), ingest and
scrape latency (p50, p99, max). Exit status 1 if the counts differ, the exporter died, or
RSS grew more than ``--max-growth-mb`` after the warm-up.

A benchmark, not a timed test: the full 10 minutes belong on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from harness import (
    PROMETHEUS_HEADERS,
    PROMETHEUS_SCRAPE_TIMEOUT,
    TEXT_HEADERS,
    ExporterProcess,
    MemorySampler,
    MiB,
    commit,
    cpu_seconds,
    decoded,
    fetch,
    machine,
    quantile,
    sample_value,
    sum_samples,
)

GRANULE = 2048
MODEL = "qwen3.8-27b"
SYSTEM_PROMPT_TOKENS = 6_000  # shared by every conversation of a caller: cached on turn 1
RESTART_ABOVE = 150_000  # a conversation this long is compacted and starts over


# ---- the traffic ---------------------------------------------------------------------


@dataclass
class Conversation:
    caller: str
    session: str
    prompt_tokens: int = 0  # the last turn's prompt; 0 before the first turn


class Traffic:
    """Agent conversations: each event is the next turn of a randomly chosen conversation."""

    def __init__(self, callers: int, sessions: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.conversations = [
            Conversation(f"agent-{index % callers:03d}", f"conv-{index:05d}")
            for index in range(sessions)
        ]

    def event(self, now: float) -> dict[str, Any]:
        rng = self.rng
        conversation = self.conversations[rng.randrange(len(self.conversations))]
        previous = conversation.prompt_tokens
        if previous == 0 or previous > RESTART_ABOVE:
            prompt = SYSTEM_PROMPT_TOKENS + rng.randrange(200, 20_000)
            cached = (SYSTEM_PROMPT_TOKENS - 1) // GRANULE * GRANULE
        else:
            prompt = previous + rng.randrange(300, 4_000)
            reusable = (previous - 1) // GRANULE * GRANULE
            roll = rng.random()
            if roll < 0.85:  # warm: the previous turn's whole granules
                cached = reusable
            elif roll < 0.95:  # partial: evicted back to some block
                cached = rng.randrange(0, reusable + 1, GRANULE)
            else:  # evicted
                cached = 0
        conversation.prompt_tokens = prompt
        new_tokens = prompt - cached
        queue = round(rng.uniform(0.0, 5.0), 3) if rng.random() < 0.1 else 0.0
        event: dict[str, Any] = {
            "caller": conversation.caller,
            "model": MODEL,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "completion_tokens": rng.randrange(50, 1_500),
            "ttft_seconds": round(queue + 0.2 + new_tokens / 3_000, 3),
            "queue_seconds": queue,
            "session": conversation.session,
            "time": round(now, 3),
            "status": 200,
        }
        if rng.random() < 0.005:
            event["status"] = 500
        return event

    def batch(self, size: int, now: float) -> bytes:
        return "\n".join(
            json.dumps(self.event(now), separators=(",", ":")) for _ in range(size)
        ).encode()


# ---- the run -------------------------------------------------------------------------


@dataclass
class Timed:
    at: float  # monotonic start
    seconds: float
    ok: bool


@dataclass
class SoakRun:
    args: argparse.Namespace
    exporter: ExporterProcess
    events_sent: int = 0  # in POSTs that were answered
    events_unanswered: int = 0  # in POSTs that failed: the counts cannot match then
    replies_accepted: int = 0
    replies_rejected: int = 0
    posts: list[Timed] = field(default_factory=list)
    scrapes: list[Timed] = field(default_factory=list)
    skipped_ticks: int = 0
    max_lag: float = 0.0
    marks: dict[str, float] = field(default_factory=dict)
    final_metrics: str | None = None


async def send(run: SoakRun, ends: float) -> None:
    args = run.args
    traffic = Traffic(args.callers, args.sessions, args.seed)
    size = max(1, round(args.rate * args.batch_interval))
    url = run.exporter.base_url + "/v1/usage"
    headers = {"Content-Type": "application/x-ndjson"}
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tick = time.monotonic()
        while tick < ends:
            await asyncio.sleep(max(0.0, tick - time.monotonic()))
            run.max_lag = max(run.max_lag, time.monotonic() - tick)
            body = traffic.batch(size, time.time())
            started = time.monotonic()
            try:
                async with session.post(url, data=body, headers=headers) as response:
                    reply = await response.json()
                    ok = response.status == 200
                run.events_sent += size
                run.replies_accepted += reply.get("accepted", 0)
                run.replies_rejected += reply.get("rejected", 0)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                run.events_unanswered += size
                ok = False
            run.posts.append(Timed(started, time.monotonic() - started, ok))
            tick += args.batch_interval


async def scrape(run: SoakRun, ends: float) -> None:
    url = run.exporter.base_url + "/metrics"
    async with aiohttp.ClientSession() as session:
        tick = time.monotonic()
        while tick < ends:
            await asyncio.sleep(max(0.0, tick - time.monotonic()))
            started = time.monotonic()
            try:
                seconds, status, _, _ = await fetch(
                    session, url, PROMETHEUS_HEADERS, PROMETHEUS_SCRAPE_TIMEOUT
                )
                run.scrapes.append(Timed(started, seconds, status == 200))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                run.scrapes.append(Timed(started, time.monotonic() - started, False))
            tick += 1.0
            while tick < time.monotonic():  # a scrape overran: skip its missed ticks
                tick += 1.0
                run.skipped_ticks += 1


async def soak(run: SoakRun) -> None:
    run.marks["start"] = time.monotonic()
    run.marks["measured"] = run.marks["start"] + run.args.warmup
    ends = run.marks["measured"] + run.args.minutes * 60
    await asyncio.gather(send(run, ends), scrape(run, ends))
    run.marks["end"] = time.monotonic()
    async with aiohttp.ClientSession() as session:
        _, status, wire, headers = await fetch(
            session, run.exporter.base_url + "/metrics", TEXT_HEADERS, 60
        )
    run.final_metrics = decoded(wire, headers).decode() if status == 200 else None


# ---- the report ----------------------------------------------------------------------


def slope_mb_per_minute(points: list[tuple[float, int]]) -> float | None:
    """Least-squares slope of (seconds, bytes) in MB per minute."""
    if len(points) < 2:
        return None
    count = len(points)
    mean_t = sum(t for t, _ in points) / count
    mean_v = sum(v for _, v in points) / count
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return None
    covariance = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return covariance / spread * 60 / MiB


def latency(samples: list[Timed], start: float) -> dict[str, Any]:
    window = [sample for sample in samples if sample.at >= start]
    seconds = [sample.seconds for sample in window]
    return {
        "count": len(window),
        "failed": sum(1 for sample in window if not sample.ok),
        "p50_ms": _ms(quantile(seconds, 0.5)),
        "p99_ms": _ms(quantile(seconds, 0.99)),
        "max_ms": _ms(max(seconds) if seconds else None),
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


def report(
    run: SoakRun, sampler: MemorySampler, alive: bool, cpu: tuple[float | None, float | None]
) -> dict[str, Any]:
    measured, end = run.marks["measured"], run.marks.get("end", time.monotonic())
    after_warmup = [(s.at - measured, s.rss) for s in sampler.samples if s.at >= measured]
    rss_start = sampler.rss_at(measured)
    minutes = []
    for minute in range(1, round((end - measured) / 60) + 1):
        value = sampler.rss_at(min(measured + minute * 60, end))
        minutes.append(round(value / MiB, 1) if value is not None else None)
    rss_end = sampler.rss_at(end)
    text = run.final_metrics or ""
    counted = sample_value(text, 'vllm_cache_usage_events_total{reader="http"}')
    rejected = sum_samples(text, "vllm_cache_usage_events_rejected_total", 'reader="http"')
    cpu_start, cpu_end = cpu
    return {
        "minutes": run.args.minutes,
        "warmup_s": run.args.warmup,
        "rate": run.args.rate,
        "callers": run.args.callers,
        "sessions": run.args.sessions,
        "command": " ".join(shlex.quote(part) for part in run.exporter.command),
        "survived": alive and sampler.killed_for is None,
        "killed_for": sampler.killed_for,
        "rss_start_mb": _mb(rss_start),
        "rss_per_minute_mb": minutes,
        "rss_end_mb": _mb(rss_end),
        "rss_max_after_warmup_mb": _mb(max((v for _, v in after_warmup), default=None)),
        "rss_growth_mb": (
            _mb(rss_end - rss_start) if rss_start is not None and rss_end is not None else None
        ),
        "rss_slope_mb_per_min": _round(slope_mb_per_minute(after_warmup), 2),
        "vmhwm_mb": _mb(sampler.latest().hwm if sampler.latest() else None),
        "events_sent": run.events_sent,
        "events_unanswered": run.events_unanswered,
        "replies_accepted": run.replies_accepted,
        "replies_rejected": run.replies_rejected,
        "events_counted": counted,
        "events_rejected_counted": rejected,
        "counts_equal": (
            counted is not None
            and run.events_unanswered == 0
            and counted + rejected == run.events_sent
        ),
        "ingest_requests_rejected": sum_samples(
            text, "vllm_cache_usage_ingest_requests_rejected_total"
        ),
        "achieved_rate": round(run.events_sent / max(end - run.marks["start"], 1e-9)),
        "sender_max_lag_s": round(run.max_lag, 3),
        "ingest_post": latency(run.posts, measured),
        "scrape": latency(run.scrapes, measured),
        "scrape_ticks_skipped": run.skipped_ticks,
        "exporter_cpu_share": (
            round((cpu_end - cpu_start) / (end - measured), 2)
            if cpu_start is not None and cpu_end is not None
            else None
        ),
        "log_bytes": run.exporter.log_bytes(),
        "rss_timeline_mb": sampler.timeline(run.marks["start"], step=5.0),
    }


def _mb(value: float | None) -> float | None:
    return None if value is None else round(value / MiB, 1)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def print_report(result: dict[str, Any]) -> None:
    print(
        f"soak: {result['minutes']} min after a {result['warmup_s']:.0f} s warm-up, "
        f"{result['rate']:,} events/s target ({result['achieved_rate']:,} achieved, "
        f"sender max lag {result['sender_max_lag_s']} s), {result['callers']} callers, "
        f"{result['sessions']:,} sessions"
    )
    print(
        f"exporter: {result['command']}; survived: {result['survived']}"
        + (f" ({result['killed_for']})" if result["killed_for"] else "")
        + f"; CPU share {result['exporter_cpu_share']}; log {result['log_bytes']:,} bytes"
    )
    print(
        f"RSS MB: start {result['rss_start_mb']}, per minute {result['rss_per_minute_mb']}, "
        f"end {result['rss_end_mb']}; growth {result['rss_growth_mb']}, slope "
        f"{result['rss_slope_mb_per_min']} MB/min, max {result['rss_max_after_warmup_mb']}, "
        f"VmHWM {result['vmhwm_mb']}"
    )
    print(
        f"events: sent {result['events_sent']:,} (unanswered "
        f"{result['events_unanswered']:,}); counted {result['events_counted']} + rejected "
        f"{result['events_rejected_counted']}; replies {result['replies_accepted']:,} "
        f"accepted + {result['replies_rejected']:,} rejected; whole requests refused "
        f"{result['ingest_requests_rejected']}; equal: {result['counts_equal']}"
    )
    for name in ("ingest_post", "scrape"):
        figures = result[name]
        print(
            f"{name}: {figures['count']:,}, failed {figures['failed']}, p50 "
            f"{figures['p50_ms']} ms, p99 {figures['p99_ms']} ms, max {figures['max_ms']} ms"
        )
    print(f"scrape ticks skipped (a scrape overran its second): {result['scrape_ticks_skipped']}")


# ---- main ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before the start")
    parser.add_argument("--rate", type=int, default=2000, help="events per second")
    parser.add_argument(
        "--batch-interval", type=float, default=0.1, help="seconds between NDJSON batches"
    )
    parser.add_argument("--callers", type=int, default=500)
    parser.add_argument("--sessions", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument(
        "--exporter-args",
        default="",
        type=shlex.split,
        help="extra flags for the exporter, one string",
    )
    parser.add_argument(
        "--max-growth-mb",
        type=float,
        default=20.0,
        help="RSS growth after the warm-up that fails the run",
    )
    parser.add_argument(
        "--rss-guard-mb", type=int, default=4096, help="kill the exporter above this RSS"
    )
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up on kill, too
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as workdir:
        exporter = ExporterProcess(Path(workdir), args.exporter_args)
        sampler: MemorySampler | None = None
        try:
            exporter.start()
            deadline = time.monotonic() + args.warmup + args.minutes * 60 + 120
            sampler = MemorySampler(exporter, 1.0, args.rss_guard_mb * MiB, deadline)
            sampler.start()
            run = SoakRun(args, exporter)
            cpu_start: list[float | None] = []

            async def main_task() -> None:
                async def note_cpu() -> None:
                    await asyncio.sleep(args.warmup)
                    cpu_start.append(cpu_seconds(exporter.pid))

                await asyncio.gather(soak(run), note_cpu())

            asyncio.run(main_task())
            cpu_end = cpu_seconds(exporter.pid)
            alive = exporter.alive()
            sampler.stop()
            result = report(run, sampler, alive, (cpu_start[0] if cpu_start else None, cpu_end))
        finally:
            if sampler is not None:
                sampler.stop()
            exporter.stop()
    result.update(machine=machine(), commit=commit(), date=time.strftime("%Y-%m-%d"))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{result['date']}, commit {result['commit']}, {result['machine']}")
        print_report(result)
    healthy = (
        result["survived"]
        and result["counts_equal"]
        and (result["rss_growth_mb"] or 0) <= args.max_growth_mb
    )
    return 0 if healthy else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the finally block has stopped the exporter by now
        print("interrupted; the exporter was stopped", file=sys.stderr)
        sys.exit(130)
