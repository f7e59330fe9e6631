"""Property: recording a body's events together gives exactly the series that recording them
one at a time gives.

``POST /v1/usage`` hands the accepted events of a body to the signals a slice at a time
(``UsageState.record_events``), with one clock reading per slice. Classification depends on
order (a conversation's previous prompt, the granularity learner, the label caps, the series
budget), so the two paths are compared on streams that exercise all of it: several callers
and sessions, cached counts on 2,048-token granules mixed with others, failed requests,
invalid events, lines that are not JSON, slices cut anywhere, time passing between bodies.
"""

from __future__ import annotations

import asyncio
import json
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest

from exporter.config import Config
from exporter.metrics import build_registry
from exporter.signals.state import SignalsState
from exporter.signals.usage import SERIES_PER_PAIR
from exporter.usage import ingest
from exporter.usage.event import InvalidEvent, validate
from exporter.usage.formats import native
from exporter.usage.ingest import BodyError, Unreadable, iter_body
from exporter.wiring import HTTP_READER, usage_ingest
from tests.usage.conftest import FakeClock, make_state

CALLERS = ["alpha", "beta", "gamma", "delta"]
GRANULE = 2048


@st.composite
def events(draw: st.DrawFn, granule: int) -> dict:
    prompt = draw(st.integers(min_value=0, max_value=25)) * granule + draw(
        st.integers(min_value=0, max_value=granule - 1)
    )
    event: dict = {
        "caller": draw(st.sampled_from(CALLERS)),
        "prompt_tokens": prompt,
        "model": draw(st.sampled_from(["qwen"] * 4 + ["llama"])),
    }
    kind = draw(st.sampled_from(["granules"] * 12 + ["unreported", "odd"]))
    if kind == "granules":  # the common case: whole granules, which the learner converges on
        event["cached_tokens"] = (
            min(prompt // granule, draw(st.integers(min_value=1, max_value=20))) * granule
        )
    elif kind == "odd":  # on no granule: the learner must not adopt a tiny gcd
        event["cached_tokens"] = draw(st.integers(min_value=0, max_value=prompt))
    if draw(st.booleans()):
        event["session"] = draw(st.sampled_from(["s1", "s2"]))
    for key in ("ttft_seconds", "queue_seconds", "engine_ttft_seconds", "engine_queue_seconds"):
        if draw(st.integers(min_value=0, max_value=3)) == 0:
            event[key] = draw(st.floats(min_value=0, max_value=900, allow_nan=False))
    if draw(st.booleans()):
        event["completion_tokens"] = draw(st.integers(min_value=0, max_value=5_000))
        if draw(st.booleans()):
            event["max_tokens"] = draw(st.integers(min_value=0, max_value=8_000))
    if draw(st.booleans()):
        event["time"] = draw(st.floats(min_value=1_799_999_000.0, max_value=1_800_001_000.0))
    status = draw(st.sampled_from([None, None, None, None, 200, 500, 429, "failure", "success"]))
    if status is not None:
        event["status"] = status
    return event


INVALID_EVENTS = st.sampled_from(
    [
        {"caller": "alpha", "prompt_tokens": -3},
        {"caller": "alpha", "prompt_tokens": 10, "cached_tokens": 11},
        {"prompt_tokens": 10},
        {"caller": "beta", "prompt_tokens": "ten"},
        {"caller": "beta", "prompt_tokens": 10, "ttft_seconds": -1.0},
        ["not", "an", "object"],
    ]
).map(json.dumps)
BAD_LINES = st.sampled_from(["{", "not json", "NaN", '{"caller": "a"} trailing', "", "\udcff"])


@st.composite
def bodies(draw: st.DrawFn) -> list[tuple[list[str], float]]:
    """NDJSON bodies, each with the seconds that pass before it arrives."""
    granule = draw(st.sampled_from([16, 32, GRANULE]))
    good = events(granule).map(json.dumps)
    lines = st.one_of(good, good, good, good, good, good, INVALID_EVENTS, BAD_LINES)
    return draw(
        st.lists(
            st.tuples(
                st.lists(lines, min_size=5, max_size=60), st.floats(min_value=0.0, max_value=400.0)
            ),
            min_size=2,
            max_size=6,
        )
    )


def encoded(lines: list[str]) -> bytes:
    return "\n".join(lines).encode("utf-8", "surrogateescape")


def one_at_a_time(state: SignalsState, body: bytes) -> None:
    """The reference: each line decoded, checked and recorded before the next is read."""
    usage = state.usage
    try:
        items = list(iter_body(body))
    except BodyError as err:
        usage.reject_request(err.reason)
        return
    for value, _line in items:
        if type(value) is Unreadable:
            usage.reject(HTTP_READER, value.reason)
            continue
        try:
            event = validate(value)
        except InvalidEvent as err:
            usage.reject(HTTP_READER, err.reason)
            continue
        usage.record(event, HTTP_READER)


def batched(state: SignalsState, config: Config, body: bytes) -> ingest.BatchResult | None:
    """What ``POST /v1/usage`` does with the body: its ingest, as the server wires it."""
    reader = usage_ingest(config, state.usage)
    try:
        items = iter_body(body)
        first = next(items)
    except BodyError as err:
        state.usage.reject_request(err.reason)
        return None
    return asyncio.run(reader.process(iter([first, *items]), native))


def timelines(state: SignalsState) -> dict[str, list[list[float]]]:
    """The status page's history of each caller: its samples, as plain lists."""
    return {
        caller: [list(sample) for sample in timeline.samples]
        for caller, timeline in state.usage.history.callers.items()
    }


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bodies=bodies(),
    per_slice=st.integers(min_value=1, max_value=9),
    callers_max=st.integers(min_value=1, max_value=5),
    pairs_budget=st.integers(min_value=1, max_value=8),
    granularity=st.sampled_from([0, 0, 16, GRANULE]),
    missing_as_zero=st.booleans(),
)
def test_batched_recording_gives_the_series_of_one_at_a_time(
    bodies, per_slice, callers_max, pairs_budget, granularity, missing_as_zero
):
    overrides = {
        "callers_max": callers_max,
        "callers_max_series": pairs_budget * SERIES_PER_PAIR,
        "signals_granularity": granularity,
        "signals_missing_cached_as_zero": missing_as_zero,
    }
    reference_clock, batched_clock = FakeClock(), FakeClock()
    reference = make_state(reference_clock, **overrides)
    subject = make_state(batched_clock, **overrides)
    config = Config(**overrides)
    accepted = 0
    with mock.patch.object(ingest, "EVENTS_PER_SLICE", per_slice):
        for lines, wait in bodies:
            reference_clock.now += wait
            batched_clock.now += wait
            body = encoded(lines)
            one_at_a_time(reference, body)
            result = batched(subject, config, body)
            accepted += result.accepted if result is not None else 0

    assert generate_latest(build_registry(subject)).decode() == (
        generate_latest(build_registry(reference)).decode()
    )
    usage, expected = subject.usage, reference.usage
    assert usage.events == expected.events
    assert usage.events[HTTP_READER] == accepted
    assert usage.rejected == expected.rejected
    assert usage.ingest_requests_rejected == expected.ingest_requests_rejected
    assert usage.learner.learned_by_model == expected.learner.learned_by_model
    assert usage.caller_totals() == expected.caller_totals()
    assert usage.first_seen() == expected.first_seen()
    assert timelines(subject) == timelines(reference)
    now = reference_clock.now
    assert usage.conversations.by_model(now) == expected.conversations.by_model(now)
