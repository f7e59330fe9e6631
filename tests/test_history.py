"""The status page's hour of history: exact at every 30-second boundary although sampled
lazily, gaps read as "nothing changed", and bounded whatever the traffic (filled to its worst
case here, and measured)."""

from __future__ import annotations

import tracemalloc

from exporter.signals.history import (
    CALLER_FIELDS,
    FIELD,
    HOUR_SECONDS,
    SAMPLES,
    SLOT_SECONDS,
    History,
    at,
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
    timeline = state.history.caller("a")
    assert timeline is not None
    current = [clock.now, *state.caller_totals()["a"]]
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
    timeline = state.history.caller("a")
    assert timeline is not None
    assert len(timeline.samples) <= SAMPLES
    oldest = timeline.samples[0][0]
    assert clock.now - oldest <= HOUR_SECONDS + 2 * SLOT_SECONDS
    current = [clock.now, *state.caller_totals()["a"]]
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


def test_memory_at_the_worst_case_is_what_the_readme_says():
    """Every caller the cap admits (100 + __other__), each with a full hour of samples: about
    3.5 MB (docs/limits.md). Measured with tracemalloc."""
    width = len(CALLER_FIELDS) - 1
    callers = {f"caller-{index}": [float(index)] * width for index in range(101)}
    tracemalloc.start()
    try:
        history = History(max_callers=101)
        for step in range(SAMPLES + 40):  # more slots than are ever kept
            history.record(T0 + step * SLOT_SECONDS, callers, {}, {})
        used, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(len(timeline.samples) == SAMPLES for timeline in history.callers.values())
    assert len(history.callers) == 101
    assert used < 4 * 1024 * 1024, used
    per_caller = used / 101
    assert 28_000 < per_caller < 40_000, per_caller  # "about 35 KB per caller"


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
