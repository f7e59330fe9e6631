"""``vllm-cache-exporter demo``: the whole product on one machine, no GPU, one command.

One process runs a simulated vLLM (a field report's scenario, docs/field-reports.md), the
exporter reading it, and the traffic driver reporting each request's usage to the exporter,
all on free loopback ports. It prints the status page's URL, then tells what happens in
plain words as it happens, each line with its scenario time (a caller warm, the second
agent's arrival, the conversations no longer fitting the pool, the collapse, the loop back
to the start, which is a restart of the simulated vLLM: the status page's own model and
sentences, demo/story.py), and shows what the
exporter's /metrics says, refreshed every few seconds: a live terminal view when stdout is a
terminal, plain summaries when it is not. Ctrl-C (or --duration) stops everything cleanly.
``--web.listen-address`` and ``--sim.listen-address`` fix the exporter's and the simulator's
addresses (so that a Prometheus can be pointed at the demo); the tap, when a scenario uses
one, takes a free port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import aiohttp
from aiohttp import web

from exporter import logs, wiring
from exporter.config import Config, split_host_port
from exporter.demo.story import Story
from exporter.demo.view import DemoView
from exporter.server import (
    BODIES_KEY,
    POLLER_KEY,
    SCENARIO_ORIGIN_KEY,
    collapse_rule,
    create_app,
    current_status,
)
from exporter.sim import scenario as scenarios
from exporter.sim.client import HttpClient
from exporter.sim.clock import SimClock
from exporter.sim.driver import Driver
from exporter.sim.report import HttpReporter, Reporter
from exporter.sim.scenario import Scenario, ScenarioError
from exporter.sim.server import build_simulator, create_sim_app, start_site

HOST = "127.0.0.1"
# Bound to a wildcard address, a listener is reached by the demo's own clients on loopback.
WILDCARDS = frozenset({"0.0.0.0", "::", ""})
# Wall seconds between two looks at the status for the story (the table refreshes slower).
STORY_SECONDS = 0.5
log = logging.getLogger(__name__)


async def fetch_metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
        response.raise_for_status()
        return await response.text()


@dataclass(frozen=True)
class Listen:
    """Where the demo's exporter and simulator listen (``--web.listen-address``,
    ``--sim.listen-address``; port 0, their default, picks a free port)."""

    web: str = f"{HOST}:0"
    sim: str = f"{HOST}:0"


def url_host(host: str) -> str:
    """The host part of a URL reaching a listener bound to ``host``."""
    if host in WILDCARDS:
        return HOST
    return f"[{host}]" if ":" in host else host


async def run_demo(
    scenario: Scenario,
    speed: float,
    duration: float,
    refresh: float,
    out: TextIO,
    live: bool,
    stop: asyncio.Event,
    listen: Listen = Listen(),
) -> int:
    clock = SimClock(speed)
    clock.now()  # scenario second 0 is now
    origin = time.time()

    def exporter_clock() -> float:
        """The exporter's clock moves at the scenario's speed, so that its windows (the
        status page's 5 minutes, its hour of history, the conversations' idle window) are
        scenario time, as the TTFTs the simulator reports are."""
        return origin + clock.now()

    sim = build_simulator(scenario.engine_config(), clock)
    sim_host, sim_port = split_host_port(listen.sim)
    sim_runner, sim_port = await start_site(create_sim_app(sim), sim_host, sim_port)
    sim_base = f"http://{url_host(sim_host)}:{sim_port}"
    web_host, web_port = split_host_port(listen.web)
    config = exporter_config(scenario, sim_base, listen.web)
    state = wiring.signals_state(config, clock=exporter_clock)
    app = create_app(config, state=state)
    app[SCENARIO_ORIGIN_KEY] = origin  # the page says scenario time, not a UTC it is not
    try:
        exporter_runner, exporter_port = await start_site(app, web_host, web_port)
    except OSError:
        await sim_runner.cleanup()
        raise
    base = f"http://{url_host(web_host)}:{exporter_port}"
    print(
        f"vllm-cache-exporter demo: scenario {scenario.name} at x{speed:g} (a scenario "
        f"minute passes every {60 / speed:.3g} s; times below are scenario time)",
        file=out,
    )
    print(f"  {scenario.title}", file=out)
    if not live:  # the live view keeps it on screen
        print(
            f"Status page: {base}/  (open it in a browser; Prometheus reads /metrics there)",
            file=out,
        )
    print(f"Simulated vLLM: {sim_base} (OpenAI API, /metrics)", file=out)
    out.flush()

    tap_runner = None
    reporter: Reporter = HttpReporter(base)
    if scenario.demo_tap:
        # The traffic goes through the tap, which records it (and reads its prompts' order)
        # as it would in front of a real vLLM: the driver reports nothing itself.
        tap_runner, tap_port = await start_site(
            wiring.tap_app(config, state.usage, clock=exporter_clock), HOST, 0
        )
        client = HttpClient(f"http://{HOST}:{tap_port}")
        reporter = NoReporter()
        print(f"The scenario's clients go through the tap: http://{HOST}:{tap_port}", file=out)
    else:
        client = HttpClient(sim_base)

    async def restart_vllm(iteration: int) -> None:
        """The loop is a vLLM restart, as the exporter sees one (counters from 0, a new
        _created, the cache empty; the next boot's pool where the scenario has boots), read
        at once so that the story's next look already has it."""
        await sim.restart(scenario.start_config(iteration))
        bodies, timeout = app[BODIES_KEY], app[POLLER_KEY].timeout
        await bodies.engine_read(timeout)  # joins a read in flight: it may predate the restart
        await bodies.engine_read(timeout)

    driver = Driver(
        scenario,
        client,
        reporter,
        clock,
        sim.config.served_model_name,
        loop=True,
        seed=int(time.time()),
        wall_clock=exporter_clock,
        between=restart_vllm,
        backend=None if scenario.demo_tap else sim_base,
    )
    drive = asyncio.ensure_future(driver.run())
    view = DemoView(
        f"{scenario.name}: {scenario.title}",
        f"{base}/",
        window_seconds=collapse_rule().window_seconds,
    )
    story = Story(origin)
    deadline = time.monotonic() + duration if duration else None
    shown = Shown(view, story, app, driver, clock, f"{base}/metrics")
    try:
        async with aiohttp.ClientSession() as session:
            await _show(shown, session, refresh, out, live, stop, deadline, drive)
    finally:
        drive.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await drive
        await client.close()
        if isinstance(reporter, HttpReporter):
            await reporter.close(flush_seconds=2.0)
        if tap_runner is not None:
            await tap_runner.cleanup()
        await exporter_runner.cleanup()
        await sim_runner.cleanup()
    print(
        f"demo stopped after {driver.stats.requests} request(s), {driver.stats.errors} failed",
        file=out,
    )
    out.flush()
    return 0


def exporter_config(
    scenario: Scenario, sim_base: str, web_listen_address: str = f"{HOST}:0"
) -> Config:
    """The exporter as the demo runs it: reading the simulator at ``sim_base``, no new-series
    hold (the view reads /metrics itself, it is no Prometheus). Nothing scenario-specific: what
    a hybrid model's conversations hold in the pool comes from the simulator's cache
    configuration, as from a real vLLM's (compose.yaml and the Kubernetes sidecar run it the
    same way)."""
    config = Config(
        web_listen_address=web_listen_address,
        vllm_url=(sim_base,),
        log_level="warning",
        usage_new_series_hold=0.0,
    )
    if scenario.demo_tap:
        config = dataclasses.replace(config, tap_listen_address=f"{HOST}:0", tap_upstream=sim_base)
    return config


class NoReporter:
    """The driver's reporter when the tap records the traffic."""

    def report(self, event: dict[str, object]) -> None:
        pass

    async def close(self) -> None:
        pass


@dataclass
class Shown:
    """What the demo shows from: the table's view, the story, and where both read."""

    view: DemoView
    story: Story
    app: web.Application
    driver: Driver
    clock: SimClock
    metrics_url: str

    def look(self) -> list[str]:
        """The story's new lines (the same status model as the page at this moment)."""
        status = current_status(self.app)
        self.view.problems = [item.sentence for item in status.problems]
        self.view.status = status
        return [line.render() for line in self.story.look(status, self.driver.stats.iterations)]

    async def scrape(self, session: aiohttp.ClientSession) -> None:
        try:
            text = await fetch_metrics(session, self.metrics_url)
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            self.view.error = f"cannot read the exporter's /metrics: {err}"
            return
        self.view.update(text, self.clock.now(), self.view.problems, self.view.status)


async def _show(
    shown: Shown,
    session: aiohttp.ClientSession,
    refresh: float,
    out: TextIO,
    live: bool,
    stop: asyncio.Event,
    deadline: float | None,
    drive: asyncio.Future[Any],
) -> None:
    """Tell the story as it happens (a look every ``STORY_SECONDS``) and show the table every
    ``refresh`` seconds, until stopped; the last look comes after the stop."""
    from rich.console import Console
    from rich.live import Live

    view = shown.view
    next_table = time.monotonic()

    async def tick() -> bool:
        """Wait for the next look; False when it is time to stop."""
        wait = (
            STORY_SECONDS
            if deadline is None
            else max(0.0, min(STORY_SECONDS, deadline - time.monotonic()))
        )
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), wait)
        return not stop.is_set() and (deadline is None or time.monotonic() < deadline)

    def check_driver() -> None:
        if drive.done() and not drive.cancelled() and drive.exception() is not None:
            raise drive.exception()  # type: ignore[misc]

    if live:
        console = Console(file=out)
        with Live(view.render(), console=console, refresh_per_second=4, transient=False) as screen:
            running = True
            while running:
                check_driver()
                for line in shown.look():
                    screen.console.print(line, highlight=False, markup=False)
                if time.monotonic() >= next_table or not running:
                    await shown.scrape(session)
                    next_table = time.monotonic() + refresh
                screen.update(view.render())
                running = await tick()
            for line in shown.look():
                screen.console.print(line, highlight=False, markup=False)
            await shown.scrape(session)
            screen.update(view.render())
        return
    running = True
    while running:
        check_driver()
        for line in shown.look():
            print(line, file=out, flush=True)
        if time.monotonic() >= next_table:
            await shown.scrape(session)
            print(view.render_plain(), file=out, flush=True)
            next_table = time.monotonic() + refresh
        running = await tick()
    for line in shown.look():
        print(line, file=out, flush=True)
    await shown.scrape(session)
    print(view.render_plain(), file=out, flush=True)


def main(args: argparse.Namespace) -> int:
    logs.setup(args.log_level, args.log_format)
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
            return await run_demo(
                scenario,
                speed,
                args.duration,
                refresh,
                sys.stdout,
                live,
                stop,
                Listen(args.web_listen_address, args.sim_listen_address),
            )
        except OSError as err:
            print(f"demo: cannot start: {err}", file=sys.stderr)
            return 1

    try:
        return asyncio.run(main_async())
    except KeyboardInterrupt:
        return 0
