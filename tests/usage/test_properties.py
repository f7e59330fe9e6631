"""Property: whatever valid (and invalid) events arrive, the counters are their exact sums."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.metrics import build_registry
from exporter.signals.callers import OTHER, rank
from exporter.signals.classify import STATES
from exporter.usage import ingest
from exporter.usage.event import InvalidEvent, validate
from exporter.usage.ingest import iter_body
from exporter.values import status_is_error
from tests.usage.conftest import make_state, value

CALLERS = ["alpha", "beta", "gamma", "delta", "epsilon"]
MODELS = ["qwen", "llama"]


@st.composite
def events(draw: st.DrawFn) -> dict:
    prompt = draw(st.integers(min_value=0, max_value=200_000))
    event: dict = {"caller": draw(st.sampled_from(CALLERS)), "prompt_tokens": prompt}
    if draw(st.booleans()):
        event["model"] = draw(st.sampled_from(MODELS))
    cached = draw(
        st.one_of(
            st.none(),
            st.integers(min_value=0, max_value=prompt),
            st.integers(min_value=0, max_value=prompt // 2048).map(lambda k: k * 2048),
        )
    )
    if cached is not None:
        event["cached_tokens"] = cached
    for key in ("ttft_seconds", "queue_seconds", "engine_ttft_seconds", "engine_queue_seconds"):
        if draw(st.booleans()):
            event[key] = draw(st.floats(min_value=0, max_value=900, allow_nan=False))
    if draw(st.booleans()):
        event["session"] = draw(st.sampled_from(["s1", "s2", "s3"]))
    status = draw(st.sampled_from([None, None, None, 200, 500, 429, "failure", "success"]))
    if status is not None:
        event["status"] = status
    return event


invalid = st.sampled_from(
    [
        {"caller": "alpha", "prompt_tokens": -3},
        {"caller": "alpha", "prompt_tokens": 10, "cached_tokens": 11},
        {"prompt_tokens": 10},
        {"caller": "alpha\x00", "prompt_tokens": 10},
        {"caller": "alpha", "prompt_tokens": "ten"},
        ["not", "an", "object"],
    ]
)

stream = st.lists(st.one_of(events(), events(), events(), invalid), max_size=60)


def expected_sums(objs: list, callers_max: int, missing_as_zero: bool) -> dict:
    """The counters, computed the slow and obvious way from the accepted events."""
    out: dict = defaultdict(Counter)
    admitted: list[str] = []
    reported: set[tuple[str, str]] = set()
    for obj in objs:
        try:
            event = validate(obj)
        except InvalidEvent:
            out["rejected"]["all"] += 1
            continue
        caller = event.caller
        # Admitted by rank: the callers_max of smallest hash so far; a caller evicted by one
        # of smaller rank keeps what it counted, and its later events go to __other__.
        if caller not in admitted and len(admitted) < callers_max:
            admitted.append(caller)
        elif caller not in admitted and rank(caller) < max(map(rank, admitted)):
            admitted.remove(max(admitted, key=rank))
            admitted.append(caller)
        if caller not in admitted:
            caller = OTHER
            out["overflowed"]["all"] += 1
        pair = (caller, event.model)
        out["requests"][pair] += 1
        if status_is_error(event.status):
            out["errors"][pair] += 1
            continue
        cached = event.cached_tokens
        if cached is None and missing_as_zero and pair in reported:
            cached = 0
        if event.cached_tokens is not None:
            reported.add(pair)
        if cached is None:
            out["unreported"][pair] += event.prompt_tokens
        else:
            out["prompt"][pair] += event.prompt_tokens
            out["cached"][pair] += cached
        # One TTFT per request: vLLM's own when it sent one, else the proxy's. A proxy
        # wait over 10 ms longer than the proxy TTFT it is part of leaves both out.
        proxy_ttft, proxy_wait = event.ttft_seconds, event.queue_seconds
        if proxy_ttft is not None and proxy_wait is not None and proxy_wait > proxy_ttft + 0.01:
            proxy_ttft = proxy_wait = None
        if event.engine_ttft_seconds is not None:
            out["ttft_count", "engine"][pair] += 1
        elif proxy_ttft is not None:
            out["ttft_count", "proxy"][pair] += 1
        for source, wait in (("proxy", proxy_wait), ("engine", event.engine_queue_seconds)):
            if wait is not None:
                out["queue_count", source][pair] += 1
                out["queue_sum", source][pair] += wait
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    objs=stream,
    callers_max=st.integers(min_value=1, max_value=6),
    missing_as_zero=st.booleans(),
    granularity=st.sampled_from([0, 16, 2048]),
)
def test_counters_equal_the_sums_of_accepted_events(
    objs, callers_max, missing_as_zero, granularity
):
    state = make_state(
        callers_max=callers_max,
        signals_missing_cached_as_zero=missing_as_zero,
        signals_granularity=granularity,
    )
    usage = state.usage
    for obj in objs:
        try:
            event = validate(obj)
        except InvalidEvent as err:
            usage.reject("http", err.reason)
            continue
        assert usage.record(event, "http") in STATES

    expected = expected_sums(objs, callers_max, missing_as_zero)
    registry = build_registry(state)
    pairs = set(expected["requests"])
    assert set(usage.series) == pairs
    for caller, model in pairs:
        labels = {"caller": caller, "model": model}
        by_state = {
            s: value(registry, "vllm_cache_requests_total", state=s, **labels) for s in STATES
        }
        assert sum(by_state.values()) == expected["requests"][(caller, model)]
        assert by_state["error"] == expected["errors"][(caller, model)]
        for name, key in (
            ("vllm_cache_prompt_tokens_total", "prompt"),
            ("vllm_cache_cached_tokens_total", "cached"),
            ("vllm_cache_unreported_prompt_tokens_total", "unreported"),
        ):
            assert value(registry, name, **labels) == expected[key][(caller, model)], name
        for source in ("engine", "proxy"):
            ttft_count = sum(
                value(registry, "vllm_cache_ttft_seconds_count", state=s, source=source, **labels)
                for s in STATES
            )
            assert ttft_count == expected["ttft_count", source][(caller, model)]
            assert (
                value(registry, "vllm_cache_queue_wait_seconds_count", source=source, **labels)
                == expected["queue_count", source][(caller, model)]
            )
            assert (
                abs(
                    value(registry, "vllm_cache_queue_wait_seconds_sum", source=source, **labels)
                    - expected["queue_sum", source][(caller, model)]
                )
                < 1e-6
            )
    accepted = sum(expected["requests"].values())
    assert value(registry, "vllm_cache_usage_events_total", reader="http") == accepted
    rejected = sum(v for (reader, _), v in usage.rejected.items())
    assert rejected == expected["rejected"]["all"]
    assert value(registry, "vllm_cache_callers_overflowed_total") == (expected["overflowed"]["all"])


@settings(max_examples=60, deadline=None)
@given(objs=st.lists(st.one_of(events(), invalid), max_size=30))
def test_ndjson_splitting_keeps_every_line_in_order(objs):
    """The fast NDJSON splitter yields exactly what per-line json.loads would."""
    lines = [json.dumps(obj) for obj in objs]
    body = "\n".join(lines).encode()
    if len(objs) < 2:
        return  # a single value is a JSON body, not NDJSON
    items = list(iter_body(body))
    assert [value for value, _line in items] == [json.loads(text) for text in lines]
    assert [line for _value, line in items] == list(range(1, len(lines) + 1))


JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.text(max_size=8),
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=8,
)
ODD_LINES = st.sampled_from(
    [
        "NaN",
        "-Infinity",
        '{"a": NaN}',
        '{"prompt_tokens": 1e400}',
        '"\\ud800"',
        '{"session": 123456789012345678901234567890}',
        "\ufeff{}",
        "  {}\t",
        "",
        "  ",
        "{",
        '{"a": 1}{"b": 2}',
        "[" * 1200 + "]" * 1200,
        '{"caller": "\\u00e9"}',
        "0.1e-5",
        "-0",
        "1" * 5000,
    ]
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            JSON_VALUES.map(json.dumps),
            ODD_LINES,
            st.binary(max_size=12).map(lambda b: b.decode("latin-1")),
        ),
        min_size=2,
        max_size=12,
    ),
    st.sampled_from(["\n", "\r\n"]),
)
def test_ndjson_lines_read_as_json_reads_them(lines, newline):
    """orjson decodes most lines; every line still reads exactly as ``json`` reads it (the
    same value, or the same reason): integers beyond 64 bits, NaN, lone surrogates, a BOM,
    invalid UTF-8, nesting past any limit."""
    # A first line that is one value makes the body NDJSON whatever follows.
    body = newline.join(['{"n": 0}', *lines]).encode("utf-8", "surrogatepass")
    items = list(iter_body(body))
    expected = []
    for number, line in enumerate(body.split(b"\n"), 1):
        item = ingest._decode_line(line, number)
        if item is not None:
            expected.append(item)
    assert [(describe(value), line) for value, line in items] == [
        (describe(value), line) for value, line in expected
    ]


def describe(value):
    """Comparable: the reason of an unreadable line, else the value with its types."""
    if isinstance(value, ingest.Unreadable):
        return ("unreadable", value.reason)
    return ("value", json.dumps(value), repr(value))
