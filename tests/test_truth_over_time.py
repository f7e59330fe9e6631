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
from exporter.values import (
    KV_BLOCK_LIFETIME,
    PREFIX_CACHE_HITS,
    EngineSnapshot,
    EngineValues,
    HistogramValue,
    UsageEvent,
)
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
    assert value(text, "vllm_cache_ttft_seconds_count", caller="a", model="m", state="cold") == 1
    assert (
        value(text, "vllm_cache_ttft_seconds_count", caller="a", model="m", state="warm") == 0
    )  # a new histogram series, still at zero
    assert value(text, "vllm_cache_requests_total", caller="a", model="m", state="warm") == 1


def test_a_new_rejection_reason_is_held_too():
    clock = Clock()
    state = signals_state(Config(usage_new_series_hold=30.0), clock)
    state.usage.reject("http", "negative")
    assert (
        value(
            scrape(state),
            "vllm_cache_usage_events_rejected_total",
            reader="http",
            reason="negative",
        )
        == 0
    )
    clock.now += 30
    assert (
        value(
            scrape(state),
            "vllm_cache_usage_events_rejected_total",
            reader="http",
            reason="negative",
        )
        == 1
    )


def test_without_a_hold_counts_show_at_once():
    state = signals_state(Config(usage_new_series_hold=0.0), Clock())
    state.usage.record(UsageEvent("a", "m", 1000, 0), "http")
    assert (
        value(scrape(state), "vllm_cache_requests_total", caller="a", model="m", state="cold") == 1
    )


# --- carried engine counters ---------------------------------------------------------------

TARGET = "http://vllm:8000/metrics"
READS = st.lists(
    st.one_of(
        st.tuples(st.just("good"), st.integers(min_value=0, max_value=5_000)),
        st.tuples(st.just("nan"), st.just(0)),
        st.tuples(st.just("absent"), st.just(0)),
        st.tuples(st.just("down"), st.just(0)),
        st.tuples(st.just("restart"), st.integers(min_value=0, max_value=5_000)),
        st.tuples(st.just("lower"), st.integers(min_value=0, max_value=5_000)),
    ),
    max_size=40,
)


def snapshot(hits: float | None, created: float | None) -> EngineSnapshot:
    values = EngineValues("m", "0")
    if hits is not None and math.isfinite(hits):
        values.values[PREFIX_CACHE_HITS] = hits
        if created is not None:
            values.created[PREFIX_CACHE_HITS] = created
    return EngineSnapshot(
        engines={("m", "0"): values},
        cache_configs={},
        present={PREFIX_CACHE_HITS: hits is not None},
    )


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
            # A vLLM without _created tells its restart by the drop alone; one with it
            # gives a newer time (a drop under the same time is a glitch, tests/test_fuzz.py).
            engine.record_success(
                TARGET, snapshot(raw, None if kind == "lower" else created), 0.01, 0.0
            )
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


# --- carried engine histograms --------------------------------------------------------------

BOUND_SETS = ((1.0, 10.0, math.inf), (0.5, 10.0, 50.0, math.inf), (2.0, math.inf))
HISTOGRAM_READS = st.lists(
    st.one_of(
        # observations to add: (bucket index per observation)
        st.tuples(st.just("observe"), st.lists(st.integers(min_value=0, max_value=3), max_size=8)),
        st.tuples(st.just("restart"), st.integers(min_value=0, max_value=len(BOUND_SETS) - 1)),
        st.tuples(st.just("absent"), st.just(0)),
        st.tuples(st.just("down"), st.just(0)),
    ),
    max_size=30,
)


class VllmHistogram:
    """What a vLLM histogram holds: per-bucket observations since its (re)start."""

    def __init__(self, bounds: tuple[float, ...], created: float) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = created

    def observe(self, index: int) -> None:
        index = min(index, len(self.bounds) - 1)
        self.counts[index] += 1
        self.sum += self.bounds[index] if math.isfinite(self.bounds[index]) else 100.0

    def value(self) -> HistogramValue:
        cumulative = tuple(float(sum(self.counts[: i + 1])) for i in range(len(self.bounds)))
        return HistogramValue(self.bounds, cumulative, self.sum)


def histogram_snapshot(histogram: VllmHistogram | None) -> EngineSnapshot:
    values = EngineValues("m", "0")
    if histogram is not None:
        values.histograms[KV_BLOCK_LIFETIME] = histogram.value()
        values.created[KV_BLOCK_LIFETIME] = histogram.created
    return EngineSnapshot(
        engines={("m", "0"): values},
        cache_configs={},
        present={KV_BLOCK_LIFETIME: histogram is not None},
    )


@settings(max_examples=300, deadline=None)
@given(reads=HISTOGRAM_READS)
def test_an_exported_engine_histogram_never_decreases_and_stays_a_histogram(reads):
    """vLLM's histogram grows, restarts empty (maybe with other bounds, as
    --custom-histogram-buckets allows), is absent or unreadable in between. Every exported
    bucket of a bound, the sum and the count never go down; the buckets grow with the bound;
    the count is the +Inf bucket and counts every observation since the first read."""
    engine = EngineState((TARGET,))
    vllm = VllmHistogram(BOUND_SETS[0], 1000.0)
    seen: dict[float, float] = {}  # bound -> last exported bucket
    last_sum = last_count = 0.0
    observed_since_first = None
    for kind, argument in reads:
        if kind == "observe":
            for index in argument:
                vllm.observe(index)
            if observed_since_first is not None:
                observed_since_first += len(argument)
        elif kind == "restart":
            vllm = VllmHistogram(BOUND_SETS[argument], vllm.created + 1)
        if kind == "down":
            engine.record_failure(TARGET, "connect", "refused", 0.01)
            continue
        engine.record_success(
            TARGET, histogram_snapshot(None if kind == "absent" else vllm), 0.01, 0.0
        )
        if kind == "absent":
            continue
        if observed_since_first is None:
            observed_since_first = sum(vllm.counts)
        shown = engine.targets[TARGET].rows[0].histograms[KV_BLOCK_LIFETIME]
        assert shown.bounds == vllm.bounds
        assert list(shown.cumulative) == sorted(shown.cumulative)
        assert shown.count == observed_since_first
        assert shown.sum >= last_sum and shown.count >= last_count
        for bound, bucket in zip(shown.bounds, shown.cumulative, strict=True):
            assert bucket >= seen.get(bound, 0.0), (bound, bucket, seen)
            seen[bound] = bucket
        last_sum, last_count = shown.sum, shown.count
