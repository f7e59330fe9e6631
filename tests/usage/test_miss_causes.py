"""Why prompt tokens missed the cache: one cause for every uncached token, per caller and
model (``classify.miss``, ``vllm_cache_missed_prompt_tokens_total`` and
``vllm_cache_missed_requests_total``), adding up exactly to the hit ratio's counters."""

from __future__ import annotations

from array import array
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.engine.parse import parse
from exporter.metrics import build_registry
from exporter.metrics.exposition import OPENMETRICS, TEXT, encode_families, generate_text
from exporter.metrics.usage import UsageCollector
from exporter.signals.callers import OTHER
from exporter.signals.classify import (
    CACHING_OFF,
    CAUSES,
    ERROR,
    EVICTED,
    GRANULE,
    NEW,
    ORDER,
    STATES,
    UNKNOWN,
    UNREPORTED,
    miss,
)
from exporter.signals.usage import MISS_SERIES, RETIRE_SECONDS, SERIES_PER_CALLER
from exporter.values import PromptPrint, UsageEvent
from tests.helpers import fixture_text
from tests.usage.conftest import FakeClock, make_state, value

TARGET = "http://vllm:8000/metrics"
TOKENS = "vllm_cache_missed_prompt_tokens_total"
REQUESTS = "vllm_cache_missed_requests_total"


# ---- the pure function: the worked cases of docs/metrics.md ------------------------------


@pytest.mark.parametrize(
    ("previous", "prompt", "cached", "expected"),
    [
        # a first turn: what a 91k prompt could hold past its 86k cached is new
        (None, 91_070, 86_016, (958, 4_096, NEW)),
        # the warm follow-up: only its new tokens and the tail missed, nothing avoidable
        (88_000, 91_070, 86_016, (5_054, 0, GRANULE)),
        # the same turn with its previous one gone from the cache
        (88_000, 91_070, 0, (5_054, 86_016, EVICTED)),
        # a "next" turn shorter than the previous one: not a continuation, cannot tell
        (91_070, 60_000, 0, (608, 59_392, UNKNOWN)),
        # a prompt shorter than a granule: all of it is the unavoidable tail
        (None, 2_000, 0, (2_000, 0, GRANULE)),
        # ~94% cached is a full hit at G = 2,048: nothing avoidable
        (None, 91_070, 90_112, (958, 0, GRANULE)),
    ],
)
def test_worked_cases(previous, prompt, cached, expected):
    assert miss(prompt, cached, 2048, previous) == expected
    granule, avoidable, _cause = expected
    assert granule + avoidable == prompt - cached


def test_unreported_is_all_the_prompt():
    assert miss(3_000, None, 2048) == (0, 3_000, UNREPORTED)
    assert miss(3_000, None, 2048, 1_000, True, True, True) == (0, 3_000, UNREPORTED)


def test_the_causes_rank_caching_off_order_unknown_evicted_new():
    args = (10_000, 0, 16, 8_000)
    assert miss(*args, True, True, True)[2] == CACHING_OFF
    assert miss(*args, False, True, True)[2] == ORDER
    assert miss(*args, False, False, True)[2] == UNKNOWN
    assert miss(*args)[2] == EVICTED
    assert miss(10_000, 0, 16)[2] == NEW
    # nothing avoidable: the request is granule's whatever else holds
    assert miss(10_000, 9_984, 16, 8_000, True, True, True) == (16, 0, GRANULE)


def test_cached_beyond_the_bound_leaves_only_the_rest():
    """A count past what the previous turn could have left (turns another exporter saw, a
    shared system prompt): never a negative avoidable count."""
    assert miss(10_000, 9_000, 2048, 4_000) == (1_000, 0, GRANULE)
    assert miss(100, 100, 16) == (0, 0, GRANULE)


@given(
    prompt=st.integers(min_value=0, max_value=300_000),
    share=st.floats(min_value=0, max_value=1),
    granularity=st.integers(min_value=0, max_value=4096),
    previous=st.one_of(st.none(), st.integers(min_value=0, max_value=300_000)),
    flags=st.tuples(st.booleans(), st.booleans(), st.booleans()),
)
def test_the_parts_add_up_to_what_missed(prompt, share, granularity, previous, flags):
    cached = int(prompt * share)
    granule, avoidable, cause = miss(prompt, cached, granularity, previous, *flags)
    assert granule >= 0 and avoidable >= 0
    assert granule + avoidable == prompt - cached
    assert cause in CAUSES and (cause == GRANULE) == (avoidable == 0)


# ---- through the usage state -----------------------------------------------------------


def causes(state, caller: str, model: str = "m") -> tuple[dict[str, float], dict[str, float]]:
    registry = build_registry(state)
    labels = {"caller": caller, "model": model}
    return (
        {cause: value(registry, TOKENS, cause=cause, **labels) for cause in CAUSES},
        {cause: value(registry, REQUESTS, cause=cause, **labels) for cause in CAUSES},
    )


def nonzero(counts: dict[str, float]) -> dict[str, float]:
    return {cause: count for cause, count in counts.items() if count}


def test_a_conversation_new_then_granule_then_evicted():
    state = make_state(signals_granularity=16)
    for prompt, cached in ((100, 0), (200, 96), (300, 0)):
        state.usage.record(UsageEvent("a", "m", prompt, cached, session="s"), "http")
    tokens, requests = causes(state, "a")
    # 100: 96 new, 4 tail; 200: 104 tail; 300: 192 the previous turn left, 108 tail
    assert nonzero(tokens) == {NEW: 96, GRANULE: 216, EVICTED: 192}
    assert nonzero(requests) == {NEW: 1, GRANULE: 1, EVICTED: 1}
    # every cause is there from the first successful event, at 0
    text = generate_text(build_registry(state)).decode()
    assert text.count(f'{TOKENS}{{caller="a",') == len(CAUSES)


def test_without_a_session_the_previous_turn_is_not_its_own():
    state = make_state(signals_granularity=16)
    for prompt, cached in ((100, 0), (300, 0)):
        state.usage.record(UsageEvent("a", "m", prompt, cached), "http")
    tokens, requests = causes(state, "a")
    # the bound still reads the caller's previous request, as the classifier does (a wrong
    # one can only lower it), but the cause cannot be told
    assert nonzero(tokens) == {UNKNOWN: 96 + 96, GRANULE: 4 + 204}
    assert nonzero(requests) == {UNKNOWN: 2}


def test_a_conversation_the_bound_dropped_is_unknown():
    state = make_state(signals_granularity=16, signals_conversations_max=1)
    usage = state.usage
    usage.record(UsageEvent("a", "m", 100, 0, session="s1"), "http")
    usage.record(UsageEvent("a", "m", 100, 0, session="s2"), "http")  # drops s1
    usage.record(UsageEvent("a", "m", 300, 0, session="s1"), "http")  # recalled
    tokens, requests = causes(state, "a")
    assert tokens[UNKNOWN] == 288 and requests[UNKNOWN] == 1
    assert tokens[NEW] == 2 * 96 and requests[NEW] == 2


def test_turns_another_exporter_saw_are_unknown():
    """A first turn here that finds more cached than any conversation seen could explain."""
    state = make_state(signals_granularity=16)
    state.usage.record(UsageEvent("a", "m", 10_000, 8_000, session="s"), "http")
    tokens, requests = causes(state, "a")
    assert state.usage.conversations.unseen_history == {"m": 1}
    assert nonzero(requests) == {UNKNOWN: 1}
    assert tokens[UNKNOWN] == 9_984 - 8_000


def test_errors_count_nowhere_and_unreported_counts_whole():
    state = make_state(signals_granularity=16, signals_missing_cached_as_zero=False)
    usage = state.usage
    usage.record(UsageEvent("a", "m", 500, None, status=500), "http")
    usage.record(UsageEvent("a", "m", 500, None, session="s"), "http")
    tokens, requests = causes(state, "a")
    assert nonzero(tokens) == {UNREPORTED: 500}
    assert nonzero(requests) == {UNREPORTED: 1}


def test_caching_off_on_the_engine_serving_the_model():
    text = fixture_text("vllm-0.32.0-cpu/metrics_after.prom")
    assert 'enable_prefix_caching="True"' in text
    state = make_state(vllm_url=(TARGET,), signals_granularity=32)
    off = text.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"')
    state.engine.record_success(TARGET, parse(off), 0.01, 1.0)
    for prompt in (1_000, 2_000):
        state.usage.record(UsageEvent("a", "tiny-llama", prompt, 0, session="s"), "http")
    tokens, requests = causes(state, "a", "tiny-llama")
    assert nonzero(requests) == {CACHING_OFF: 2}
    assert tokens[CACHING_OFF] == 992 + 992
    # the same traffic with caching on: a first turn, then an eviction
    state = make_state(vllm_url=(TARGET,), signals_granularity=32)
    state.engine.record_success(TARGET, parse(text), 0.01, 1.0)
    for prompt in (1_000, 2_000):
        state.usage.record(UsageEvent("a", "tiny-llama", prompt, 0, session="s"), "http")
    assert nonzero(causes(state, "a", "tiny-llama")[1]) == {NEW: 1, EVICTED: 1}


ENDS = array("I", range(100, 6_500, 100))


def prompt_print(top: int) -> PromptPrint:
    """64 blocks of 100 bytes: a varying first one, then the same 63."""
    return PromptPrint(array("Q", [top, *range(10, 73)]), ENDS, 6_400)


def test_order_when_the_tap_found_a_variable_top_before_recording():
    """The tap hands the prompt's print just before the event (Tap.record): a request
    sharing its text behind a varying top has its avoidable miss counted as order."""
    state = make_state(signals_granularity=16)
    usage = state.usage
    for index in range(3):
        event = UsageEvent("a", "m", 1_000, 0, session=f"s{index}")
        usage.record_prompt(event, prompt_print(index))
        usage.record(event, "tap")
    tokens, requests = causes(state, "a")
    assert nonzero(requests) == {NEW: 1, ORDER: 2}  # the first had nothing to compare with
    assert tokens[ORDER] == 2 * 992
    registry = build_registry(state)
    labels = {"caller": "a", "model": "m"}
    assert value(registry, "vllm_cache_prompt_order_variable_top_total", **labels) == 2
    # the flag is the event's, never a later one's
    usage.record(UsageEvent("a", "m", 1_000, 0, session="s9"), "tap")
    assert causes(state, "a")[1][NEW] == 2


def test_a_non_detailed_callers_causes_are_other_s():
    state = make_state(signals_granularity=16, callers_detailed=1)
    usage = state.usage
    usage.record(UsageEvent("a", "m", 100, 0, session="s"), "http")
    usage.record(UsageEvent("zz-not-detailed", "m", 300, 0, session="s"), "http")
    detailed = usage.detailed.members
    (other_caller,) = [caller for caller in ("a", "zz-not-detailed") if caller not in detailed]
    assert usage.series[(other_caller, "m")].miss is None
    assert usage.series[(OTHER, "m")].miss is not None
    assert sum(causes(state, OTHER)[1].values()) == 1


@pytest.mark.new_series_hold
def test_held_at_zero_then_shown():
    clock = FakeClock()
    state = make_state(clock, signals_granularity=16, usage_new_series_hold=60.0)
    state.usage.record(UsageEvent("a", "m", 100, 0, session="s"), "http")
    tokens, requests = causes(state, "a")
    assert set(tokens.values()) == {0} and set(requests.values()) == {0}
    text = generate_text(build_registry(state)).decode()
    assert text.count(f'{REQUESTS}{{caller="a",') == len(CAUSES)
    collector = UsageCollector(state.usage)
    for moment in (0, 61):  # held, then shown: the fast render agrees with the reference
        clock.now += moment
        fast: list[str] = []
        collector.render_text(fast)
        reference: list[str] = []
        encode_families(collector.collect(), reference, TEXT)
        assert "".join(fast) == "".join(reference)
    assert nonzero(causes(state, "a")[1]) == {NEW: 1}


def test_charged_once_and_refunded_when_the_caller_leaves_the_detailed_set():
    clock = FakeClock()
    state = make_state(clock, signals_granularity=16, callers_detailed=1)
    usage = state.usage
    usage.record(UsageEvent("b", "m", 100, 0), "http")
    assert usage.exposed == SERIES_PER_CALLER + MISS_SERIES
    usage.record(UsageEvent("b", "m", 100, 0), "http")
    assert usage.exposed == SERIES_PER_CALLER + MISS_SERIES
    usage.record(UsageEvent("a", "m", 100, 0), "http")  # ranks first: b is no longer detailed
    assert "a" in usage.detailed.members and "b" not in usage.detailed.members
    clock.now += RETIRE_SECONDS + 1
    usage.record(UsageEvent("a", "m", 100, 0), "http")
    assert usage.series[("b", "m")].miss is None
    assert usage.exposed == sum(series.charged for series in usage.series.values())
    assert usage.exposed == 2 * SERIES_PER_CALLER + MISS_SERIES  # a's only, b's refunded


# ---- the identities, whatever arrives ----------------------------------------------------

CALLERS = ["alpha", "beta", "gamma", "delta"]
MODELS = ["qwen", "llama"]


@st.composite
def an_event(draw: st.DrawFn) -> UsageEvent:
    prompt = draw(st.integers(min_value=1, max_value=20_000))
    cached = draw(
        st.one_of(
            st.none(),
            st.integers(min_value=0, max_value=prompt),  # partial, lying, anything
            st.integers(min_value=0, max_value=prompt // 64).map(lambda k: k * 64),
            st.just(0),
        )
    )
    return UsageEvent(
        draw(st.sampled_from(CALLERS)),
        draw(st.sampled_from(MODELS)),
        prompt,
        cached,
        session=draw(st.sampled_from([None, "s1", "s2", "s3", "s4"])),
        status=draw(st.sampled_from([None, None, None, 200, 500])),
        sequences=draw(st.sampled_from([None, None, None, 1, 2])),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=st.lists(an_event(), max_size=60),
    granularity=st.sampled_from([0, 1, 16, 64, 2048]),
    detailed=st.sampled_from([1, 2, 100]),
    max_series=st.sampled_from([30, 60, 10_000]),
    conversations=st.sampled_from([1, 2, 100]),
    missing_as_zero=st.booleans(),
    prints=st.lists(st.integers(min_value=0, max_value=3), max_size=60),
)
def test_the_causes_add_up_to_the_hit_ratio_counters(
    events, granularity, detailed, max_series, conversations, missing_as_zero, prints
):
    """Summed over causes, missed tokens are prompt - cached + unreported and missed requests
    the successful ones: per model over its callers (__other__ holds the causes of callers
    outside the detailed set and of pairs past the budget), and per pair when every caller
    is detailed and the budget holds them all."""
    state = make_state(
        signals_granularity=granularity,
        callers_detailed=detailed,
        callers_max_series=max_series,
        signals_conversations_max=conversations,
        signals_missing_cached_as_zero=missing_as_zero,
    )
    usage = state.usage
    for index, event in enumerate(events):
        if index < len(prints) and (event.status is None or event.status == 200):
            usage.record_prompt(event, prompt_print(prints[index]))  # the tap's order
        usage.record(event, "tap" if index < len(prints) else "http")
    registry = build_registry(state)
    text = generate_text(registry).decode()
    missed: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for caller, model in usage.series:
        labels = {"caller": caller, "model": model}
        for cause in CAUSES:
            missed[(caller, model)][0] += value(registry, TOKENS, cause=cause, **labels)
            missed[(caller, model)][1] += value(registry, REQUESTS, cause=cause, **labels)
    # every cause of every pair that has them, none of a pair that has not
    with_causes = sum(series.miss is not None for series in usage.series.values())
    assert text.count(f"\n{TOKENS}{{") == len(CAUSES) * with_causes
    expected: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for caller, model in usage.series:
        labels = {"caller": caller, "model": model}
        tokens = (
            value(registry, "vllm_cache_prompt_tokens_total", **labels)
            - value(registry, "vllm_cache_cached_tokens_total", **labels)
            + value(registry, "vllm_cache_unreported_prompt_tokens_total", **labels)
        )
        successes = sum(
            value(registry, "vllm_cache_requests_total", state=state_name, **labels)
            for state_name in STATES
            if state_name != ERROR
        )
        expected[(caller, model)][0] += tokens
        expected[(caller, model)][1] += successes
    by_model_missed: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    by_model_expected: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for (_caller, model), (tokens, requests) in missed.items():
        by_model_missed[model][0] += tokens
        by_model_missed[model][1] += requests
    for (_caller, model), (tokens, requests) in expected.items():
        by_model_expected[model][0] += tokens
        by_model_expected[model][1] += requests
    assert by_model_missed == by_model_expected
    everyone_own = detailed >= len(CALLERS) and usage.series_folded == 0
    if everyone_own:
        assert {pair: counts for pair, counts in missed.items() if any(counts)} == {
            pair: counts for pair, counts in expected.items() if any(counts)
        }
    # what the budget charged is what is exposed
    assert usage.exposed == sum(series.charged for series in usage.series.values())
    # the fast render (reused lines, in slices) writes what client_python's encoder does
    collector = UsageCollector(usage)
    for fmt in (TEXT, OPENMETRICS, TEXT):  # the second text render reuses lines
        fast: list[str] = []
        for _ in collector.render_slices(fast, fmt, series_per_slice=1):
            pass
        reference: list[str] = []
        encode_families(collector.collect(), reference, fmt)
        assert "".join(fast) == "".join(reference)
