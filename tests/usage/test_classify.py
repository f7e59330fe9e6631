"""The block-boundary-aware classification rule: the issue's cases, exactly."""

from __future__ import annotations

import pytest

from exporter.signals.classify import COLD, PARTIAL, SHORT, UNKNOWN, WARM, classify
from exporter.values import UsageEvent
from tests.usage.conftest import FakeClock, make_state, requests

ISSUE_CASES = [
    # (granularity, previous turn, prompt, cached, expected, why)
    (2048, None, 91_070, 86_016, WARM, "94.4% of a 90k hybrid prompt is a full hit"),
    (2048, 57_400, 60_000, 53_248, WARM, "88.7%: the field report's 90% bar called it a miss"),
    (2048, None, 3_000, 2_048, WARM, "one block is all a 3k prompt can reuse"),
    (32, None, 1_396, 1_376, WARM, "the real vLLM 0.32 CPU capture (02_chat_warm.json)"),
    (2048, None, 10_000, 0, COLD, "nothing reused where four blocks could be"),
    (16, None, 10_000, 5_008, PARTIAL, "half of what could be reused"),
]


@pytest.mark.parametrize(
    "granularity,previous,prompt,cached,expected,why",
    ISSUE_CASES,
    ids=[case[-1] for case in ISSUE_CASES],
)
def test_issue_cases(granularity, previous, prompt, cached, expected, why):
    assert classify(prompt, cached, granularity, previous) == expected, why


@pytest.mark.parametrize(
    "granularity,previous,prompt,cached,expected,why",
    ISSUE_CASES,
    ids=[case[-1] for case in ISSUE_CASES],
)
def test_issue_cases_through_the_state(granularity, previous, prompt, cached, expected, why):
    """The same cases end to end: configured G, and the previous turn taken from history."""
    state = make_state(signals_granularity=granularity)
    usage = state.usage
    if previous is not None:
        usage.record(UsageEvent("agent", "m", previous, 0, session="conv-1"), "http")
    assert (
        usage.record(UsageEvent("agent", "m", prompt, cached, session="conv-1"), "http") == expected
    ), why
    assert requests(state, "agent", expected, model="m") == 1 + (
        previous is not None and expected == COLD
    )


def test_without_the_previous_turn_the_88_percent_turn_is_partial():
    """The history is what makes case 2 warm: the last granule of a 60k prompt was not in the
    57.4k previous turn, so it could not have been cached."""
    assert classify(60_000, 53_248, 2048) == PARTIAL
    assert classify(60_000, 53_248, 2048, previous_prompt_tokens=57_400) == WARM


def test_short_prompts_are_their_own_outcome_not_a_cache_failure():
    assert classify(1_000, 0, 2048) == SHORT  # cannot hold one granule
    assert classify(2_048, 0, 2048) == SHORT  # the last token is never cached: 2,047 fit
    assert classify(2_049, 0, 2048) == COLD  # one whole granule could have been reused
    assert classify(1, 0, 1) == SHORT
    assert classify(0, 0, 16) == SHORT
    # A previous turn too short to hold a granule bounds this one to nothing reusable...
    assert classify(50_000, 0, 2048, previous_prompt_tokens=1_000) == SHORT
    # ...unless something was cached anyway: never classify below what was actually cached.
    assert classify(50_000, 40_960, 2048, previous_prompt_tokens=1_000) == WARM


def test_unknown_when_not_reported():
    assert classify(10_000, None, 16) == UNKNOWN
    assert classify(10, None, 16) == SHORT  # too short to matter either way


def test_history_only_applies_when_this_turn_extends_the_previous_one():
    # A retry of the same prompt (p == n) or a new, shorter conversation (p > n): no bound.
    assert classify(10_000, 2_048, 2048, previous_prompt_tokens=10_000) == PARTIAL
    assert classify(10_000, 2_048, 2048, previous_prompt_tokens=90_000) == PARTIAL
    assert classify(10_000, 2_048, 2048, previous_prompt_tokens=6_200) == WARM


def test_warm_tail_is_configurable():
    # 94.4% at G=2048 is warm with the default K=2, partial when the tail allowed is 1 granule.
    assert classify(91_070, 86_016, 2048, warm_tail_granules=1) == PARTIAL
    assert classify(91_070, 88_064, 2048, warm_tail_granules=1) == WARM
    state = make_state(signals_granularity=2048, signals_warm_tail_granules=1.0)
    assert state.usage.record(UsageEvent("a", "", 91_070, 86_016), "http") == PARTIAL


def test_history_is_per_session_when_given_else_per_caller_and_model():
    state = make_state(signals_granularity=2048)
    usage = state.usage
    usage.record(UsageEvent("agent", "m", 57_400, 0, session="a"), "http")
    usage.record(UsageEvent("agent", "m", 5_000, 0, session="b"), "http")
    # Session "a" is the previous turn of this one, whatever session "b" did in between.
    assert usage.record(UsageEvent("agent", "m", 60_000, 53_248, session="a"), "http") == WARM
    # Without sessions, the caller's last event on that model is the previous turn.
    usage.record(UsageEvent("solo", "m", 57_400, 0), "http")
    usage.record(UsageEvent("solo", "other-model", 5_000, 0), "http")
    assert usage.record(UsageEvent("solo", "m", 60_000, 53_248), "http") == WARM
    usage.record(UsageEvent("solo2", "m", 57_400, 0), "http")
    usage.record(UsageEvent("solo2", "m", 20_000, 0), "http")  # now the previous turn is 20k
    assert usage.record(UsageEvent("solo2", "m", 60_000, 53_248), "http") == WARM


@pytest.mark.parametrize(
    "idle,expected",
    [(0.0, UNKNOWN), (601.0, PARTIAL)],
    ids=["dropped while recent: unknown", "dropped once idle: judged as a first turn"],
)
def test_history_is_bounded_by_the_conversations_kept(idle, expected):
    """The previous turns the classifier remembers are the conversations'
    (--signals.conversations-max), least recently seen forgotten first. A conversation
    dropped within the idle window is remembered as dropped: its next turn cannot be judged
    (``unknown``), where judging it as a first turn would read this warm one as partial."""
    clock = FakeClock()
    state = make_state(clock, signals_granularity=2048, signals_conversations_max=100)
    usage = state.usage
    usage.record(UsageEvent("first", "m", 57_400, 0), "http")
    clock.now += idle
    usage.record(UsageEvent("second", "m", 57_400, 0), "http")
    for index in range(98):
        usage.record(UsageEvent(f"c{index}", "m", 10_000, 0), "http")
    assert len(usage.conversations.by_key) == 100
    # "second" is seen again: now "first" is the least recently seen, and goes next.
    assert usage.record(UsageEvent("second", "m", 57_400, 0), "http") == COLD
    usage.record(UsageEvent("one-more", "m", 10_000, 0), "http")
    assert len(usage.conversations.by_key) == 100
    assert usage.record(UsageEvent("first", "m", 60_000, 53_248), "http") == expected
    # "second" is remembered: its previous turn (57,400) bounds what could be cached.
    assert usage.record(UsageEvent("second", "m", 60_000, 53_248), "http") == WARM


def test_errors_count_only_as_errors():
    state = make_state(signals_granularity=32)
    usage = state.usage
    assert (
        usage.record(
            UsageEvent("a", "m", 1_396, 1_376, ttft_seconds=1.0, queue_seconds=0.5, status=500),
            "http",
        )
        == "error"
    )
    assert usage.record(UsageEvent("a", "m", 0, status="failure"), "http") == "error"
    series = usage.series[("a", "m")]
    assert series.requests["error"] == 2
    assert sum(series.requests.values()) == 2
    assert series.prompt_tokens == series.cached_tokens == series.unreported_prompt_tokens == 0
    assert series.ttft == {} and series.queue is None
    assert usage.record(UsageEvent("a", "m", 1_396, 1_376, status=200), "http") == WARM
    assert usage.record(UsageEvent("a", "m", 1_396, 1_376, status="ok"), "http") == WARM
