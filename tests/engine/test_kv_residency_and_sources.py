"""KV residency, cache sources and engine phases: read when vLLM exposes them, absent (never 0)
when it does not, capped where vLLM's label values come from outside, carried across vLLM
restarts like every other counter."""

from __future__ import annotations

import math
import re

import pytest

from exporter.engine.parse import MAX_HISTOGRAM_BUCKETS, parse
from exporter.signals.engine import EngineState
from exporter.values import (
    KV_BLOCK_IDLE_BEFORE_EVICT,
    KV_BLOCK_LIFETIME,
    KV_BLOCK_REUSE_GAP,
    PROMPT_TOKENS_BY_SOURCE,
    EngineSnapshot,
    EngineValues,
    HistogramValue,
)
from tests.engine import kv_cache_metrics_fixture
from tests.helpers import fixture_text, scrape, value

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
RESIDENCY = (
    "vllm_cache_engine_kv_block_lifetime_seconds",
    "vllm_cache_engine_kv_block_idle_before_evict_seconds",
    "vllm_cache_engine_kv_block_reuse_gap_seconds",
)
RESIDENCY_SIGNALS = (KV_BLOCK_LIFETIME, KV_BLOCK_IDLE_BEFORE_EVICT, KV_BLOCK_REUSE_GAP)
WITH = fixture_text("vllm-0.33.0-kv-cache-metrics.prom")
WITHOUT = fixture_text("vllm-0.33.0-sample.prom")


def test_kv_cache_metrics_fixture_is_the_builders_output():
    assert WITH == kv_cache_metrics_fixture.build(), (
        "run `python -m tests.engine.kv_cache_metrics_fixture` and review the diff"
    )


async def read(fake_vllm, exporter_for, body: str) -> tuple[str, dict[str, str]]:
    fake_vllm.body = body
    client = await exporter_for(fake_vllm.url)
    return await scrape(client), {"target": fake_vllm.url, "model_name": MODEL, "engine": "0"}


async def test_residency_is_read_with_vllm_s_own_buckets(fake_vllm, exporter_for):
    text, row = await read(fake_vllm, exporter_for, WITH)
    for signal in RESIDENCY_SIGNALS:
        assert (
            value(text, "vllm_cache_engine_metric_present", target=fake_vllm.url, signal=signal)
            == 1
        )
    for name, count in zip(RESIDENCY, (150, 150, 307), strict=True):
        assert value(text, f"{name}_count", **row) == count
        vllm_name = name.replace("vllm_cache_engine_", "vllm:")
        assert value(text, f"{name}_sum", **row) == value(WITH, f"{vllm_name}_sum", engine="0")
        # every bucket vLLM has, with its count
        for bound in kv_cache_metrics_fixture.KV_CACHE_RESIDENCY_BUCKETS:
            le = str(float(bound))
            assert value(text, f"{name}_bucket", le=le, **row) == value(
                WITH, f"{vllm_name}_bucket", le=le
            ), (name, le)


async def test_without_kv_cache_metrics_residency_is_absent_not_zero(fake_vllm, exporter_for):
    text, row = await read(fake_vllm, exporter_for, WITHOUT)
    for name, signal in zip(RESIDENCY, RESIDENCY_SIGNALS, strict=True):
        assert (
            value(text, "vllm_cache_engine_metric_present", target=fake_vllm.url, signal=signal)
            == 0
        )
        assert value(text, f"{name}_count", **row) is None
        assert f"{name}_bucket{{" not in text
    # The families vLLM does have are there.
    assert value(text, "vllm_cache_engine_request_queue_time_seconds_count", **row) == 1200


async def test_cache_sources_and_waiting_reasons_are_read(fake_vllm, exporter_for):
    text, row = await read(fake_vllm, exporter_for, WITHOUT)
    by_source = "vllm_cache_engine_prompt_tokens_by_source_total"
    assert value(text, by_source, source="local_compute", **row) == 3_703_344
    assert value(text, by_source, source="local_cache_hit", **row) == 3_377_504
    assert value(text, by_source, source="external_kv_transfer", **row) == 0
    tiers = "vllm_cache_engine_prompt_tokens_cached_by_source_total"
    assert value(text, tiers, source="device", **row) == 3_377_504
    for tier in ("host", "p2p", "disk", "external_unspecified"):
        assert value(text, tiers, source=tier, **row) == 0
    assert value(text, "vllm_cache_engine_external_prefix_cache_queries_tokens_total", **row) == 0
    assert (
        value(text, "vllm_cache_engine_requests_waiting_by_reason", reason="capacity", **row) == 2
    )
    assert (
        value(text, "vllm_cache_engine_requests_waiting_by_reason", reason="deferred", **row) == 0
    )


async def test_before_016_there_is_no_source_split_and_it_says_so(fake_vllm, exporter_for):
    text, _row = await read(fake_vllm, exporter_for, fixture_text("vllm-0.9-oldnames.prom"))
    for signal in ("prompt_tokens_by_source", "prompt_tokens_cached_by_source"):
        assert (
            value(text, "vllm_cache_engine_metric_present", target=fake_vllm.url, signal=signal)
            == 0
        )
    assert "vllm_cache_engine_prompt_tokens_by_source_total{" not in text


async def test_unknown_label_values_are_summed_into_other(fake_vllm, exporter_for):
    """vLLM's label values are outside input: a future source, or a hostile body with a
    thousand of them, gets no series of its own."""
    head = f'vllm:prompt_tokens_cached_by_source_total{{engine="0",model_name="{MODEL}",'
    extra = "\n".join(f'{head}source="tier-{index}"}} {float(index)}' for index in range(1000))
    waiting = (
        f'vllm:num_requests_waiting_by_reason{{engine="0",model_name="{MODEL}",'
        'reason="lora_budget"} 3.0'
    )
    text, row = await read(fake_vllm, exporter_for, WITHOUT + extra + "\n" + waiting + "\n")
    tiers = "vllm_cache_engine_prompt_tokens_cached_by_source_total"
    assert value(text, tiers, source="other", **row) == sum(range(1000))
    assert value(text, tiers, source="device", **row) == 3_377_504
    assert len(re.findall(rf"^{tiers}\{{", text, flags=re.M)) == 6  # 5 known + other
    assert value(text, "vllm_cache_engine_requests_waiting_by_reason", reason="other", **row) == 3


def residency_lines(text: str, family: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(family)]


@pytest.mark.parametrize(
    "breakage", ["nan_bucket", "falling", "no_inf", "bad_le", "count_mismatch", "negative_sum"]
)
async def test_a_broken_histogram_is_dropped_and_counted(fake_vllm, exporter_for, breakage):
    family = "vllm:kv_block_idle_before_evict_seconds"
    lines = residency_lines(WITH, family + "_")
    broken = WITH
    bucket_10 = next(line for line in lines if 'le="10.0"' in line)
    if breakage == "nan_bucket":
        broken = broken.replace(bucket_10, bucket_10.rsplit(" ", 1)[0] + " NaN")
    elif breakage == "falling":
        broken = broken.replace(bucket_10, bucket_10.rsplit(" ", 1)[0] + " 149.5")
        bucket_20 = next(line for line in lines if 'le="20.0"' in line)
        broken = broken.replace(bucket_20, bucket_20.rsplit(" ", 1)[0] + " 3.0")
    elif breakage == "no_inf":
        infinite = next(line for line in lines if 'le="+Inf"' in line)
        broken = broken.replace(infinite + "\n", "")
    elif breakage == "bad_le":
        broken = broken.replace(bucket_10, bucket_10.replace('le="10.0"', 'le="ten"'))
    elif breakage == "count_mismatch":
        count = next(line for line in lines if "_count{" in line)
        broken = broken.replace(count, count.rsplit(" ", 1)[0] + " 151.0")
    else:
        total = next(line for line in lines if "_sum{" in line)
        broken = broken.replace(total, total.rsplit(" ", 1)[0] + " -1.0")
    text, row = await read(fake_vllm, exporter_for, broken)
    expected_lines = len(lines) - 1 - (breakage == "no_inf")  # not the _created line
    reason = {"nan_bucket": "not_finite", "negative_sum": "negative"}.get(breakage, "bad_histogram")
    assert (
        value(text, "vllm_cache_engine_invalid_samples_total", target=fake_vllm.url, reason=reason)
        == expected_lines
    )
    assert value(text, "vllm_cache_engine_kv_block_idle_before_evict_seconds_count", **row) is None
    # It was there, so it is present; the others are unharmed.
    assert (
        value(
            text,
            "vllm_cache_engine_metric_present",
            target=fake_vllm.url,
            signal=KV_BLOCK_IDLE_BEFORE_EVICT,
        )
        == 1
    )
    assert value(text, "vllm_cache_engine_kv_block_lifetime_seconds_count", **row) == 150


def test_a_histogram_past_the_bucket_cap_is_dropped():
    labels = 'engine="0",model_name="m"'

    def body(bounds: int) -> str:
        lines = [
            f'vllm:kv_block_lifetime_seconds_bucket{{{labels},le="{index}.0"}} 1.0'
            for index in range(1, bounds)
        ]
        lines.append(f'vllm:kv_block_lifetime_seconds_bucket{{{labels},le="+Inf"}} 1.0')
        lines.append(f"vllm:kv_block_lifetime_seconds_count{{{labels}}} 1.0")
        lines.append(f"vllm:kv_block_lifetime_seconds_sum{{{labels}}} 0.5")
        return "\n".join(lines) + "\n"

    at_cap = parse(body(MAX_HISTOGRAM_BUCKETS))
    assert (
        len(at_cap.engines[("m", "0")].histograms[KV_BLOCK_LIFETIME].bounds)
        == MAX_HISTOGRAM_BUCKETS
    )
    past = parse(body(MAX_HISTOGRAM_BUCKETS + 1))
    assert ("m", "0") not in past.engines
    assert past.invalid_samples == MAX_HISTOGRAM_BUCKETS + 3
    assert past.present[KV_BLOCK_LIFETIME]


# --- carried across vLLM restarts ------------------------------------------------------------

TARGET = "http://vllm:8000/metrics"


def hist(bounds: tuple[float, ...], cumulative: tuple[float, ...], total: float) -> HistogramValue:
    return HistogramValue(bounds, cumulative, total)


def read_histogram(
    state: EngineState, histogram: HistogramValue, created: float = 1.0
) -> HistogramValue:
    values = EngineValues(
        "m", "0", histograms={KV_BLOCK_LIFETIME: histogram}, created={KV_BLOCK_LIFETIME: created}
    )
    state.record_success(
        TARGET, EngineSnapshot({("m", "0"): values}, {}, {KV_BLOCK_LIFETIME: True}), 0.01, 0.0
    )
    return state.targets[TARGET].rows[0].histograms[KV_BLOCK_LIFETIME]


INF = math.inf


def test_a_histogram_is_carried_across_a_restart():
    state = EngineState((TARGET,))
    bounds = (1.0, 10.0, INF)
    assert read_histogram(state, hist(bounds, (2, 5, 6), 30.0)) == hist(bounds, (2, 5, 6), 30.0)
    # vLLM restarted (a newer _created): its histogram starts again from empty, then sees
    # 1 observation.
    after = read_histogram(state, hist(bounds, (0, 1, 1), 4.0), created=1.5)
    assert after == hist(bounds, (2, 6, 7), 34.0)
    assert read_histogram(state, hist(bounds, (1, 3, 3), 9.0), created=1.5) == hist(
        bounds, (3, 8, 9), 39.0
    )
    assert state.targets[TARGET].restarts == 1
    # A restart that already grew past the old counts shows in _created.
    grown = read_histogram(state, hist(bounds, (5, 9, 10), 50.0), created=2.0)
    assert grown == hist(bounds, (8, 17, 19), 89.0)
    assert state.targets[TARGET].restarts == 2


def test_new_bounds_after_a_restart_never_take_a_bucket_back():
    """vLLM restarted with --custom-histogram-buckets: the carried totals are re-binned onto
    the new bounds (each new bound takes the count of the largest old bound at or below it)."""
    state = EngineState((TARGET,))
    read_histogram(state, hist((1.0, 10.0, 100.0, INF), (2, 5, 9, 10), 300.0))
    after = read_histogram(state, hist((0.5, 10.0, 50.0, INF), (1, 1, 2, 2), 60.0))
    assert after == hist((0.5, 10.0, 50.0, INF), (0 + 1, 5 + 1, 5 + 2, 10 + 2), 360.0)
    assert state.targets[TARGET].restarts == 1
    later = read_histogram(state, hist((0.5, 10.0, 50.0, INF), (1, 3, 4, 4), 70.0))
    assert later == hist((0.5, 10.0, 50.0, INF), (1, 8, 9, 14), 370.0)


def test_split_counters_are_carried_per_label_value():
    state = EngineState((TARGET,))

    def read_split(by_source: dict[str, float]) -> dict[str, float]:
        values = EngineValues("m", "0", splits={PROMPT_TOKENS_BY_SOURCE: by_source})
        state.record_success(
            TARGET,
            EngineSnapshot({("m", "0"): values}, {}, {PROMPT_TOKENS_BY_SOURCE: True}),
            0.01,
            0.0,
        )
        return state.targets[TARGET].rows[0].splits[PROMPT_TOKENS_BY_SOURCE]

    assert read_split({"local_compute": 100, "local_cache_hit": 900}) == {
        "local_compute": 100,
        "local_cache_hit": 900,
    }
    assert read_split({"local_compute": 10, "local_cache_hit": 0}) == {
        "local_compute": 110,
        "local_cache_hit": 900,
    }
    assert read_split({"local_compute": 20, "local_cache_hit": 50}) == {
        "local_compute": 120,
        "local_cache_hit": 950,
    }


def test_tracks_are_bounded_at_their_worst():
    """A target whose engine labels churn: at most MAX_TRACKS counter tracks and
    MAX_HISTOGRAM_TRACKS histogram tracks are kept, the most recently seen; the rows of the
    current read are always among them."""
    from exporter.signals.engine import MAX_HISTOGRAM_TRACKS, MAX_TRACKS

    state = EngineState((TARGET,))
    histogram = hist((1.0, INF), (1, 2), 3.0)
    for read in range(60):
        engines = {}
        for index in range(10):
            engine = f"{read}-{index}"
            engines[("m", engine)] = EngineValues(
                "m",
                engine,
                histograms={name: histogram for name in RESIDENCY_SIGNALS},
                splits={
                    PROMPT_TOKENS_BY_SOURCE: {
                        "local_compute": 1.0,
                        "local_cache_hit": 2.0,
                        "external_kv_transfer": 0.0,
                    }
                },
            )
        state.record_success(TARGET, EngineSnapshot(engines, {}, {}), 0.01, 0.0)
        target = state.targets[TARGET]
        assert len(target.tracks) <= MAX_TRACKS
        assert len(target.histogram_tracks) <= MAX_HISTOGRAM_TRACKS
        current = {
            ("m", f"{read}-{index}", name) for index in range(10) for name in RESIDENCY_SIGNALS
        }
        assert current <= set(target.histogram_tracks)
    assert len(target.histogram_tracks) == MAX_HISTOGRAM_TRACKS  # filled, never past
    assert len(target.tracks) == min(60 * 10 * 3, MAX_TRACKS)


def test_bounds_remembered_across_bucket_changes_are_bounded():
    from exporter.signals.engine import MAX_REMEMBERED_BOUNDS

    state = EngineState((TARGET,))
    for change in range(40):  # a vLLM restarted 40 times, each with 20 new bounds
        bounds = tuple(float(change * 100 + index) for index in range(1, 21)) + (INF,)
        read_histogram(state, hist(bounds, tuple(range(1, 22)), 10.0), created=float(change))
        track = state.targets[TARGET].histogram_tracks[("m", "0", KV_BLOCK_LIFETIME)]
        assert len(track.remembered) <= MAX_REMEMBERED_BOUNDS
    assert len(track.remembered) == MAX_REMEMBERED_BOUNDS
