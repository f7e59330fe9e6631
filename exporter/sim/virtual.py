"""Play a whole scenario in virtual time: simulator, driver and clock in one loop, no sockets.

The discrete-event twin of ``simulate`` + ``drive``: the same engine runner, the same driver,
the same response builders, but the client calls the simulator in-process and the event loop
jumps from timer to timer. A scenario of an hour of two 90k-token conversations costs about a
second of CPU, which is what lets the tests assert every field report's outcome
(docs/field-reports.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from exporter.sim.client import InProcessClient
from exporter.sim.clock import SimClock, run_virtual
from exporter.sim.driver import Driver, DriverStats
from exporter.sim.report import ListReporter
from exporter.sim.scenario import Scenario
from exporter.sim.server import Simulator, build_simulator


@dataclass
class VirtualRun:
    scenario: Scenario
    simulator: Simulator
    events: list[tuple[float, dict[str, Any]]]  # (scenario seconds, usage event)
    stats: DriverStats
    duration: float  # scenario seconds the run took
    metrics_text: str  # the simulator's /metrics at the end


# Called with (scenario seconds, the simulator) while a run plays (see ``play``).
Sampler = Callable[[float, Simulator], None]


def play(
    scenario: Scenario,
    iterations: int = 1,
    boot: int = 0,
    sampler: Sampler | None = None,
    sample_every: float = 15.0,
    restart_between: bool = False,
    **engine_overrides: Any,
) -> VirtualRun:
    """Run ``iterations`` iterations of the scenario on boot ``boot`` of its engine, in
    virtual time, and return what happened.

    ``sampler``, when given, is called every ``sample_every`` scenario seconds from the start
    and once more at the end: what a scraper of the simulator would see along the way.
    ``restart_between``: the engine restarts between two iterations, as the demo's loop does
    (``Simulator.restart``; the next boot's settings when the scenario has boots).
    """

    async def main() -> VirtualRun:
        clock = SimClock(1.0)
        sim = build_simulator(scenario.engine_config(boot, **engine_overrides), clock)
        await sim.runner.start()
        reporter = ListReporter(clock.now)
        client = InProcessClient(sim.service, clock)
        between = None
        if restart_between:

            async def between(iteration: int) -> None:
                await sim.restart(scenario.start_config(boot + iteration, **engine_overrides))

        driver = Driver(
            scenario, client, reporter, clock, sim.config.served_model_name, between=between
        )
        sampling = (
            asyncio.ensure_future(_sample(sampler, sim, clock, sample_every))
            if sampler is not None
            else None
        )
        try:
            stats = await driver.run(iterations)
            if sampling is not None:
                sampling.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampling
                assert sampler is not None
                sampler(clock.now(), sim)
            text = sim.render_metrics().decode()
            return VirtualRun(scenario, sim, reporter.events, stats, clock.now(), text)
        finally:
            await sim.runner.close()

    return run_virtual(main())


def play_boots(
    scenario: Scenario, iterations: int = 1, **engine_overrides: Any
) -> list[VirtualRun]:
    """The scenario once per boot (each a freshly started engine: counters at zero, an empty
    cache, the boot's own pool), one run each."""
    return [
        play(scenario, iterations, boot, **engine_overrides)
        for boot in range(max(1, len(scenario.boots)))
    ]


async def _sample(sampler: Sampler, sim: Simulator, clock: SimClock, every: float) -> None:
    while True:
        sampler(clock.now(), sim)
        await clock.sleep(every)
