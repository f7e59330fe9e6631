"""What the per-caller series say, from recorded events: tokens, TTFT, queue, readers."""

from __future__ import annotations

from prometheus_client import generate_latest

from exporter.metrics import build_registry
from exporter.signals.classify import COLD, UNKNOWN, WARM
from exporter.values import UsageEvent
from tests.usage.conftest import FakeClock, make_state, value


def test_hit_ratio_counts_only_events_that_reported_cached_tokens():
    state = make_state(signals_granularity=32, signals_missing_cached_as_zero=False)
    usage = state.usage
    usage.record(UsageEvent("a", "m", 1_395, 0), "http")
    usage.record(UsageEvent("a", "m", 1_396, 1_376), "http")
    usage.record(UsageEvent("a", "m", 5_000, None), "http")
    registry = build_registry(state)
    assert value(registry, "vllm_cache_prompt_tokens_total", caller="a", model="m") == 2_791
    assert value(registry, "vllm_cache_cached_tokens_total", caller="a", model="m") == 1_376
    assert (
        value(registry, "vllm_cache_unreported_prompt_tokens_total", caller="a", model="m") == 5_000
    )
    assert value(registry, "vllm_cache_requests_total", caller="a", model="m", state=UNKNOWN) == 1


def test_a_caller_that_never_reports_cached_tokens_is_unknown():
    """vLLM started without --enable-prompt-tokens-details: never a 0% hit ratio."""
    state = make_state(signals_granularity=32)
    for _ in range(3):
        assert state.usage.record(UsageEvent("a", "m", 5_000, None), "http") == UNKNOWN
    registry = build_registry(state)
    assert value(registry, "vllm_cache_prompt_tokens_total", caller="a", model="m") == 0
    assert (
        value(registry, "vllm_cache_unreported_prompt_tokens_total", caller="a", model="m")
        == 15_000
    )


def test_once_a_caller_reported_cached_tokens_a_missing_field_is_zero():
    """vLLM before 0.24 left the field out when it was 0."""
    state = make_state(signals_granularity=32)
    usage = state.usage
    assert usage.record(UsageEvent("a", "m", 1_396, 1_376), "http") == WARM
    assert usage.record(UsageEvent("a", "m", 5_000, None), "http") == COLD
    assert usage.record(UsageEvent("b", "m", 5_000, None), "http") == UNKNOWN  # per caller
    series = usage.series[("a", "m")]
    assert (series.prompt_tokens, series.cached_tokens, series.unreported_prompt_tokens) == (
        6_396,
        1_376,
        0,
    )


def test_a_request_for_several_sequences_is_not_judged_by_its_siblings_blocks():
    """n = 2: vLLM reports one sequence's cached count, which found the blocks the other had
    just written. Counted as not reported (whatever the caller reported before), classified
    unknown, and not learned from."""
    state = make_state()
    usage = state.usage
    assert usage.record(UsageEvent("a", "m", 1_396, 1_376), "tap") == WARM
    first_turn = UsageEvent("a", "m", 3_000, 2_976, session="new", sequences=2)
    assert usage.record(first_turn, "tap") == UNKNOWN
    registry = build_registry(state)
    assert value(registry, "vllm_cache_prompt_tokens_total", caller="a", model="m") == 1_396
    assert value(registry, "vllm_cache_cached_tokens_total", caller="a", model="m") == 1_376
    assert (
        value(registry, "vllm_cache_unreported_prompt_tokens_total", caller="a", model="m") == 3_000
    )
    assert list(usage.learner.samples_by_model["m"].window) == [1_376]  # 2,976 not learned
    # One sequence is an ordinary request.
    single = UsageEvent("a", "m", 3_000, 2_976, session="other", sequences=1)
    assert usage.record(single, "tap") != UNKNOWN
    assert (
        value(build_registry(state), "vllm_cache_cached_tokens_total", caller="a", model="m")
        == 1_376 + 2_976
    )


def test_missing_as_zero_can_be_turned_off():
    state = make_state(signals_granularity=32, signals_missing_cached_as_zero=False)
    state.usage.record(UsageEvent("a", "m", 1_396, 1_376), "http")
    assert state.usage.record(UsageEvent("a", "m", 5_000, None), "http") == UNKNOWN


def test_ttft_is_engine_side_by_state_and_queue_wait_is_its_own_histogram():
    state = make_state(signals_granularity=32)
    usage = state.usage
    usage.record(UsageEvent("a", "m", 1_395, 0, ttft_seconds=40.0, queue_seconds=35.0), "http")
    usage.record(UsageEvent("a", "m", 1_396, 1_376, ttft_seconds=0.3), "http")
    usage.record(
        UsageEvent("a", "m", 1_396, 1_376, ttft_seconds=0.2, queue_seconds=0.205), "http"
    )  # a wait 5 ms past the TTFT (two readings rounded): engine part 0
    registry = build_registry(state)
    cold = {"caller": "a", "model": "m", "state": COLD, "source": "proxy"}
    warm = {"caller": "a", "model": "m", "state": WARM, "source": "proxy"}
    assert value(registry, "vllm_cache_ttft_seconds_count", **cold) == 1
    assert value(registry, "vllm_cache_ttft_seconds_sum", **cold) == 5.0  # 40 - 35
    assert value(registry, "vllm_cache_ttft_seconds_bucket", le="2.5", **cold) == 0
    assert value(registry, "vllm_cache_ttft_seconds_bucket", le="5.0", **cold) == 1
    assert value(registry, "vllm_cache_ttft_seconds_bucket", le="0.05", **warm) == 1
    assert value(registry, "vllm_cache_ttft_seconds_bucket", le="0.5", **warm) == 2
    assert value(registry, "vllm_cache_ttft_seconds_bucket", le="600.0", **warm) == 2
    assert value(registry, "vllm_cache_ttft_seconds_bucket", le="+Inf", **warm) == 2
    proxy_queue = {"caller": "a", "model": "m", "source": "proxy"}
    assert value(registry, "vllm_cache_queue_wait_seconds_count", **proxy_queue) == 2
    assert value(registry, "vllm_cache_queue_wait_seconds_sum", **proxy_queue) == 35.205
    # No timed event in state "partial", nothing measured by vLLM: no series for them.
    assert (
        registry.get_sample_value("vllm_cache_ttft_seconds_count", {**warm, "state": "partial"})
        is None
    )
    assert (
        registry.get_sample_value("vllm_cache_ttft_seconds_count", {**warm, "source": "engine"})
        is None
    )
    assert (
        registry.get_sample_value(
            "vllm_cache_queue_wait_seconds_count", {**proxy_queue, "source": "engine"}
        )
        is None
    )


def test_vllms_own_timings_are_their_own_series_and_win_over_the_proxys():
    """vLLM's per-request metrics: its TTFT replaces the proxy's for that request (one
    observation per request, never both), nothing is subtracted from it, and its queue wait
    is a second queue beside the proxy's admission wait."""
    state = make_state(signals_granularity=32)
    usage = state.usage
    usage.record(
        UsageEvent(
            "a",
            "m",
            1_395,
            0,
            ttft_seconds=9.0,
            queue_seconds=2.0,
            engine_ttft_seconds=6.5,
            engine_queue_seconds=0.25,
        ),
        "tap",
    )
    usage.record(
        UsageEvent(
            "a",
            "m",
            1_396,
            1_376,
            ttft_seconds=0.9,
            engine_ttft_seconds=0.125,
            engine_queue_seconds=0.0,
        ),
        "tap",
    )
    usage.record(UsageEvent("a", "m", 1_397, 1_376, ttft_seconds=0.7), "tap")  # no metrics
    # vLLM sent a metrics object without a TTFT (it lacked the timestamps): the proxy's.
    usage.record(
        UsageEvent("a", "m", 1_398, 1_376, ttft_seconds=0.6, engine_queue_seconds=0.5), "tap"
    )
    registry = build_registry(state)

    def ttft(stat: str, state_name: str, source: str) -> float | None:
        return registry.get_sample_value(
            f"vllm_cache_ttft_seconds_{stat}",
            {"caller": "a", "model": "m", "state": state_name, "source": source},
        )

    def queue(stat: str, source: str) -> float | None:
        return registry.get_sample_value(
            f"vllm_cache_queue_wait_seconds_{stat}", {"caller": "a", "model": "m", "source": source}
        )

    assert (ttft("count", COLD, "engine"), ttft("sum", COLD, "engine")) == (1, 6.5)
    assert ttft("count", COLD, "proxy") is None  # the proxy's 9 - 2 s is not counted too
    assert (ttft("count", WARM, "engine"), ttft("sum", WARM, "engine")) == (1, 0.125)
    assert (ttft("count", WARM, "proxy"), ttft("sum", WARM, "proxy")) == (2, 0.7 + 0.6)
    assert (queue("count", "proxy"), queue("sum", "proxy")) == (1, 2.0)
    assert (queue("count", "engine"), queue("sum", "engine")) == (3, 0.75)


def test_every_state_of_a_pair_exists_from_its_first_event():
    state = make_state()
    state.usage.record(UsageEvent("a", "m", 10, 0), "http")
    text = generate_latest(build_registry(state)).decode()
    for name in ("warm", "partial", "cold", "short", "unknown", "error"):
        assert f'vllm_cache_requests_total{{caller="a",model="m",state="{name}"}}' in text


def test_reader_counters_and_last_event_time():
    clock = FakeClock(1_800_000_000.0)
    state = make_state(clock, usage_file=("/var/log/usage.jsonl",))
    usage = state.usage
    registry = build_registry(state)
    # Configured readers exist at 0 before their first event.
    assert registry.get_sample_value("vllm_cache_usage_events_total", {"reader": "http"}) == 0
    assert registry.get_sample_value("vllm_cache_usage_events_total", {"reader": "file"}) == 0
    assert registry.get_sample_value("vllm_cache_usage_events_total", {"reader": "tap"}) is None
    usage.record(UsageEvent("a", "m", 10, 0), "file")
    clock.now += 30
    usage.record(UsageEvent("a", "m", 10, 0), "http")
    usage.reject("http", "negative")
    usage.reject("http", "negative")
    usage.reject_request("unauthorized")
    registry = build_registry(state)
    assert value(registry, "vllm_cache_usage_events_total", reader="file") == 1
    assert value(registry, "vllm_cache_usage_events_total", reader="http") == 1
    assert (
        value(registry, "vllm_cache_usage_last_event_timestamp_seconds", reader="file")
        == 1_800_000_000.0
    )
    assert (
        value(registry, "vllm_cache_usage_last_event_timestamp_seconds", reader="http")
        == 1_800_000_030.0
    )
    assert (
        value(registry, "vllm_cache_usage_events_rejected_total", reader="http", reason="negative")
        == 2
    )
    assert (
        value(registry, "vllm_cache_usage_ingest_requests_rejected_total", reason="unauthorized")
        == 1
    )


def test_rejection_reasons_are_bounded(monkeypatch):
    import exporter.signals.usage as usage_module

    monkeypatch.setattr(usage_module, "MAX_REJECT_KEYS", 3)
    state = make_state()
    for index in range(10):
        state.usage.reject("tap", f"reason-{index}")
    assert len(state.usage.rejected) == 4
    assert state.usage.rejected[("tap", "other")] == 7
