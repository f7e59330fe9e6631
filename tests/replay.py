"""A field report's scenario played in virtual time (exporter.sim.virtual), then replayed
into an exporter's state in time order on a frozen clock: its usage events, and the
simulator's /metrics every 15 scenario seconds as the exporter's engine reads. Between two
steps nothing moves, so whatever reads the state then (the status model, the page, /metrics)
reads it at the same moment."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from exporter import wiring
from exporter.config import Config
from exporter.engine.parse import parse
from exporter.server import collapse_rule
from exporter.signals import status
from exporter.signals.state import SignalsState
from exporter.sim import scenario as scenarios
from exporter.sim.virtual import play
from exporter.usage.event import validate

BASE = 1_700_000_000.0
EVENT, SCRAPE = "event", "scrape"


@dataclass
class Replay:
    state: SignalsState
    target: str
    steps: list[tuple[float, str, object]]
    clock: list[float]
    # Called with each scrape's text as it is replayed (a fake vLLM serves it, say).
    on_scrape: Callable[[str], None] = field(default=lambda text: None)
    done: int = 0

    def until(self, seconds: float) -> None:
        while self.done < len(self.steps) and self.steps[self.done][0] <= seconds:
            when, kind, payload = self.steps[self.done]
            self.clock[0] = BASE + when
            if kind == EVENT:
                assert isinstance(payload, dict)
                self.state.usage.record(validate({**payload, "time": BASE + when}), "http")
            else:
                self.state.usage.catch_up(self.clock[0])  # as the server does before a read
                self.state.engine.record_success(
                    self.target, parse(str(payload)), 0.0, self.clock[0]
                )
                self.on_scrape(str(payload))
            self.done += 1
        self.clock[0] = BASE + seconds
        self.state.usage.catch_up(self.clock[0])

    def status(self, seconds: float) -> status.Status:
        self.until(seconds)
        return status.build(self.state.engine, self.state.usage, self.clock[0], collapse_rule())

    @property
    def end(self) -> float:
        return self.steps[-1][0]

    def events(self) -> list[tuple[float, dict]]:
        return [
            (when, payload)
            for when, kind, payload in self.steps
            if kind == EVENT and isinstance(payload, dict)
        ]


def replay(
    name: str,
    target: str = "http://vllm:8000/metrics",
    config: Config | None = None,
    iterations: int = 1,
) -> Replay:
    """The scenario ``name``, ready to replay into a fresh state for ``config`` (default: one
    vLLM at ``target``, nothing else: run's defaults, as compose.yaml starts it).
    ``iterations`` > 1: played that many times with the engine restarted between two, as
    the demo loops it."""
    scenario = scenarios.load(name)
    scrapes: list[tuple[float, str, object]] = []
    run = play(
        scenario,
        iterations,
        sampler=lambda when, sim: scrapes.append((when, SCRAPE, sim.render_metrics().decode())),
        restart_between=iterations > 1,
    )
    steps = sorted(
        [*scrapes, *((when, EVENT, event) for when, event in run.events)],
        key=lambda step: (step[0], step[1] == EVENT),
    )
    config = config or Config(vllm_url=(target,))
    clock = [BASE]
    state = wiring.signals_state(config, clock=lambda: clock[0])
    return Replay(state, config.engine_targets[0], steps, clock)
