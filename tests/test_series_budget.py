"""The per-caller exposition is bounded as a whole: filled adversarially at the defaults, it
stays within the series and bytes docs/metrics.md promises, in both formats."""

from __future__ import annotations

import re
from array import array
from pathlib import Path

from exporter.config import Config
from exporter.metrics import build_registry
from exporter.metrics.exposition import generate_openmetrics, generate_text
from exporter.metrics.usage import UsageCollector
from exporter.signals.callers import OTHER, rank
from exporter.signals.usage import (
    MAX_MODELS,
    MAX_TARGET_CHARS,
    MISS_SERIES,
    SERIES_PER_CALLER,
    SERIES_PER_PAIR,
    TARGET_SERIES,
    TTFT_SERIES,
)
from exporter.values import PromptPrint, UsageEvent
from exporter.wiring import signals_state
from tests.helpers import value

DOC = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text("utf-8")
PER_CALLER = (
    "vllm_cache_requests_total",
    "vllm_cache_prompt_tokens_total",
    "vllm_cache_cached_tokens_total",
    "vllm_cache_unreported_prompt_tokens_total",
    "vllm_cache_ttft_seconds_",
    "vllm_cache_queue_wait_seconds_",
    "vllm_cache_completion_used_tokens_",
    "vllm_cache_completion_declared_tokens_total",
    "vllm_cache_prompt_order_compared_total",
    "vllm_cache_prompt_order_variable_top_total",
    "vllm_cache_prompt_order_shared_bytes_total",
    "vllm_cache_prompt_order_first_difference_bytes_total",
    "vllm_cache_target_prompt_tokens_total",
    "vllm_cache_target_cached_tokens_total",
    "vllm_cache_missed_prompt_tokens_total",
    "vllm_cache_missed_requests_total",
)
USAGE_FAMILIES = (*PER_CALLER[:6], *PER_CALLER[-4:])  # what UsageCollector renders
# One turn per state, the unreported one first so that it stays unreported.
TURNS = (
    (5000, None, None),
    (91_070, 86_016, None),
    (60_000, 30_720, None),
    (40_000, 0, None),
    (100, 0, None),
    (5000, 0, 500),
)
# Two prompts that share all but their first block: each one after the first is counted in
# every prompt-order series, with sums of many digits.
ENDS = array("I", range(999_999, 64 * 999_999, 999_999))
PRINTS = (
    PromptPrint(array("Q", [1, *range(10, 72)]), ENDS, 64 * 999_999),
    PromptPrint(array("Q", [2, *range(10, 72)]), ENDS, 64 * 999_999),
)


# Backends past the target cap, each a label of the longest length (a name, not a URL).
BACKENDS = tuple(
    (f"r{index:03d}" + "-abcdefghijklmn" * 9)[:MAX_TARGET_CHARS] for index in range(300)
)


def documented(label: str) -> int:
    """A bound as docs/metrics.md states it in bold: '**40,000 per-caller series**'."""
    match = re.search(r"\*\*([\d,]+) " + re.escape(label) + r"\*\*", DOC)
    assert match, f"docs/metrics.md states no bound for {label}"
    return int(match.group(1).replace(",", ""))


def fill_adversarially() -> tuple[Config, object]:
    # The defaults for every bound; a fixed G and no missing-as-zero so that every state
    # (and so every TTFT histogram, of both sources) appears for every pair.
    config = Config(signals_granularity=2048, signals_missing_cached_as_zero=False)
    state = signals_state(config)
    for caller_index in range(400):  # past the caller cap and the series budget
        caller = (f"c{caller_index:03d}" + "-abcdefghijklmn" * 5)[:64]
        for model_index in range(40):  # past the model cap
            model = (f"m{model_index:02d}" + "/abcdefghijklmn" * 10)[:128]
            for turn, (prompt, cached, status) in enumerate(TURNS):
                # Every event on another replica: past the target cap, each pair on many.
                backend = BACKENDS[(caller_index * 41 + model_index * 7 + turn) % len(BACKENDS)]
                # Timed by the proxy, then by vLLM: both sources' histograms for every state.
                event = UsageEvent(
                    caller,
                    model,
                    prompt,
                    cached,
                    completion_tokens=9_999_999,
                    ttft_seconds=86_399.123456789,
                    queue_seconds=86_398.987654321,
                    status=status,
                    max_tokens=9_999_999,
                    backend=backend,
                )
                state.usage.record(event, "http")
                state.usage.record_prompt(event, PRINTS[turn % 2])
                state.usage.record(
                    UsageEvent(
                        caller,
                        model,
                        prompt,
                        cached,
                        status=status,
                        engine_ttft_seconds=86_399.876543219,
                        engine_queue_seconds=86_397.123456789,
                        backend=backend,
                    ),
                    "http",
                )
    return config, state


def test_the_worst_case_stays_within_the_documented_bounds():
    config, state = fill_adversarially()
    registry = build_registry(state)
    max_series = documented("per-caller series")
    max_bytes = documented("bytes")
    # The budget, plus the __other__ pairs (a model label each, 32 and __other__), which
    # always have room: the budget folds into them, with an entry for every target label
    # (--callers.targets-max and __other__).
    other_pair = SERIES_PER_PAIR + (config.callers_targets_max + 1) * TARGET_SERIES
    assert max_series == config.callers_max_series + (MAX_MODELS + 1) * other_pair
    for body in (generate_text(registry), generate_openmetrics(registry)):
        lines = [line for line in body.decode().splitlines() if line.startswith(PER_CALLER)]
        assert len(lines) <= max_series
        assert len(lines) >= max_series - other_pair  # the fill did reach the bound
        assert len(body) <= max_bytes
    # The lines kept for the next scrape's reuse are at most the per-caller part of a body.
    (usage,) = [
        collector for collector in registry.collectors() if isinstance(collector, UsageCollector)
    ]
    per_caller = sum(
        len(line) + 1 for line in body.decode().splitlines() if line.startswith(USAGE_FAMILIES)
    )
    assert 0.9 * per_caller < usage.kept_characters() <= per_caller
    text = generate_text(registry).decode()
    flagged = [
        line
        for line in text.splitlines()
        if line.startswith("vllm_cache_prompt_order_variable_top_total{")
    ]
    # Prompt order (like every costly family) is per caller for the detailed callers only,
    # the others' counted under __other__ of their model.
    ordered = [pair for pair, series in state.usage.series.items() if series.order is not None]
    assert len(flagged) == len(ordered) > 0
    assert {caller for caller, _model in ordered} <= set(state.usage.detailed.members) | {OTHER}
    assert all(not line.endswith(" 0.0") for line in flagged)
    # The budget charged exactly what is exposed.
    exposed = [line for line in text.splitlines() if line.startswith(PER_CALLER)]
    assert len(exposed) == state.usage.exposed
    folded = value(text, "vllm_cache_callers_folded_total")
    assert folded and folded > 0
    # Nothing was lost: every event is counted, folded ones under __other__.
    requests = sum(
        series.requests[state_name]
        for series in state.usage.series.values()
        for state_name in series.requests
    )
    assert requests == 400 * 40 * len(TURNS) * 2
    assert (OTHER, OTHER) in state.usage.series


def test_pairs_within_the_budget_keep_their_own_series():
    # A pair's nine series and, with its first successful event, its miss causes (a
    # detailed caller's own).
    state = signals_state(Config(callers_max_series=2 * (SERIES_PER_CALLER + MISS_SERIES)))
    for caller in ("a", "b", "c", "d"):
        state.usage.record(UsageEvent(caller, "m", 100, 0), "http")
    # __other__ of a model always has room: it is where the budget folds to.
    assert set(state.usage.series) == {("a", "m"), ("b", "m"), (OTHER, "m")}
    assert state.usage.series_folded == 2
    state.usage.record(UsageEvent("a", "m", 100, 0), "http")  # admitted before: its own
    assert state.usage.series_folded == 2


def per_caller_lines(state) -> list[str]:
    text = generate_text(build_registry(state)).decode()
    return [line for line in text.splitlines() if line.startswith(PER_CALLER)]


def test_the_budget_charges_what_a_pair_exposes():
    """A caller's hit ratio costs its nine series; a histogram is charged when it appears,
    and the budget is what /metrics shows, not a worst case reserved per pair."""
    state = signals_state(Config(callers_detailed=1, callers_max_series=1_000))
    usage = state.usage
    names = sorted((f"agent-{index}" for index in range(20)), key=rank)
    for name in names:
        usage.record(UsageEvent(name, "m", 4096, 2048), "http")
    # The miss causes are costly: the detailed caller's own, the 19 others' __other__'s
    # (nine series for __other__ and its miss causes).
    misses = SERIES_PER_CALLER + 2 * MISS_SERIES
    assert usage.exposed == len(per_caller_lines(state)) == 20 * SERIES_PER_CALLER + misses
    # The detailed caller's first timed turn adds its TTFT histogram, nothing more.
    usage.record(UsageEvent(names[0], "m", 4096, 2048, ttft_seconds=0.3), "http")
    assert usage.exposed == len(per_caller_lines(state))
    assert usage.exposed == 20 * SERIES_PER_CALLER + misses + TTFT_SERIES
    # Another caller's timing goes to __other__'s histogram, still as exposed.
    usage.record(UsageEvent(names[1], "m", 4096, 2048, ttft_seconds=0.3), "http")
    assert usage.exposed == len(per_caller_lines(state))
    assert usage.exposed == 20 * SERIES_PER_CALLER + misses + 2 * TTFT_SERIES
    assert not usage.series[(names[1], "m")].ttft
    # Past the budget, a detailed pair's new histogram is __other__'s too.
    tight = signals_state(Config(callers_max_series=SERIES_PER_CALLER))
    tight.usage.record(UsageEvent("solo", "m", 4096, 2048, ttft_seconds=0.3), "http")
    assert not tight.usage.series[("solo", "m")].ttft
    assert tight.usage.series[(OTHER, "m")].ttft["warm"].total == 0.3
    assert tight.usage.series[(OTHER, "m")].miss is not None  # so are its miss causes
    assert tight.usage.series_folded == 2
    assert tight.usage.exposed == len(per_caller_lines(tight))
