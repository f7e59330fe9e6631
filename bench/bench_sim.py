"""Playing a scenario in virtual time vs over loopback HTTP at a high speed, same scenarios,
same run. The virtual run is what the scenario tests use; the HTTP run is what `demo` and
compose do (simulator front + driver over real sockets, wall clock scaled by --speed).

Prints, per scenario, the scenario seconds played, the medians of CPU seconds (virtual) and
of wall and CPU seconds (HTTP), and how many times faster than real time each runs.

    python bench/bench_sim.py [--rounds 3] [--speed 100]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from exporter.sim import scenario as scenarios
from exporter.sim.client import HttpClient
from exporter.sim.clock import SimClock
from exporter.sim.driver import Driver
from exporter.sim.report import ListReporter
from exporter.sim.server import build_simulator, create_sim_app, start_site
from exporter.sim.virtual import play


def virtual(name: str) -> tuple[float, float, int]:
    """(CPU seconds, scenario seconds, requests) of one virtual-time run."""
    started = time.process_time()
    run = play(scenarios.load(name))
    return time.process_time() - started, run.duration, run.stats.requests


async def over_http(name: str, speed: float) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, requests) of one run through the HTTP front."""
    scenario = scenarios.load(name)
    clock = SimClock(speed)
    sim = build_simulator(scenario.engine_config(), clock)
    site, port = await start_site(create_sim_app(sim), "127.0.0.1", 0)
    client = HttpClient(f"http://127.0.0.1:{port}")
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        stats = await Driver(
            scenario, client, ListReporter(clock.now), clock, sim.config.served_model_name
        ).run()
    finally:
        await client.close()
        await site.cleanup()
    return time.perf_counter() - wall, time.process_time() - cpu, stats.requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--speed", type=float, default=100.0)
    args = parser.parse_args()
    print(
        f"| scenario | requests | scenario time | virtual: CPU | x real time | "
        f"HTTP x{args.speed:g}: wall | HTTP: CPU | virtual vs HTTP wall |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in scenarios.available():
        runs = [virtual(name) for _ in range(args.rounds)]
        cpu = statistics.median(run[0] for run in runs)
        seconds, requests = runs[0][1], runs[0][2]
        http = [asyncio.run(over_http(name, args.speed)) for _ in range(args.rounds)]
        http_wall = statistics.median(run[0] for run in http)
        http_cpu = statistics.median(run[1] for run in http)
        print(
            f"| {name} | {requests} | {seconds:,.0f} s | {cpu:.2f} s | "
            f"{seconds / cpu:,.0f}x | {http_wall:.1f} s | {http_cpu:.1f} s | "
            f"{http_wall / cpu:.0f}x |"
        )


if __name__ == "__main__":
    main()
