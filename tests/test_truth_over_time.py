"""What Prometheus sees across scrapes: a new series starts at zero before its counts show,
and a carried engine counter never goes back, whatever a single read of vLLM says."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.config import Config
from exporter.metrics import build_registry
from exporter.metrics.exposition import generate_openmetrics, generate_text
from exporter.signals.engine import EngineState
from exporter.values import PREFIX_CACHE_HITS, EngineSnapshot, EngineValues, UsageEvent
from exporter.wiring import signals_state
from tests.helpers import value

pytestmark = pytest.mark.new_series_hold


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def scrape(state) -> str:
    registry = build_registry(state)
    text = generate_text(registry).decode()
    assert generate_openmetrics(registry)  # both formats hold the same values back
    return text


def test_a_new_caller_is_seen_at_zero_for_the_hold_then_with_every_request():
    clock = Clock()
    state = signals_state(Config(usage_new_series_hold=30.0, signals_granularity=32), clock)
    labels = {"caller": "fresh", "model": "m"}
    state.usage.record(UsageEvent("fresh", "m", 1000, 0, ttft_seconds=9.0), "http")
    first = scrape(state)
    assert value(first, "vllm_cache_requests_total", state="cold", **labels) == 0
    assert value(first, "vllm_cache_prompt_tokens_total", **labels) == 0
    assert value(first, "vllm_cache_ttft_seconds_count", state="cold", **labels) == 0
    clock.now += 29.9
    state.usage.record(UsageEvent("fresh", "m", 1100, 992, ttft_seconds=1.0), "http")
    assert value(scrape(state), "vllm_cache_requests_total", state="warm", **labels) == 0
    clock.now += 0.1  # the hold is over: both requests show, as increases from zero
    after = scrape(state)
    assert value(after, "vllm_cache_requests_total", state="cold", **labels) == 1
    assert value(after, "vllm_cache_requests_total", state="warm", **labels) == 1
    assert value(after, "vllm_cache_prompt_tokens_total", **labels) == 2100
    # The warm TTFT histogram is a series of its own, born at 29.9 s: held until 59.9 s.
    assert value(after, "vllm_cache_ttft_seconds_count", state="warm", **labels) == 0
    assert value(after, "vllm_cache_ttft_seconds_count", state="cold", **labels) == 1
    clock.now += 29.9
    assert value(scrape(state), "vllm_cache_ttft_seconds_count", state="warm", **labels) == 1


def test_a_new_state_of_a_known_pair_is_held_too():
    clock = Clock()
    state = signals_state(Config(usage_new_series_hold=30.0, signals_granularity=32), clock)
    state.usage.record(UsageEvent("a", "m", 1000, 0, ttft_seconds=9.0), "http")
    clock.now += 60
    state.usage.record(UsageEvent("a", "m", 1100, 992, ttft_seconds=1.0), "http")
    text = scrape(state)
    assert value(text, "vllm_cache_ttft_seconds_count", caller="a", model="m",
                 state="cold") == 1
    assert value(text, "vllm_cache_ttft_seconds_count", caller="a", model="m",
                 state="warm") == 0  # a new histogram series, still at zero
    assert value(text, "vllm_cache_requests_total", caller="a", model="m", state="warm") == 1


def test_a_new_rejection_reason_is_held_too():
    clock = Clock()
    state = signals_state(Config(usage_new_series_hold=30.0), clock)
    state.usage.reject("http", "negative")
    assert value(scrape(state), "vllm_cache_usage_events_rejected_total", reader="http",
                 reason="negative") == 0
    clock.now += 30
    assert value(scrape(state), "vllm_cache_usage_events_rejected_total", reader="http",
                 reason="negative") == 1


def test_without_a_hold_counts_show_at_once():
    state = signals_state(Config(usage_new_series_hold=0.0), Clock())
    state.usage.record(UsageEvent("a", "m", 1000, 0), "http")
    assert value(scrape(state), "vllm_cache_requests_total", caller="a", model="m",
                 state="cold") == 1


# --- carried engine counters ---------------------------------------------------------------

TARGET = "http://vllm:8000/metrics"
READS = st.lists(st.one_of(
    st.tuples(st.just("good"), st.integers(min_value=0, max_value=5_000)),
    st.tuples(st.just("nan"), st.just(0)),
    st.tuples(st.just("absent"), st.just(0)),
    st.tuples(st.just("down"), st.just(0)),
    st.tuples(st.just("restart"), st.integers(min_value=0, max_value=5_000)),
    st.tuples(st.just("lower"), st.integers(min_value=0, max_value=5_000)),
), max_size=40)


def snapshot(hits: float | None, created: float) -> EngineSnapshot:
    values = EngineValues("m", "0")
    if hits is not None and math.isfinite(hits):
        values.values[PREFIX_CACHE_HITS] = hits
        values.created[PREFIX_CACHE_HITS] = created
    return EngineSnapshot(engines={("m", "0"): values}, cache_configs={},
                          present={PREFIX_CACHE_HITS: hits is not None})


@settings(max_examples=300, deadline=None)
@given(reads=READS)
def test_an_exported_engine_counter_never_decreases_and_counts_every_hit(reads):
    """vLLM's own counter grows by the good reads' increments and restarts at 0 (with a new
    _created time); reads in between are NaN, absent, or fail. The exported total must
    never go down, and after each good read equal every hit vLLM counted since the first."""
    engine = EngineState((TARGET,))
    raw = 0.0
    created = 1000.0
    true_total = None  # what the exporter should show: everything since the first read
    exported: list[float] = []
    for kind, amount in reads:
        if kind == "lower":  # a restart of a vLLM without _created: only the drop tells
            if raw == 0:
                continue
            raw = float(min(amount, raw - 1))
            true_total = true_total + raw if true_total is not None else None
        elif kind == "restart":
            created += 1
            raw = float(amount)
            true_total = true_total + raw if true_total is not None else None
        elif kind == "good":
            raw += amount
            if true_total is not None:
                true_total += amount
        if kind in ("good", "restart", "lower"):
            engine.record_success(TARGET, snapshot(raw, created), 0.01, 0.0)
            if true_total is None:
                true_total = raw  # the first read: vLLM's lifetime count
            total = engine.targets[TARGET].rows[0].counters[PREFIX_CACHE_HITS]
            assert total == true_total
            exported.append(total)
        elif kind == "nan":
            engine.record_success(TARGET, snapshot(math.nan, created), 0.01, 0.0)
        elif kind == "absent":
            engine.record_success(TARGET, snapshot(None, created), 0.01, 0.0)
        else:
            engine.record_failure(TARGET, "connect", "refused", 0.01)
    assert exported == sorted(exported)
