"""/metrics reuses the lines of per-caller series that did not change since the last render.

A scrape of 1,000 callers costs in proportion to the callers that sent something since the
previous one. The reuse must never show a stale value: after any sequence of events, clock
steps (across the new-series hold) and renders, in either format, the body equals
client_python's rendering of the same registry, and only the changed series are rendered
anew.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from exporter.config import Config
from exporter.metrics import build_registry
from exporter.metrics import usage as usage_metrics
from exporter.metrics.exposition import OPENMETRICS, TEXT, generate
from exporter.values import UsageEvent
from exporter.wiring import signals_state
from tests.test_exposition import Clock, assert_equal, record_all_states

HOLD = 10.0

events = st.builds(
    UsageEvent,
    caller=st.sampled_from(["a", "b", 'q"uote', "d"]),
    model=st.sampled_from(["m1", "m2"]),
    prompt_tokens=st.integers(0, 9000),
    cached_tokens=st.one_of(st.none(), st.integers(0, 9000)),
    ttft_seconds=st.one_of(st.none(), st.floats(0, 100)),
    queue_seconds=st.one_of(st.none(), st.floats(0, 10)),
    status=st.sampled_from([None, 200, 500, 429]),
    engine_ttft_seconds=st.one_of(st.none(), st.floats(0, 100)),
    engine_queue_seconds=st.one_of(st.none(), st.floats(0, 10)),
).filter(lambda event: event.cached_tokens is None or event.cached_tokens <= event.prompt_tokens)

steps = st.lists(
    st.one_of(
        st.tuples(st.just("events"), st.lists(events, min_size=1, max_size=4)),
        st.tuples(st.just("wait"), st.sampled_from([0.0, 1.0, HOLD / 2, HOLD, HOLD + 0.5, 30.0])),
        st.tuples(st.just("render"), st.sampled_from(["text", "openmetrics"])),
    ),
    max_size=30,
)


@pytest.mark.new_series_hold
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps)
def test_reused_lines_are_never_stale(program):
    clock = Clock()
    state = signals_state(Config(signals_granularity=16, usage_new_series_hold=HOLD), clock=clock)
    usage = state.usage
    assert usage is not None
    registry = build_registry(state)
    for step, argument in [*program, ("render", "text"), ("render", "openmetrics")]:
        if step == "events":
            usage.record_events(argument, "http")
        elif step == "wait":
            clock.now += argument
        elif argument == "text":
            assert_equal(generate(registry, TEXT), generate_latest(registry))
        else:
            assert_equal(generate(registry, OPENMETRICS), openmetrics_latest(registry))


def rendered_anew(monkeypatch) -> list[str]:  # type: ignore[no-untyped-def]
    """The callers whose lines each render builds anew (the rest are reused)."""
    callers: list[str] = []
    series_lines = usage_metrics._series_lines

    def spy(text, real, now):  # type: ignore[no-untyped-def]
        lines = series_lines(text, real, now)
        callers.append(lines.requests.split('caller="', 1)[1].split('"', 1)[0])
        return lines

    monkeypatch.setattr(usage_metrics, "_series_lines", spy)
    return callers


@pytest.mark.new_series_hold
def test_a_scrape_renders_only_the_series_that_changed(monkeypatch):
    clock = Clock()
    state = signals_state(
        Config(signals_granularity=2048, callers_max=200, usage_new_series_hold=HOLD), clock=clock
    )
    for index in range(100):
        record_all_states(state, f"agent-{index:03d}", "qwen3.8-27b")
    registry = build_registry(state)
    anew = rendered_anew(monkeypatch)

    generate(registry, OPENMETRICS)  # held: zeros, rendered every time until shown
    generate(registry, OPENMETRICS)
    assert len(anew) == 200
    clock.now += HOLD
    first = generate(registry, OPENMETRICS)  # shown now: rendered once more, then kept
    assert len(anew) == 300
    anew.clear()

    assert generate(registry, OPENMETRICS) == first
    assert generate(registry, TEXT) == generate_latest(registry)  # one cache, both formats
    assert anew == []
    assert state.usage is not None
    state.usage.record(UsageEvent("agent-007", "qwen3.8-27b", 40_000, 0, ttft_seconds=1.0), "http")
    changed = generate(registry, OPENMETRICS)
    assert anew == ["agent-007"]
    assert_equal(changed, openmetrics_latest(registry))
    assert changed != first
