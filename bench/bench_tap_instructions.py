"""Instructions per request of the running tap and of the bare aiohttp pass-through, counted by
valgrind.

    python bench/bench_tap_instructions.py [--before /work/main] [--requests 400]

``bench_tap.py`` times the tap against the bare pass-through; on these shared machines those
times move by up to 2x between runs, so a change of 10% in what the tap does is lost in them.
This counts the user-space instructions each process executes per request, which do not
depend on the machine's load: the same code on the same requests gives the same count to
within a fraction of a percent, run after run (the loop's wake-ups vary a little). It is a
measure of work, not of time: it leaves out the kernel (socket calls, page faults), which is
most of a request's time on loopback, and a cache miss costs more than its instructions say.
So the goals stay measured in time (``bench_tap.py``); this says what a change did to the
work, and how the tap's work compares with the bare pass-through's.

Each target runs as deployed (the exporter's ``run``; the bare pass-through of
``bench_tap.py``) under ``valgrind --tool=callgrind --instr-atstart=no`` in front of
``bench_tap.py``'s mock vLLM. After a warm-up of 100 requests, ``callgrind_control``
switches the counting on, ``--requests`` requests are sent one at a time by ``bench_tap.py``'s
client, and the count is dumped. Phases: a whole answer (4 KB prompt), a stream (the client
does not ask for usage: the tap injects and strips it) and a 400 KB prompt. ``--before PATH``
counts another checkout's exporter the same way. Needs Debian's ``valgrind``; about 20 s per
target and phase.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_tap  # noqa: E402
from harness import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PHASES = (
    ("whole answer", False, 4_000),
    ("stream", True, 4_000),
    ("400 KB prompt", False, 400_000),
)
WARM_UP = 100


def count(
    name: str,
    command: list[str],
    cwd: Path,
    port: int,
    stream: bool,
    chars: int,
    requests: int,
    workdir: Path,
) -> float:
    """Instructions per request of ``command`` (a server on ``port``) under callgrind."""
    out = workdir / f"callgrind.{name.replace(' ', '_')}.{chars}.{int(stream)}"
    process = subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}",
            *command,
        ],
        cwd=cwd,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    try:
        bench_tap.wait_port(port, process, name, deadline=300)
        raw = bench_tap.http_request(
            "/v1/chat/completions", bench_tap.chat_payload(stream, chars), port
        )
        asyncio.run(bench_tap.run_phase(port, raw, WARM_UP, 1))
        control = ["callgrind_control"]
        subprocess.run(
            [*control, "-i", "on", str(process.pid)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        asyncio.run(bench_tap.run_phase(port, raw, requests, 1))
        subprocess.run(
            [*control, "-d", str(process.pid)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    finally:
        bench_tap.stop_processes([process])
    dump = Path(f"{out}.1")  # the explicit dump (the file without a suffix is the exit's)
    for line in dump.read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1]) / requests
    raise RuntimeError(f"no summary in {dump}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="also count this checkout's exporter")
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    targets: list[tuple[str, Path]] = [("tap", ROOT)]
    if args.before:
        targets.append(("before", args.before.resolve()))
    results: dict[tuple[str, str], float] = {}
    stack: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            upstream = bench_tap.free_port()
            stack.append(
                subprocess.Popen(
                    [sys.executable, bench_tap.__file__, "--serve-upstream", str(upstream)],
                    start_new_session=True,
                )
            )
            bench_tap.wait_port(upstream, stack[-1], "mock upstream")
            for phase, stream, chars in PHASES:
                port = bench_tap.free_port()
                results[(phase, "bare")] = count(
                    "bare",
                    [
                        sys.executable,
                        bench_tap.__file__,
                        "--serve-passthrough",
                        str(upstream),
                        str(port),
                        bench_tap.default_loop(),
                    ],
                    ROOT,
                    port,
                    stream,
                    chars,
                    args.requests,
                    Path(tmp),
                )
                for name, checkout in targets:
                    port, web = bench_tap.free_port(), bench_tap.free_port()
                    command = [
                        sys.executable,
                        "-m",
                        "exporter",
                        "run",
                        "--web.listen-address",
                        f"127.0.0.1:{web}",
                        "--tap.listen-address",
                        f"127.0.0.1:{port}",
                        "--tap.upstream",
                        f"http://127.0.0.1:{upstream}",
                        "--log.level",
                        "error",
                    ]
                    results[(phase, name)] = count(
                        name, command, checkout, port, stream, chars, args.requests, Path(tmp)
                    )
        finally:
            bench_tap.stop_processes(stack)
    print(
        f"machine: {machine()}; {args.requests} requests per target and phase, one at a "
        "time; user-space instructions per request (callgrind)"
    )
    header = f"{'phase':15} {'bare':>11} {'tap':>11} {'tap/bare':>9}"
    if args.before:
        header += f" {'before':>11} {'before/bare':>12} {'tap/before':>11}"
    print(header)
    for phase, _stream, _chars in PHASES:
        bare, tap = results[(phase, "bare")], results[(phase, "tap")]
        line = f"{phase:15} {bare:11,.0f} {tap:11,.0f} {tap / bare:9.2f}"
        if args.before:
            before = results[(phase, "before")]
            line += f" {before:11,.0f} {before / bare:12.2f} {tap / before:11.3f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
