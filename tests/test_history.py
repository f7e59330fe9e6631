"""The status page's hour of history: exact at every 30-second boundary although sampled
lazily, gaps read as "nothing changed", and bounded whatever the traffic (filled to its worst
case here, and measured)."""

from __future__ import annotations

import tracemalloc

import pytest

from exporter.signals.history import (
    BASELINE_SAMPLES,
    CALLER_FIELDS,
    FIELD,
    HOUR_SECONDS,
    SAMPLES,
    SLOT_SECONDS,
    History,
    Windows,
    at,
    quantile,
)
from exporter.signals.usage import UsageSettings, UsageState
from exporter.values import UsageEvent

T0 = 1_700_000_010.0  # 10 s past a 30-s boundary


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def event(caller: str, prompt: int, cached: int | None, session: str = "s") -> UsageEvent:
    return UsageEvent(
        caller=caller, model="m", prompt_tokens=prompt, cached_tokens=cached, session=session
    )


def usage(clock: Clock, **settings: object) -> UsageState:
    return UsageState(UsageSettings(granularity=16, **settings), clock=clock)  # type: ignore


def test_the_totals_at_each_boundary_are_exact_although_sampled_lazily():
    clock = Clock(T0)
    state = usage(clock)
    state.record(event("a", 1000, 0), "http")  # t0 + 0
    clock.now = T0 + 15
    state.record(event("a", 1100, 992), "http")  # same slot
    clock.now = T0 + 95  # three boundaries later: sampled here, before this event
    state.record(event("a", 1200, 1088), "http")
    timeline = state.history.caller(("a", "m"))
    assert timeline is not None
    current = [clock.now, *state.pair_totals()[("a", "m")]]
    prompt = FIELD["prompt_tokens"]
    first_boundary = T0 - 10 + 30
    # before the caller existed: zero; at the next boundary: both first events, and nothing
    # more until the third event (the gap reads as "no change")
    assert at(timeline, T0 - 1, current)[prompt] == 0
    for boundary in (first_boundary, first_boundary + 30, first_boundary + 60):
        assert at(timeline, boundary, current)[prompt] == 2100
    assert at(timeline, clock.now, current)[prompt] == 3300
    assert (
        at(timeline, clock.now, current)[prompt] - at(timeline, first_boundary, current)[prompt]
        == 1200
    )
    assert at(timeline, clock.now, current)[FIELD["cached_tokens"]] == 2080
    # follow-ups: the second and third turns of session "s" grew from the previous one
    assert current[FIELD["followups"]] == 2 and current[FIELD["followups_cold"]] == 0


def test_an_hour_is_kept_and_no_more():
    clock = Clock(T0)
    state = usage(clock)
    for minute in range(0, 150):
        clock.now = T0 + minute * 60
        state.record(event("a", 1000, 0, session=str(minute)), "http")
    timeline = state.history.caller(("a", "m"))
    assert timeline is not None
    assert len(timeline.samples) <= SAMPLES
    oldest = timeline.samples[0][0]
    assert clock.now - oldest <= HOUR_SECONDS + 2 * SLOT_SECONDS
    current = [clock.now, *state.pair_totals()[("a", "m")]]
    # the last hour's prompt tokens, to the slot: 60 events of 1000 (the one at the window's
    # edge falls in the slot counted)
    prompt = FIELD["prompt_tokens"]
    last_hour = (
        at(timeline, clock.now, current)[prompt]
        - at(timeline, clock.now - HOUR_SECONDS, current)[prompt]
    )
    assert 59_000 <= last_hour <= 61_000


def test_callers_beyond_the_bound_are_let_go_stalest_first():
    history = History(max_callers=3)
    width = len(CALLER_FIELDS) - 1
    for step, callers in enumerate((["a", "b", "c"], ["d"], ["b"], ["e"])):
        history.record(T0 + step * SLOT_SECONDS, {name: [1.0] * width for name in callers}, {}, {})
    assert list(history.callers) == ["d", "b", "e"]


def test_memory_at_the_worst_case_is_what_the_docs_say():
    """Every pair the default budget admits (168), each with a full hour of samples and a day
    of long-window ratios: about 38 KB a pair, 6.4 MB (docs/limits.md). Measured with
    tracemalloc."""
    width = len(CALLER_FIELDS) - 1
    pairs = 168
    tracemalloc.start()
    try:
        history = History(max_callers=pairs)
        # a day and a bit, in the steps the ratios are kept at (every 5 min), then the last
        # hour slot by slot: more than is ever kept of either
        times = [T0 + minute * 60 for minute in range(0, 25 * 60, 5)]
        times += [times[-1] + step * SLOT_SECONDS for step in range(1, SAMPLES + 40)]
        for step, when in enumerate(times):
            totals = {(f"caller-{index}", "m"): [float(step + 1)] * width for index in range(pairs)}
            history.record(when, totals, {}, {})
        used, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(len(timeline.samples) == SAMPLES for timeline in history.callers.values())
    assert all(
        BASELINE_SAMPLES <= len(timeline.baseline.times) <= BASELINE_SAMPLES + 1
        for timeline in history.callers.values()
    )
    assert len(history.callers) == pairs
    per_pair = used / pairs
    print(f"{per_pair:.0f} bytes per pair")
    assert 30_000 < per_pair < 42_000, per_pair  # "about 38 KB per pair"
    assert used < 7 * 1024 * 1024, used


def test_the_baseline_is_prometheus_quantile_over_time_of_the_long_window_ratio():
    """quantile_over_time's definition (rank q * (n - 1), linear between the closest ranks),
    over the long-window ratio at every baseline instant, gaps included: a quiet stretch
    inside the long window still has a ratio, as the recorded series has a sample."""
    assert quantile(0.9, [0.1, 0.2, 0.3, 0.4]) == pytest.approx(0.37)
    assert quantile(0.9, [0.5]) == 0.5
    assert quantile(0.9, []) is None
    windows = Windows(300.0, 3600.0, 86_400.0)
    history = History(max_callers=4, windows=windows)
    width = len(CALLER_FIELDS) - 1
    prompt, cached = FIELD["prompt_tokens"] - 1, FIELD["cached_tokens"] - 1

    def totals(prompt_tokens: float, cached_tokens: float) -> dict:
        row = [0.0] * width
        row[prompt], row[cached] = prompt_tokens, cached_tokens
        return {("a", "m"): row}

    start = 1_700_006_400.0  # a multiple of 5 min
    history.record(start, totals(1000, 900), {}, {("a", "m"): start - 1})
    # 50 minutes without a change, then an event (sampled before it, as UsageState does):
    # every 5-min instant of the gap had the first thousand tokens within its hour, 90% cached
    history.record(start + 3000, totals(1000, 900), {}, {})
    timeline = history.caller(("a", "m"))
    assert timeline is not None
    assert list(timeline.baseline.times) == [start + 300 * step for step in range(11)]
    assert list(timeline.baseline.values) == pytest.approx([0.9] * 11)
    # the event's thousand tokens, none cached: at the next instant the hour holds both
    history.record(start + 3300, totals(2000, 900), {}, {})
    assert timeline.baseline.values[-1] == pytest.approx(0.45)
    assert history.baseline(timeline, start + 3300, 0.9) == pytest.approx(0.9)
    # an hour after the first thousand tokens, the hour holds only the second: 0%
    history.record(start + 3900, totals(2000, 900), {}, {})
    assert timeline.baseline.values[-1] == pytest.approx(0.0)


def test_a_clock_gone_wrong_costs_nothing_and_breaks_nothing():
    """An infinite or NaN time never samples (nor rounds to a boundary), whatever comes."""
    for wrong in (float("inf"), float("-inf"), float("nan")):
        clock = Clock(wrong)
        state = usage(clock)
        for _ in range(3):
            state.record(event("a", 1000, 0), "http")
            state.catch_up(clock.now)
        assert state.history.callers == {}
        assert state.caller_totals()["a"][FIELD["prompt_tokens"] - 1] == 3000


def test_a_clock_far_out_ends_every_loop():
    """Times where adding a slot or a baseline interval changes nothing (1e20 s), or where a
    boundary rounds to infinity (the largest float), and a jump from now to there and back:
    each record returns, and the ratios kept stay within their bound."""
    for far in (1e20, 1.7976931348623157e308):
        clock = Clock(T0)
        state = usage(clock)
        for when in (T0, far, T0 + 60, far, T0 + 120):
            clock.now = when
            state.record(event("a", 1000, 500), "http")
            state.catch_up(clock.now)
        timeline = state.history.caller(("a", "m"))
        assert timeline is not None
        assert len(timeline.baseline.times) <= BASELINE_SAMPLES + 1
        assert state.caller_totals()["a"][FIELD["prompt_tokens"] - 1] == 5000


def test_a_model_s_timeline_is_bounded_and_keeps_no_ratios():
    """The models' timelines (computed prompt tokens and prefill seconds per model_name, for
    the prefill time saved and lost) keep the long window's samples and no baseline: about
    15 KB each (docs/limits.md)."""
    models = 10
    tracemalloc.start()
    try:
        history = History(max_callers=1)
        for step in range(SAMPLES + 40):
            history.record(
                T0 + step * SLOT_SECONDS,
                {},
                {},
                {},
                {f"model-{index}": [float(step), float(step)] for index in range(models)},
            )
        used, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(history.models) == models
    assert all(len(timeline.samples) == SAMPLES for timeline in history.models.values())
    assert all(not timeline.baseline.times for timeline in history.models.values())
    assert used / models < 18_000, used / models
