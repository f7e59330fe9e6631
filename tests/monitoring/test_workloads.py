"""The day-long promtool scenarios hold the counters their builders describe.

alerts/tests/{long_collapse,slow_decline,healthy_day}.yaml carry thousands of samples that
nobody can check by eye; tests/monitoring/workloads.py builds them from turns. Here: the
committed input series are exactly the builders' output (so the YAML's comments, which
describe the turns, describe the data), and promtool's notation is written correctly.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.monitoring import workloads
from tests.monitoring.common import load_yaml


@pytest.mark.parametrize("filename", sorted(workloads.SCENARIOS))
def test_committed_input_series_are_the_builders_output(filename: str) -> None:
    path = workloads.ALERTS_TESTS / filename
    (test,) = load_yaml(path)["tests"]
    committed = {item["series"]: item["values"] for item in test["input_series"]}
    turns, minutes = workloads.SCENARIOS[filename]()
    assert committed == workloads.counters(turns, minutes), (
        f"{path.name} drifted from tests/monitoring/workloads.py: run "
        "`python -m tests.monitoring.workloads` and review the diff"
    )
    assert workloads.render(filename, path.read_text(encoding="utf-8")) == path.read_text(
        encoding="utf-8"
    )


@given(st.lists(st.one_of(st.none(), st.integers(-(10**9), 10**9)), max_size=60))
def test_encode_is_promtool_notation_that_reads_back(samples: list[int | None]) -> None:
    assert workloads.decode(workloads.encode(samples)) == samples


def test_encode_uses_promtool_s_counts() -> None:
    """``a+bxn`` holds n+1 samples, ``_xn`` n missing ones (promtool's own rules)."""
    assert workloads.encode([None, None, 0, 5, 10, 15, 15, 15]) == "_x2 0+5x3 15x1"
    assert workloads.encode([7, None, 3]) == "7 _ 3"
    assert workloads.encode([9, 4, -1]) == "9-5x2"


def test_counters_follow_the_turns() -> None:
    """Per caller and per vLLM, cumulative from 0 the minute before the first turn; every
    state the caller uses has its requests counter and TTFT buckets from then on."""
    turns = [
        workloads.Turn(2, "a", 1_000, 0, "cold", 70.0),
        workloads.Turn(3, "a", 1_200, 1_024, "warm", 5.0),
        workloads.Turn(3, "b", 500, 0, "short", 0.2),
    ]
    series = {
        name: workloads.decode(values) for name, values in workloads.counters(turns, 4).items()
    }
    caller = 'job="vllm-cache-exporter", instance="exporter:10123", caller="a", model="qwen3.8-27b"'
    assert series[f"vllm_cache_prompt_tokens_total{{{caller}}}"] == [None, 0, 1000, 2200, 2200]
    assert series[f"vllm_cache_cached_tokens_total{{{caller}}}"] == [None, 0, 0, 1024, 1024]
    assert series[f'vllm_cache_requests_total{{{caller}, state="cold"}}'] == [None, 0, 1, 1, 1]
    assert series[f'vllm_cache_ttft_seconds_bucket{{{caller}, state="cold", le="60"}}'] == [
        None,
        0,
        0,
        0,
        0,
    ]
    assert series[f'vllm_cache_ttft_seconds_bucket{{{caller}, state="cold", le="120"}}'] == [
        None,
        0,
        1,
        1,
        1,
    ]
    assert series[f'vllm_cache_ttft_seconds_bucket{{{caller}, state="warm", le="10"}}'] == [
        None,
        0,
        0,
        1,
        1,
    ]
    queries = next(
        values
        for name, values in series.items()
        if name.startswith("vllm_cache_engine_prefix_cache_queries")
    )
    assert queries == [None, 0, 1000, 2700, 2700]
    assert not any(
        'caller="b", model="qwen3.8-27b", state="short", le=' in name for name in series
    ), "short turns have no TTFT histogram"
