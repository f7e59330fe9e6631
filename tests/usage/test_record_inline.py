"""Property: recording takes the steps of ``classify``, the learner and the conversation
tracker inline, and must give exactly what those give.

``UsageState.record_rows`` runs once per event, so it does not call ``classify``,
``GranularityLearner.observe`` (its common case) or ``ConversationTracker.observe``: it takes
their steps itself. These functions stay the definition: here each event's state is
``classify``'s, and a learner and a tracker fed the same events through their own methods
end equal to the state's, on streams that make the learner adopt, doubt and re-learn a
granule, and that overflow a small conversation bound (a forgotten conversation's next turn
is classified without its previous turn: the tracker is the classifier's memory).
"""

from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.signals.classify import classify
from exporter.signals.foresight import ConversationTracker
from exporter.signals.granularity import GranularityLearner
from exporter.usage.event import validate
from exporter.wiring import HTTP_READER
from tests.usage.conftest import FakeClock, make_state

CALLERS = ["alpha", "beta", "gamma"]
MODELS = ["qwen", "llama"]


@st.composite
def events(draw: st.DrawFn) -> dict:
    granule = draw(st.sampled_from([16, 2048, 2048, 2048, 48]))
    prompt = draw(st.integers(min_value=0, max_value=40 * 2048))
    event: dict = {"caller": draw(st.sampled_from(CALLERS)), "prompt_tokens": prompt,
                   "model": draw(st.sampled_from(MODELS))}
    if draw(st.integers(min_value=0, max_value=5)):
        event["cached_tokens"] = min(prompt, draw(st.integers(min_value=0, max_value=40))
                                     * granule)
    if draw(st.booleans()):
        event["session"] = draw(st.sampled_from(["s1", "s2", "s3"]))
    if draw(st.booleans()):
        event["completion_tokens"] = draw(st.integers(min_value=0, max_value=3_000))
    if draw(st.booleans()):
        event["time"] = draw(st.floats(min_value=1_799_999_000.0, max_value=1_800_001_000.0))
    if draw(st.integers(min_value=0, max_value=9)) == 0:
        event["status"] = 500
    return event


def samples_of(learner: GranularityLearner) -> dict:
    return {model: (list(samples.window), samples.gcd, samples.agreeing,
                    samples.since_full_gcd, samples.quick_left, samples.stray)
            for model, samples in learner.samples_by_model.items()}


def conversations_of(tracker: ConversationTracker) -> list:
    return [(key, c.model_name, c.model, c.prompt_tokens, c.context_tokens, c.last_seen)
            for key, c in tracker.by_key.items()]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=st.lists(st.tuples(events(), st.floats(min_value=0.0, max_value=900.0)),
                       min_size=1, max_size=300),
       conversations_max=st.integers(min_value=1, max_value=6),
       configured=st.sampled_from([0, 0, 16, 2048]),
       warm_tail=st.sampled_from([0.0, 1.0, 2.0]))
def test_recording_gives_what_the_functions_it_inlines_give(stream, conversations_max,
                                                             configured, warm_tail):
    clock = FakeClock()
    state = make_state(clock, signals_conversations_max=conversations_max,
                       signals_granularity=configured, signals_warm_tail_granules=warm_tail,
                       signals_missing_cached_as_zero=False)
    usage = state.usage
    learner = GranularityLearner()
    tracker = ConversationTracker(usage.conversations.settings)
    for event_fields, pause in stream:
        clock.now += pause
        event = validate(event_fields)
        key = (event.caller, event.model, event.session)
        got = usage.record(event, HTTP_READER)
        if event.status is not None:
            assert got == "error"
            continue
        cached = event.cached_tokens
        if cached:
            learner.observe(event.model, cached)
        granularity = configured or learner.learned(event.model) or 1
        if granularity == 1:
            granularity = learner.provisional(event.model)
        # The previous turn: the conversation's, while the bound keeps it.
        known = tracker.by_key.get(key)
        previous = known.prompt_tokens if known is not None else None
        assert got == classify(event.prompt_tokens, cached, granularity, previous, warm_tail)
        tracker.observe(event.caller, event.model, event.model, event.session,
                        event.prompt_tokens, event.prompt_tokens + (event.completion_tokens or 0),
                        clock.now if event.time is None else event.time, clock.now)
        assert samples_of(usage.learner) == samples_of(learner)
        assert usage.learner.learned_by_model == learner.learned_by_model
    assert conversations_of(usage.conversations) == conversations_of(tracker)
    assert usage.conversations.dropped_active == tracker.dropped_active
    assert usage.conversations.models == tracker.models


def test_the_learners_common_case_opens_and_closes_with_the_window():
    """``quick_left`` counts the samples that may skip the fold: none until the gcd has held
    for ``min_agreeing`` samples, and none once the window is about to turn over."""
    learner = GranularityLearner(window=8, min_agreeing=3)
    for _ in range(2):
        learner.observe("m", 2048)
        assert learner.samples_by_model["m"].quick_left == 0
    learner.observe("m", 4096)  # the third agreeing sample: 8 - 1 - 3 left in this window
    assert learner.samples_by_model["m"].quick_left == 4
    for left in (3, 2, 1, 0):
        learner.observe("m", 6144)
        assert learner.samples_by_model["m"].quick_left == left
    learner.observe("m", 2048)  # the window turned over: the gcd over it, folded in full
    samples = learner.samples_by_model["m"]
    assert samples.since_full_gcd == 0 and samples.window == deque(
        [2048, 2048, 4096, 6144, 6144, 6144, 6144, 2048], maxlen=8)
    assert samples.quick_left == 7 and learner.learned("m") == 2048
