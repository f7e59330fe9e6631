"""Every field report's outcome, played in virtual time and read back from the exporter's
/metrics, as Prometheus would read it (issue #4, section 6)."""

from __future__ import annotations

import pytest

from exporter.sim import scenario as scenarios
from tests.helpers import value
from tests.sim.conftest import played

MODEL = "qwen3.8-27b"


def counter(text: str, name: str, **labels: str) -> float:
    found = value(text, name, **labels)
    return 0.0 if found is None else found


def hit_ratio(before: str | None, after: str, caller: str) -> float:
    """Δcached / Δprompt between two scrapes: the ratio PromQL computes over a window."""

    def pair(text: str | None) -> tuple[float, float]:
        if text is None:
            return 0.0, 0.0
        return (
            counter(text, "vllm_cache_cached_tokens_total", caller=caller),
            counter(text, "vllm_cache_prompt_tokens_total", caller=caller),
        )

    cached_0, prompt_0 = pair(before)
    cached_1, prompt_1 = pair(after)
    assert prompt_1 > prompt_0, f"no reported prompt tokens for {caller} in the window"
    return (cached_1 - cached_0) / (prompt_1 - prompt_0)


def requests(text: str, caller: str, state: str) -> float:
    return counter(text, "vllm_cache_requests_total", caller=caller, state=state)


def all_requests(text: str, caller: str) -> float:
    return sum(
        requests(text, caller, state)
        for state in ("warm", "partial", "cold", "short", "unknown", "error")
    )


def test_every_shipped_scenario_loads():
    names = scenarios.available()
    assert set(names) >= {
        "two-agents-fit",
        "two-agents-collapse",
        "prefix-caching-off",
        "details-off",
        "fanout-order",
        "overload-preempt",
    }
    for name in names:
        scenario = scenarios.load(name)
        assert scenario.name == name
        assert scenario.report and scenario.reproduces, f"{name} must say what it reproduces"


async def test_two_agents_fit_both_stay_warm(through_exporter):
    run = played("two-agents-fit")
    assert run.stats.errors == 0
    firsts = {}
    for index, (_, event) in enumerate(run.events):
        firsts.setdefault(event["caller"], index)
    split = max(firsts.values()) + 1
    events = [event for _, event in run.events]
    cold, warm = await through_exporter(run.metrics_text, [events[:split], events[split:]])
    turns = scenarios.load("two-agents-fit").agents[0].turns
    for caller in ("agent-a", "agent-b"):
        assert requests(cold, caller, "cold") == 1
        assert hit_ratio(cold, warm, caller) >= 0.9
        # every turn after the first is warm, none partial or cold
        assert requests(warm, caller, "warm") == turns - 1
        assert all_requests(warm, caller) == turns
        # the conversations really grow to ~90k tokens
        assert counter(warm, "vllm_cache_prompt_tokens_total", caller=caller) > 11 * 60_000
    # warm turns answer in seconds, the cold one in about a minute (report 001)
    for caller in ("agent-a", "agent-b"):
        warm_sum = counter(warm, "vllm_cache_ttft_seconds_sum", caller=caller, state="warm")
        cold_sum = counter(warm, "vllm_cache_ttft_seconds_sum", caller=caller, state="cold")
        assert warm_sum / (turns - 1) < 10 < 40 < cold_sum
    assert counter(warm, "vllm_cache_granularity_tokens", model=MODEL) == 2048


async def test_two_agents_collapse_after_a_healthy_phase(through_exporter):
    run = played("two-agents-collapse")
    assert run.stats.errors == 0
    events = [event for _, event in run.events]
    b_arrives = next(i for i, event in enumerate(events) if event["caller"] == "agent-b")
    assert b_arrives >= 5, "agent-a must have several turns alone first"
    first, alone, shared = await through_exporter(
        run.metrics_text, [events[:1], events[1:b_arrives], events[b_arrives:]]
    )
    assert requests(first, "agent-a", "cold") == 1
    # the healthy baseline: agent-a alone, warm turn after warm turn
    assert hit_ratio(first, alone, "agent-a") >= 0.9
    assert requests(alone, "agent-a", "warm") == b_arrives - 1
    # both active: each arrival evicts the other, hits fall to about zero
    assert hit_ratio(alone, shared, "agent-a") <= 0.1
    assert hit_ratio(alone, shared, "agent-b") <= 0.1
    # and TTFT goes from seconds to minutes (6.6 s -> 384.7 s in report 000)
    warm = value(shared, "vllm_cache_ttft_seconds_sum", caller="agent-a", state="warm")
    warm_count = value(shared, "vllm_cache_ttft_seconds_count", caller="agent-a", state="warm")
    cold = value(shared, "vllm_cache_ttft_seconds_sum", caller="agent-a", state="cold")
    cold_count = value(shared, "vllm_cache_ttft_seconds_count", caller="agent-a", state="cold")
    assert warm / warm_count < 10 and cold / cold_count > 60
    # not preemption: that counter stayed at zero in the report, and does here
    assert value(shared, "vllm_cache_engine_preemptions_total") == 0


async def test_engine_timings_are_the_simulated_engines(through_exporter):
    """The scenarios run the simulator as vLLM with --enable-per-request-metrics: every
    request's TTFT and queue wait reach the exporter as the engine's own (source="engine"),
    and they add up to the engine's own /metrics histograms (vLLM's prefill and queue time),
    which the proxy's clock could not give: its TTFT includes the queue."""
    run = played("two-agents-collapse")
    events = [event for _, event in run.events]
    assert all("engine_ttft_seconds" in event for event in events)
    (text,) = await through_exporter(run.metrics_text, [events])
    for family, name in (
        ("vllm:request_prefill_time_seconds_sum", "vllm_cache_ttft_seconds"),
        ("vllm:request_queue_time_seconds_sum", "vllm_cache_queue_wait_seconds"),
    ):
        engine_total = counter(run.metrics_text, family)
        ours = sum(
            counter(text, f"{name}_sum", caller=caller, source="engine", **state)
            for caller in ("agent-a", "agent-b")
            for state in (
                [{"state": s} for s in ("warm", "partial", "cold", "short", "unknown")]
                if name == "vllm_cache_ttft_seconds"
                else [{}]
            )
        )
        assert ours == pytest.approx(engine_total, rel=1e-9), family
    assert counter(run.metrics_text, "vllm:request_queue_time_seconds_sum") > 60
    assert 'source="proxy"' not in "\n".join(
        line for line in text.splitlines() if line.startswith("vllm_cache_ttft_seconds")
    )


async def test_prefix_caching_off_every_request_cold(through_exporter):
    run = played("prefix-caching-off")
    events = [event for _, event in run.events]
    (text,) = await through_exporter(run.metrics_text, [events])
    assert value(text, "vllm_cache_engine_prefix_caching_enabled") == 0
    for caller in ("agent-a", "agent-b"):
        total = all_requests(text, caller)
        assert total == 6
        assert requests(text, caller, "cold") == total
        assert counter(text, "vllm_cache_cached_tokens_total", caller=caller) == 0
    assert value(text, "vllm_cache_engine_prefix_cache_hits_tokens_total") == 0


async def test_details_off_every_request_unknown(through_exporter):
    run = played("details-off")
    events = [event for _, event in run.events]
    assert all(event["cached_tokens"] is None for event in events)
    (text,) = await through_exporter(run.metrics_text, [events])
    for caller in ("coder", "reviewer"):
        total = all_requests(text, caller)
        assert total == 10
        assert requests(text, caller, "unknown") == total
        assert counter(text, "vllm_cache_unreported_prompt_tokens_total", caller=caller) > 0
        assert counter(text, "vllm_cache_prompt_tokens_total", caller=caller) == 0
    # the cache itself works: only the per-request report is missing
    assert value(text, "vllm_cache_engine_prefix_caching_enabled") == 1
    hits = value(text, "vllm_cache_engine_prefix_cache_hits_tokens_total")
    queries = value(text, "vllm_cache_engine_prefix_cache_queries_tokens_total")
    assert hits / queries > 0.8


async def test_fanout_order_shared_prefix_first_wins(through_exporter):
    run = played("fanout-order")
    events = [event for _, event in run.events]
    (text,) = await through_exporter(run.metrics_text, [events])
    shared_first = hit_ratio(None, text, "fanout-shared-first")
    task_first = hit_ratio(None, text, "fanout-task-first")
    assert shared_first == pytest.approx(0.629, abs=0.03)  # report 002: 62.9%
    assert task_first == pytest.approx(0.0, abs=0.03)  # report 002: 0%
    # in each round the first request reads the shared text, the three behind it reuse it
    assert requests(text, "fanout-shared-first", "warm") == 3 * 6
    assert requests(text, "fanout-shared-first", "cold") == 6
    assert requests(text, "fanout-task-first", "cold") == 4 * 6
    # and the round is about twice as fast (6.78 s vs 13.86 s): compare the slowest TTFTs
    shared_ttft = value(
        text, "vllm_cache_ttft_seconds_sum", caller="fanout-shared-first", state="warm"
    )
    task_ttft = value(text, "vllm_cache_ttft_seconds_sum", caller="fanout-task-first", state="cold")
    assert task_ttft > 1.5 * shared_ttft


async def test_overload_preempts(through_exporter):
    run = played("overload-preempt")
    assert run.stats.errors == 0, "preempted requests are recomputed, not failed"
    events = [event for _, event in run.events]
    (text,) = await through_exporter(run.metrics_text, [events])
    assert value(text, "vllm_cache_engine_preemptions_total") > 0
    assert all_requests(text, "batch") == 12
    assert requests(text, "batch", "error") == 0
