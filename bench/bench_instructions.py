"""Instructions per event of the ingest's and the stream reader's steps, counted by valgrind.

    python bench/bench_instructions.py [--before /work/main] [--events 5000]

Why: on these shared machines the same code's CPU time moves by up to 2x between runs, so a
change of 10% in what a step does cannot be seen in time, however many rounds. valgrind's
callgrind counts the instructions a process executes, and that count does not depend on the
machine's load: with the hash seed fixed (PYTHONHASHSEED=0), the same code on the same input
gives the same count, run after run. It is a measure of work, not of time (a dict lookup that
misses the cache costs more time than its instructions say), so time stays the measure of
the goals (bench_ingest.py, bench_tap.py); this one says what a change did to the work.

Each figure is one child process under ``valgrind --tool=callgrind`` that builds the same
inputs (the bench_ingest bodies, the vLLM stream capture) and imports the same modules, then
runs one step; a baseline child builds and imports but runs no step. The step's count is
the difference, per event (per stream for the stream reader). Steps:

- ``floor``: the stdlib ``json.loads`` and a counter per line (bench_ingest's floor);
- ``ingest``: the whole ingest of a body (``UsageIngest.process``: decoding, validation,
  recording), as bench_ingest's in-process "whole";
- ``record``: ``record_events`` alone, of the rows already validated, in the ingest's slices;
- ``stream, 2 chunks``: ``StreamReader`` over the 11-event chat stream in the chunks the
  tap gets in bench_tap (1 event, then 10), stripping the usage chunk;
- ``stream, per event``: the same stream one event per chunk, as vLLM writes it.

``--before PATH`` counts another checkout's exporter on the same inputs (this file's code
drives both: it uses only what both have). Needs Debian's ``valgrind``. About 40 s of
valgrind per child, two at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("floor", "ingest", "record", "stream, 2 chunks", "stream, per event")
STREAMS = 1000  # streams read per stream step
CAPTURE = ROOT / "tests" / "fixtures" / "vllm-0.32.0-cpu" / "03_chat_stream_warm.sse.txt"


def child(step: str, events: int) -> None:
    """Build every step's input, import what every step needs, then run ``step`` alone."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_ingest import bare_body, make_bodies

    import exporter.usage.event as event_module
    from exporter.config import Config
    from exporter.usage.formats import native
    from exporter.usage.ingest import EVENTS_PER_SLICE, read_body
    from exporter.usage.openai import StreamReader
    from exporter.wiring import HTTP_READER, signals_state, usage_ingest

    # (A checkout before the usage event became one struct validated rows into tuples and
    # recorded them with ``record_rows``.)
    validate = getattr(event_module, "validate_row", event_module.validate)
    bodies = make_bodies(events // 1000, 1000, 100, seed=7)
    rows = [[validate(value) for value, _line in read_body(body)] for body in bodies]
    config = Config(callers_max=100)
    state = signals_state(config, clock=lambda: 1_800_000_000.0)
    ingest = usage_ingest(config, state.usage)
    recorder = signals_state(config, clock=lambda: 1_800_000_000.0).usage
    record_events = getattr(recorder, "record_rows", None) or recorder.record_events
    stream = [part + b"\n\n" for part in CAPTURE.read_bytes().split(b"\n\n") if part]
    two_chunks = [stream[0], b"".join(stream[1:])]
    loop = asyncio.new_event_loop()

    def read_streams(chunks: list[bytes]) -> None:
        for _ in range(STREAMS):
            reader = StreamReader(True, 0.0)
            for chunk in chunks:
                reader.feed(chunk, 1.0)
            reader.finish()
            assert reader.usage is not None and reader.ttft_seconds is not None

    if step == "floor":
        assert sum(bare_body(body)[1] for body in bodies) == events
    elif step == "ingest":
        for body in bodies:
            loop.run_until_complete(ingest.process(read_body(body), native))
        assert state.usage.events[HTTP_READER] == events
    elif step == "record":
        for body_rows in rows:
            for at in range(0, len(body_rows), EVENTS_PER_SLICE):
                record_events(body_rows[at : at + EVENTS_PER_SLICE], HTTP_READER)
    elif step == "stream, 2 chunks":
        read_streams(two_chunks)
    elif step == "stream, per event":
        read_streams(stream)
    loop.close()


def count(root: Path, step: str, events: int) -> int:
    """Instructions of a child process running ``step`` (or none) on ``root``'s exporter."""
    done = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            step,
            "--events",
            str(events),
        ],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "PYTHONHASHSEED": "0"},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{root} {step}: exit {done.returncode}\n{done.stderr[-3000:]}")
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"{root} {step}: no count in valgrind's output")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        help="another checkout whose exporter to count on the same inputs",
    )
    parser.add_argument(
        "--events",
        type=int,
        default=5000,
        help="usage events per ingest step (a multiple of 1,000)",
    )
    parser.add_argument("--child", choices=("none", *STEPS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.events)
        return 0
    if shutil.which("valgrind") is None:
        print("needs valgrind: apt-get install -y valgrind", file=sys.stderr)
        return 2
    roots = [ROOT] + ([args.before.resolve()] if args.before else [])
    jobs = [(root, step) for root in roots for step in ("none", *STEPS)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: count(*job, args.events), jobs), strict=True))
    per: dict[Path, dict[str, float]] = {}
    for root in roots:
        base = counts[(root, "none")]
        per[root] = {
            step: (counts[(root, step)] - base)
            / (STREAMS if step.startswith("stream") else args.events)
            for step in STEPS
        }
    valgrind = subprocess.run(
        ["valgrind", "--version"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"instructions per event (per stream for the stream reader), {valgrind}, Python "
        f"{sys.version.split()[0]}, {args.events:,} events, {STREAMS:,} streams"
    )
    header = f"{'step':20}" + "".join(f"{str(root):>22}" for root in roots)
    print(header + (f"{'this / before':>15}" if len(roots) > 1 else ""))
    for step in STEPS:
        line = f"{step:20}" + "".join(f"{per[root][step]:22,.0f}" for root in roots)
        if len(roots) > 1:
            line += f"{per[ROOT][step] / per[roots[1]][step]:15.3f}"
        print(line)
    for root in roots:
        print(
            f"floor / ingest in instructions, {root}: "
            f"{per[root]['floor'] / per[root]['ingest']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
