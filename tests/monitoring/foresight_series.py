"""The exporter's series for a simulator scenario, played in virtual time, as promtool input.

The foresight alert must be true minutes before ``VllmCachePrefixCollapse`` fires, and never
on healthy traffic. Typed-in series would only prove what their author believed; here the
simulator plays the field report's scenario (``exporter.sim.virtual.play``), a sampler reads
its /metrics every ``STEP_SECONDS`` of scenario time, and a real exporter state (the same
``signals_state`` and collectors ``run`` uses) is fed that scrape plus the usage events that
had finished by then, on an injected clock. What its registry then shows is one sample of
each series, exactly as Prometheus would have scraped it.

The result is written into ``alerts/tests/conversations_*.yaml`` (``input_series`` only; the
assertions are written by hand, against the data) and ``test_foresight_series.py`` fails if
the committed series and these builders ever disagree.

``python -m tests.monitoring.foresight_series`` rewrites the ``input_series`` of those files.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from exporter.config import Config
from exporter.engine.parse import parse
from exporter.metrics import build_registry
from exporter.sim import scenario as scenarios
from exporter.sim.server import Simulator
from exporter.sim.virtual import play
from exporter.usage.event import validate
from exporter.wiring import signals_state
from tests.monitoring.workloads import ALERTS_TESTS, encode, input_block

STEP_SECONDS = 15  # the promtool tests' interval
EPOCH = 1_700_000_000.0  # scenario second 0, as unix time
TARGET = "http://vllm:8000/metrics"
JOB = {"job": "vllm-cache-exporter", "instance": "exporter:10123"}
# After the last turn the exporter keeps being scraped, with vLLM idle: long enough for every
# conversation to leave the idle window and for the rules' short windows to empty.
TAIL_SECONDS = 15 * 60
# The series the foresight and collapse rules read (engine scope); nothing else is needed.
SERIES = (
    "vllm_cache_engine_prefix_cache_queries_tokens_total",
    "vllm_cache_engine_prefix_cache_hits_tokens_total",
    "vllm_cache_engine_kv_pool_tokens",
    "vllm_cache_engine_kv_pool_min_tokens",
    "vllm_cache_engine_admission_budget_tokens",
    "vllm_cache_engine_conversations_active",
    "vllm_cache_engine_conversations_demand_tokens",
)


@dataclass
class Played:
    """Per series (promtool notation of its name and labels), one value per step."""

    steps: int
    series: dict[str, list[int | None]] = field(default_factory=dict)

    def encoded(self) -> dict[str, str]:
        return {name: encode(values) for name, values in self.series.items()}


def _name(sample_name: str, labels: dict[str, str]) -> str:
    parts = [f'{key}="{value}"' for key, value in {**JOB, **labels}.items()]
    return f"{sample_name}{{{', '.join(parts)}}}"


def exporter_series(name: str, config: Config | None = None) -> Played:
    """Play scenario ``name`` and return the exporter's series, one sample per step, as an
    exporter run with ``config`` serves them (default: nothing but the vLLM to read; the
    vLLM read is the simulator, whatever ``config`` says)."""
    scenario = scenarios.load(name)
    scrapes: list[tuple[float, str]] = []

    def sampler(when: float, sim: Simulator) -> None:
        if math.isclose(when % STEP_SECONDS, 0.0, abs_tol=1e-6) or math.isclose(
            when % STEP_SECONDS, STEP_SECONDS, abs_tol=1e-6
        ):
            scrapes.append((when, sim.render_metrics().decode()))

    run = play(scenario, sampler=sampler, sample_every=STEP_SECONDS)
    last_time, last_text = scrapes[-1]
    for extra in range(1, TAIL_SECONDS // STEP_SECONDS + 1):
        scrapes.append((last_time + extra * STEP_SECONDS, last_text))

    now = [EPOCH]
    config = dataclasses.replace(config or Config(usage_new_series_hold=0), vllm_url=(TARGET,))
    state = signals_state(config, clock=lambda: now[0])
    registry = build_registry(state)
    events = sorted(run.events, key=lambda item: item[0])
    fed = 0
    played = Played(len(scrapes) - 1)
    for step, (when, text) in enumerate(scrapes):
        now[0] = EPOCH + when
        while fed < len(events) and events[fed][0] <= when:
            finished, event = events[fed]
            state.usage.record(validate({**event, "time": EPOCH + finished}), "http")
            fed += 1
        state.engine.record_success(TARGET, parse(text), 0.0, now[0])
        _read(registry, played, step)
    return played


def _read(registry: Any, played: Played, step: int) -> None:
    for family in registry.collect():
        for sample in family.samples:
            if sample.name not in SERIES:
                continue
            values = played.series.setdefault(
                _name(sample.name, sample.labels), [None] * (played.steps + 1)
            )
            values[step] = round(sample.value)


def filename(scenario: str) -> str:
    return f"conversations_{scenario.replace('-', '_')}.yaml"


# Scenarios whose live conversations fit their pool: the alert must never be even pending.
HEALTHY = ("two-agents-fit", "fanout-order", "details-off", "prefix-caching-off")
# Scenarios whose conversations do not fit: their files' assertions are written by hand.
OVERFLOWING = ("two-agents-collapse", "overload-preempt")
SCENARIOS: dict[str, Callable[[], Played]] = {
    filename(name): (lambda name=name: exporter_series(name)) for name in (*OVERFLOWING, *HEALTHY)
}

_INPUT_BLOCK = re.compile(r"(?m)^    input_series:\n(?:      .*\n)+")

_HEALTHY_FILE = """\
# {scenario}: {title}
# Its conversations fit the KV pool, so VllmCacheConversationsExceedKVPool is never even
# pending: ALERTS holds no sample of it over the whole run and the quiet {tail} minutes after.
# The input series are what the exporter served while the simulator played the scenario in
# virtual time (tests/monitoring/foresight_series.py; test_foresight_series.py fails if they
# drift apart). Rewrite them with `python -m tests.monitoring.foresight_series`.
rule_files:
  - ../vllm-cache-rules.yaml
  - ../vllm-cache-alerts.yaml
evaluation_interval: {step}s
group_eval_order:
  - vllm-cache-caller.rules
  - vllm-cache-caller-detail.rules
  - vllm-cache-caller-long.rules
  - vllm-cache-engine.rules
  - vllm-cache.alerts
  - vllm-cache-caller.alerts

tests:
  - name: {scenario} never overflows its pool
    interval: {step}s
{inputs}    promql_expr_test:
      - expr: max_over_time(ALERTS{{alertname="VllmCacheConversationsExceedKVPool"}}[{end}s])
        eval_time: {end}s
        exp_samples: []
      # {seen}
      - expr: max_over_time(target_model:vllm_cache_conversations_active:sum[{end}s])
        eval_time: {end}s
        exp_samples:
          - labels: '{{job="vllm-cache-exporter", model_name="{model}", target="{target}"}}'
            value: {most_active}
"""


def healthy_file(scenario: str, played: Played) -> str:
    """The whole promtool file of a healthy scenario: its assertions are mechanical."""
    loaded = scenarios.load(scenario)
    active = next(
        values
        for name, values in played.series.items()
        if name.startswith("vllm_cache_engine_conversations_active{")
    )
    most_active = max(value or 0 for value in active)
    return _HEALTHY_FILE.format(
        scenario=scenario,
        title=loaded.title,
        tail=TAIL_SECONDS // 60,
        step=STEP_SECONDS,
        inputs=input_block(played.encoded()),
        end=played.steps * STEP_SECONDS,
        model=loaded.engine_config().served_model_name,
        target=TARGET,
        most_active=most_active,
        seen=(
            "...while the rules did see its live conversations (the silence is not for lack of "
            "data)"
            if most_active
            else "...and no conversation at all: its requests are one-shots, never followed up "
            "(one request alone holds nothing a next turn wants)"
        ),
    )


def render(name: str, text: str) -> str:
    """The file's text: a healthy scenario's whole file, else the hand-written file with its
    ``input_series`` block rebuilt from the scenario."""
    played = SCENARIOS[name]()
    scenario = next(item for item in (*OVERFLOWING, *HEALTHY) if filename(item) == name)
    if scenario in HEALTHY:
        return healthy_file(scenario, played)
    if not _INPUT_BLOCK.search(text):
        raise ValueError(f"{name}: no input_series block")
    return _INPUT_BLOCK.sub(lambda _match: input_block(played.encoded()), text)


def main() -> int:
    for name in SCENARIOS:
        path = ALERTS_TESTS / name
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        rendered = render(name, text)
        if rendered != text:
            path.write_text(rendered, encoding="utf-8")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
