"""``vllm-cache-exporter demo``: the whole product on one machine, no GPU, one command.

One process runs a simulated vLLM (a field report's scenario), the exporter reading it, and
the traffic driver reporting each request's usage to the exporter, all on free loopback
ports. It prints the exporter's metrics URL, then shows what the exporter sees, refreshed
every few seconds: a live terminal view when stdout is a terminal, plain summaries when it is
not. Ctrl-C (or --duration) stops everything cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from typing import Any, TextIO

import aiohttp

from exporter.config import Config
from exporter.demo.view import DemoView
from exporter.server import create_app
from exporter.sim import scenario as scenarios
from exporter.sim.client import HttpClient
from exporter.sim.clock import SimClock
from exporter.sim.driver import Driver
from exporter.sim.report import HttpReporter
from exporter.sim.scenario import Scenario, ScenarioError
from exporter.sim.server import build_simulator, create_sim_app, start_site

HOST = "127.0.0.1"
log = logging.getLogger(__name__)


async def fetch_metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
        response.raise_for_status()
        return await response.text()


async def run_demo(scenario: Scenario, speed: float, duration: float, refresh: float,
                   out: TextIO, live: bool, stop: asyncio.Event) -> int:
    clock = SimClock(speed)
    sim = build_simulator(scenario.engine_config(), clock)
    sim_runner, sim_port = await start_site(create_sim_app(sim), HOST, 0)
    # No new-series hold: the view reads /metrics itself, it is no Prometheus.
    config = Config(web_listen_address=f"{HOST}:0", vllm_url=(f"http://{HOST}:{sim_port}",),
                    log_level="warning", usage_new_series_hold=0.0)
    exporter_runner, exporter_port = await start_site(create_app(config), HOST, 0)
    base = f"http://{HOST}:{exporter_port}"
    metrics_url = f"{base}/metrics"
    print(f"vllm-cache-exporter demo: scenario {scenario.name} at x{speed:g}", file=out)
    print(f"  {scenario.title}", file=out)
    print(f"Exporter metrics: {metrics_url}", file=out)
    print(f"Simulated vLLM:   http://{HOST}:{sim_port} (OpenAI API, /metrics)", file=out)
    out.flush()

    client = HttpClient(f"http://{HOST}:{sim_port}")
    reporter = HttpReporter(base)
    driver = Driver(scenario, client, reporter, clock, sim.config.served_model_name,
                    loop=True, seed=int(time.time()))
    drive = asyncio.ensure_future(driver.run())
    view = DemoView(f"{scenario.name}: {scenario.title}", metrics_url)
    deadline = time.monotonic() + duration if duration else None
    try:
        async with aiohttp.ClientSession() as session:
            await _show(view, session, metrics_url, clock, refresh, out, live, stop, deadline,
                        drive)
    finally:
        drive.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await drive
        await client.close()
        await reporter.close(flush_seconds=2.0)
        await exporter_runner.cleanup()
        await sim_runner.cleanup()
    print(f"demo stopped after {driver.stats.requests} request(s), "
          f"{driver.stats.errors} failed", file=out)
    out.flush()
    return 0


async def _show(view: DemoView, session: aiohttp.ClientSession, url: str, clock: SimClock,
                refresh: float, out: TextIO, live: bool, stop: asyncio.Event,
                deadline: float | None, drive: asyncio.Future[Any]) -> None:
    from rich.console import Console
    from rich.live import Live

    async def refresh_view() -> None:
        if drive.done() and not drive.cancelled() and drive.exception() is not None:
            raise drive.exception()  # type: ignore[misc]
        try:
            view.update(await fetch_metrics(session, url), time.monotonic(), clock.now())
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            view.error = f"cannot read the exporter's /metrics: {err}"

    async def tick() -> bool:
        """Wait for the next refresh; False when it is time to stop."""
        wait = refresh if deadline is None else max(0.0, min(refresh,
                                                             deadline - time.monotonic()))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), wait)
        return not stop.is_set() and (deadline is None or time.monotonic() < deadline)

    # The last update comes after the stop, so what stays on screen is the final state.
    if live:
        console = Console(file=out)
        with Live(view.render(), console=console, refresh_per_second=4,
                  transient=False) as screen:
            running = True
            while running:
                await refresh_view()
                screen.update(view.render())
                running = await tick()
            await refresh_view()
            screen.update(view.render())
        return
    running = True
    while running:
        await refresh_view()
        print(view.render_plain(), file=out, flush=True)
        running = await tick()
    await refresh_view()
    print(view.render_plain(), file=out, flush=True)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        scenario = scenarios.load(args.scenario)
    except ScenarioError as err:
        print(f"demo: {err}", file=sys.stderr)
        return 2
    speed = args.speed if args.speed is not None else scenario.demo_speed
    live = sys.stdout.isatty()
    refresh = args.refresh or (2.0 if live else 10.0)

    async def main_async() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        try:
            return await run_demo(scenario, speed, args.duration, refresh, sys.stdout, live,
                                  stop)
        except OSError as err:
            print(f"demo: cannot start: {err}", file=sys.stderr)
            return 1

    try:
        return asyncio.run(main_async())
    except KeyboardInterrupt:
        return 0
