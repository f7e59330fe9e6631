"""NDJSON ingest: events per exporter CPU-second, against a bare json.loads loop, same run.

    python bench/bench_ingest.py [--batches 100] [--batch-size 1000] [--repeats 5]

The exporter runs as deployed (``python -m exporter run``, its own process); this process
POSTs the batches to ``/v1/usage`` one after another on one keep-alive connection and reads
the exporter's CPU time (user + system, /proc) before and after each repeat, so the figure
is the exporter's whole cost per event: HTTP, splitting, decoding, validation,
classification, counting, and whatever else its event loop does meanwhile. The floor, in
this process: the stdlib ``json.loads`` and a counter increment per line of the same bodies
(CPU time of this process), nothing else. Each body goes through the floor and then every
exporter measured (``--before``, ``--also-args``) in turn before the next body, so that on a
shared machine all of them see the same load. Reported: the median of the repeats for each,
and their ratios. Each repeat starts fresh exporters, so every repeat sees the same callers
arrive.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
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
            lines.append(
                json.dumps(
                    {
                        "caller": caller,
                        "model": "qwen3.8-27b",
                        "prompt_tokens": prompt,
                        "cached_tokens": max(0, cached),
                        "completion_tokens": rng.randrange(50, 800),
                        "ttft_seconds": round(rng.uniform(0.5, 90.0), 3),
                        "queue_seconds": round(rng.uniform(0.0, 2.0), 3),
                        "session": f"{caller}-s{rng.randrange(4)}",
                        "time": round(now, 3),
                        "status": 200,
                    },
                    separators=(",", ":"),
                )
            )
        bodies.append("\n".join(lines).encode())
    return bodies


def bare_body(body: bytes) -> tuple[float, int]:
    """CPU seconds of this process for json.loads + a counter over every line of a body."""
    loads = json.loads
    count = 0
    start = time.process_time()
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


async def one_run(
    bodies: list[bytes], targets: list[tuple[list[str], Path | None]]
) -> tuple[float, list[float]]:
    """(floor CPU seconds, each target exporter's CPU seconds) for every body once.

    Each body is decoded by the floor loop, then POSTed to each exporter in turn, before the
    next body: on a machine shared with other work, the figures compared are taken within
    milliseconds of each other, not a second or more apart.
    """
    exporters = []
    try:
        for exporter_args, root in targets:
            workdir = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
            exporter = (
                ExporterProcess(workdir, exporter_args)
                if root is None
                else ExporterProcess(workdir, exporter_args, root=root)
            )
            exporters.append(exporter)
            exporter.start()
        connector = aiohttp.TCPConnector(limit=len(exporters))
        async with aiohttp.ClientSession(connector=connector) as session:
            accepted = [0] * len(exporters)
            floor = 0.0
            before = [exporter_cpu(exporter) for exporter in exporters]
            for body in bodies:
                spent, count = bare_body(body)
                floor += spent
                for index, exporter in enumerate(exporters):
                    async with session.post(
                        exporter.base_url + "/v1/usage",
                        data=body,
                        headers={"Content-Type": "application/x-ndjson"},
                    ) as response:
                        reply = await response.json()
                        accepted[index] += reply["accepted"]
                    assert reply["accepted"] == count, (reply, count)
            spent_by = [
                exporter_cpu(exporter) - start
                for exporter, start in zip(exporters, before, strict=True)
            ]
            for exporter, events in zip(exporters, accepted, strict=True):
                async with session.get(exporter.base_url + "/metrics") as response:
                    counted = events_counted(await response.text())
                assert counted == events, (counted, events)
    finally:
        for exporter in exporters:
            exporter.stop()
    return floor, spent_by


def runs_text(rates: list[float]) -> str:
    return ", ".join(f"{rate:,.0f}" for rate in rates)


IN_PROCESS_STAGES = (
    "split",
    "ingest without recording",
    "record",
    "whole",
    "floor",
    "whole, 1 line in 10 rejected",
    "whole, every line rejected",
    "file follower, replay",
    "whole, every line with an id",
    "whole, every line a copy (id)",
)
# What the rejected lines of the last two stages hold: an event the check refuses (a negative
# prompt), which costs a decode, a check and a rejection with its reason.
REJECTED_LINE = b'{"caller":"agent-0","model":"qwen3.8-27b","prompt_tokens":-1}'


def with_ids(bodies: list[bytes]) -> list[bytes]:
    """The bodies with an ``id`` on every line (distinct, of a UUID's length), as a proxy
    that sends one for retries would (issue 29)."""
    out = []
    number = 0
    for body in bodies:
        lines = []
        for line in body.split(b"\n"):
            number += 1
            lines.append(line[:-1] + b',"id":"req-%032d"}' % number)
        out.append(b"\n".join(lines))
    return out


def with_rejections(bodies: list[bytes], every: int) -> list[bytes]:
    """The bodies with every ``every``-th line replaced by one the check rejects."""
    out = []
    for body in bodies:
        lines = body.split(b"\n")
        lines[every - 1 :: every] = [REJECTED_LINE] * len(lines[every - 1 :: every])
        out.append(b"\n".join(lines))
    return out


def in_process(bodies: list[bytes], repeats: int) -> dict[str, float]:
    """Microseconds per event of each stage of the ingest, in this process, best of
    ``repeats`` (each on a fresh state): the body split (``read_body``); the ingest with
    recording a no-op (decoding, validation, the loop); recording alone (``record_events`` of
    the validated rows, in the ingest's slices); the whole ingest; the floor; and the whole
    ingest of the same bodies with 1 line in 10, then every line, rejected (per line); and
    the file follower (``--usage.file``) replaying the same lines from a file, recording
    into its own fresh state (``--usage.file.from-start``: reading, decoding, validation and
    counting, as the whole ingest but from a file). Imports the exporter of the working
    directory, so it measures whichever checkout it runs in."""
    from exporter.config import Config
    from exporter.usage.event import validate
    from exporter.usage.formats import native
    from exporter.usage.ingest import EVENTS_PER_SLICE, read_body
    from exporter.wiring import (
        FILE_READER,
        HTTP_READER,
        file_follower,
        signals_state,
        usage_ingest,
    )

    config = Config(callers_max=100)
    events = sum(body.count(b"\n") + 1 for body in bodies)
    rows = [[validate(value) for value, _line in read_body(body)] for body in bodies]

    def split() -> float:
        start = time.perf_counter()
        for body in bodies:
            read_body(body)
        return time.perf_counter() - start

    def ingest(recording: bool, bodies: list[bytes] = bodies, twice: bool = False) -> float:
        """``twice``: the bodies are counted once before the clock starts, so that every
        line timed is a copy of one counted (the retry of a whole batch)."""
        state = signals_state(config)
        reader = usage_ingest(config, state.usage)
        if twice:
            loop = asyncio.new_event_loop()
            for body in bodies:
                loop.run_until_complete(reader.process(read_body(body), native))
            loop.close()
        if not recording:
            reader.record_events = lambda rows: None
        loop = asyncio.new_event_loop()
        try:
            start = time.perf_counter()
            for body in bodies:
                loop.run_until_complete(reader.process(read_body(body), native))
            return time.perf_counter() - start
        finally:
            loop.close()

    def record() -> float:
        record_events = signals_state(config).usage.record_events
        start = time.perf_counter()
        for body_rows in rows:
            for at in range(0, len(body_rows), EVENTS_PER_SLICE):
                record_events(body_rows[at : at + EVENTS_PER_SLICE], HTTP_READER)
        return time.perf_counter() - start

    def floor() -> float:
        start = time.perf_counter()
        for body in bodies:
            bare_body(body)
        return time.perf_counter() - start

    workdir = Path(tempfile.mkdtemp(prefix="bench-follow-"))
    usage_file = workdir / "usage.jsonl"
    usage_file.write_bytes(b"".join(body + b"\n" for body in bodies))

    def replay() -> float:
        follow_config = Config(
            callers_max=100, usage_file=(str(usage_file),), usage_file_from_start=True
        )
        state = signals_state(follow_config)
        follower = file_follower(follow_config, state.usage)
        try:
            start = time.perf_counter()
            while follower.poll():
                pass
            spent = time.perf_counter() - start
        finally:
            follower.close()
        if state.usage.events.get(FILE_READER) != events:
            raise RuntimeError(f"the follower counted {state.usage.events} of {events}")
        return spent

    some_rejected, all_rejected = with_rejections(bodies, 10), with_rejections(bodies, 1)
    identified = with_ids(bodies)
    stages = (
        split,
        lambda: ingest(False),
        record,
        lambda: ingest(True),
        floor,
        lambda: ingest(True, some_rejected),
        lambda: ingest(True, all_rejected),
        replay,
        lambda: ingest(True, identified),
        lambda: ingest(True, identified, twice=True),
    )
    best = [min(stage() for _ in range(repeats)) for stage in stages]
    shutil.rmtree(workdir)
    return {name: spent / events * 1e6 for name, spent in zip(IN_PROCESS_STAGES, best, strict=True)}


def in_process_of(
    root: Path, batches: int, batch_size: int, callers: int, repeats: int
) -> dict[str, float]:
    """``in_process`` run in a child process on the exporter of checkout ``root``."""
    output = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--in-process-here",
            "--batches",
            str(batches),
            "--batch-size",
            str(batch_size),
            "--callers",
            str(callers),
            "--repeats",
            str(repeats),
        ],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {name: float(value) for name, value in json.loads(output).items()}


def report_in_process(args: argparse.Namespace) -> int:
    """``--in-process``: the stages of this checkout and of ``--before``, interleaved."""
    roots = [Path(__file__).resolve().parent.parent]
    if args.before is not None:
        roots.append(args.before)
    runs: list[list[dict[str, float]]] = [[] for _ in roots]
    for _ in range(args.rounds):
        for root, found in zip(roots, runs, strict=True):
            found.append(in_process_of(root, 10, args.batch_size, args.callers, args.repeats))
    print(
        f"machine: {machine()}; exporter at {commit()}; in-process, µs per event, best of "
        f"{args.repeats} on 10 bodies of {args.batch_size:,}, the median of {args.rounds} "
        f"such runs (checkouts in turn); floor / whole: the median of each run's own ratio"
    )
    for root, found in zip(roots, runs, strict=True):
        medians = {
            name: statistics.median(run[name] for run in found) for name in IN_PROCESS_STAGES
        }
        ratio = statistics.median(run["floor"] / run["whole"] for run in found)
        print(
            f"{root}:\n    "
            + "\n    ".join(f"{name:30s} {value:.2f}" for name, value in medians.items())
            + f"\n    {'floor / whole':30s} {ratio:.2f}"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--callers", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        help="also measure the exporter in this checkout (e.g. the main "
        "branch), between the others",
    )
    parser.add_argument(
        "--exporter-args", default="", help="more flags for the exporter, e.g. '--callers.max 1000'"
    )
    parser.add_argument(
        "--also-args",
        default=None,
        help="also measure this checkout's exporter with these flags instead "
        "(e.g. '--no-web.uvloop'), between the others",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="instead: each stage of the ingest in-process, µs per event, "
        "this checkout and --before's",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="--in-process: runs of each checkout, in turn (this machine's "
        "speed drifts over tens of seconds: more rounds, steadier medians)",
    )
    parser.add_argument("--in-process-here", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process_here:
        stages = in_process(
            make_bodies(args.batches, args.batch_size, args.callers, seed=3), args.repeats
        )
        print(json.dumps(stages))
        return 0
    if args.in_process:
        return report_in_process(args)
    bodies = make_bodies(args.batches, args.batch_size, args.callers, seed=3)
    events = args.batches * args.batch_size
    exporter_args = [
        "--callers.max",
        str(max(100, args.callers)),
        "--log.level",
        "warning",
        *args.exporter_args.split(),
    ]
    targets: list[tuple[list[str], Path | None]] = [(exporter_args, None)]
    if args.before is not None:
        targets.append((exporter_args, args.before))
    if args.also_args is not None:
        targets.append(([*exporter_args, *args.also_args.split()], None))
    bare_rates: list[float] = []
    rates: list[list[float]] = [[] for _ in targets]
    for _ in range(args.repeats):
        floor, spent_by = asyncio.run(one_run(bodies, targets))
        bare_rates.append(events / floor)
        for target_rates, spent in zip(rates, spent_by, strict=True):
            target_rates.append(events / spent)
    bare_median = statistics.median(bare_rates)
    medians = [statistics.median(target_rates) for target_rates in rates]
    app_median = medians[0]
    ratio = app_median / bare_median
    print(
        f"machine: {machine()}; exporter at {commit()}; load average "
        f"{', '.join(f'{load:.2f}' for load in os.getloadavg())} at the end"
    )
    print(
        f"events per run: {events:,} in {args.batches} NDJSON batches of {args.batch_size:,}"
        f" ({sum(map(len, bodies)) / events:.0f} bytes/event), {args.repeats} runs; each "
        f"body through the floor and every exporter in turn"
    )
    print(
        f"POST /v1/usage, per exporter CPU-second (HTTP + decode + validate + classify + "
        f"count): median {app_median:,.0f} events  (runs: {runs_text(rates[0])})"
    )
    print(
        f"bare json.loads + counter, per CPU-second:                             "
        f"median {bare_median:,.0f} events  (runs: {runs_text(bare_rates)})"
    )
    labels = [f"the exporter in {args.before}, same bodies:"] if args.before else []
    if args.also_args is not None:
        labels.append(f"this exporter with {args.also_args!r}:")
    for label, median, target_rates in zip(labels, medians[1:], rates[1:], strict=True):
        print(
            f"{label:71s}median {median:,.0f} events  (runs: {runs_text(target_rates)}); "
            f"ratio to bare {median / bare_median:.2f}, this one / it "
            f"{app_median / median:.2f}"
        )
    met = app_median >= GOAL_EVENTS and ratio >= GOAL_RATIO
    print(
        f"ratio exporter / bare: {ratio:.2f}  (goal: >= {GOAL_EVENTS:,} events per CPU-second"
        f" and ratio >= {GOAL_RATIO}: {'met' if met else 'MISSED'})"
    )
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
