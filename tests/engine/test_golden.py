"""node_exporter-style end-to-end: real vLLM scrapes in, our exposition out, diffed against
committed golden files. ``UPDATE_GOLDEN=1 python -m pytest tests/engine/test_golden.py``
rewrites them; review the diff like code."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import FIXTURES, fixture_text, scrape, value

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
STABLE_TARGET = "http://vllm:8000/metrics"

CASES = {
    "vllm-0.32.0-cpu": "vllm-0.32.0-cpu/metrics_after.prom",
    "vllm-0.33.0-sample": "vllm-0.33.0-sample.prom",
    "vllm-0.33.0-kv-cache-metrics": "vllm-0.33.0-kv-cache-metrics.prom",
    "vllm-0.9-oldnames": "vllm-0.9-oldnames.prom",
}


def engine_exposition(text: str, target: str) -> str:
    """Our engine and self series (process_* read from the recorded /proc of
    tests/fixtures/proc), nondeterministic ones dropped, target made stable."""
    keep = []
    for line in text.splitlines():
        if "scrape_duration_seconds" in line:
            continue
        if (
            "vllm_cache_engine_" in line
            or "vllm_cache_exporter_" in line
            or " process_" in line
            or line.startswith("process_")
        ):
            keep.append(line.replace(target, STABLE_TARGET))
    return "\n".join(keep) + "\n"


@pytest.mark.parametrize("case", sorted(CASES))
async def test_exposition_matches_golden(case, fake_vllm, exporter_for):
    fake_vllm.body = fixture_text(CASES[case])
    client = await exporter_for(fake_vllm.url)
    got = engine_exposition(await scrape(client), fake_vllm.url)
    golden = GOLDEN / f"{case}.prom"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.write_text(got, encoding="utf-8")
    assert got == golden.read_text(encoding="utf-8"), f"exposition drifted from {golden}"


async def test_real_032_scrape_values(fake_vllm, exporter_for):
    """The figures the fixtures' README states for the real vLLM 0.32.0 capture."""
    client = await exporter_for(fake_vllm.url)
    text = await scrape(client)
    row = {"target": fake_vllm.url, "model_name": "tiny-llama", "engine": "0"}
    assert value(text, "vllm_cache_engine_up", target=fake_vllm.url) == 1
    assert value(text, "vllm_cache_engine_prefix_cache_queries_tokens_total", **row) == 9914
    assert value(text, "vllm_cache_engine_prefix_cache_hits_tokens_total", **row) == 6784
    assert value(text, "vllm_cache_engine_prompt_tokens_total", **row) == 9914
    assert value(text, "vllm_cache_engine_prompt_tokens_cached_total", **row) == 6784
    assert value(text, "vllm_cache_engine_kv_pool_tokens", **row) == 1_048_576
    assert value(text, "vllm_cache_engine_block_size_tokens", **row) == 32
    assert value(text, "vllm_cache_engine_prefix_caching_enabled", **row) == 1
    assert value(text, "vllm_cache_engine_preemptions_total", **row) == 0


async def test_old_names_read_as_the_same_signals(fake_vllm, exporter_for):
    fake_vllm.body = fixture_text("vllm-0.9-oldnames.prom")
    client = await exporter_for(fake_vllm.url)
    text = await scrape(client)
    row = {"target": fake_vllm.url, "model_name": "tiny-llama", "engine": "0"}
    assert value(text, "vllm_cache_engine_prefix_cache_hits_tokens_total", **row) == 6784
    # No kv_cache_size_tokens label: the pool is num_gpu_blocks x block_size.
    assert value(text, "vllm_cache_engine_kv_pool_tokens", **row) == 32768 * 32
    # prompt_tokens_cached does not exist before 0.16: absent and said so, never a 0.
    assert value(text, "vllm_cache_engine_prompt_tokens_cached_total", **row) is None
    assert (
        value(
            text,
            "vllm_cache_engine_metric_present",
            target=fake_vllm.url,
            signal="prompt_tokens_cached",
        )
        == 0
    )


async def test_033_sample_kv_used_tokens(fake_vllm, exporter_for):
    fake_vllm.body = fixture_text("vllm-0.33.0-sample.prom")
    client = await exporter_for(fake_vllm.url)
    text = await scrape(client)
    row = {"target": fake_vllm.url, "model_name": "meta-llama/Llama-3.1-8B-Instruct", "engine": "0"}
    assert value(text, "vllm_cache_engine_kv_pool_tokens", **row) == 845_552
    assert value(text, "vllm_cache_engine_kv_usage_ratio", **row) == pytest.approx(0.31876)
    assert value(text, "vllm_cache_engine_kv_used_tokens", **row) == round(0.31876 * 845_552)
    assert value(text, "vllm_cache_engine_preemptions_total", **row) == 21


@pytest.mark.parametrize("case", sorted(CASES))
async def test_promtool_check_metrics(case, fake_vllm, exporter_for, tmp_path):
    """promtool lints our own exposition: units, _total, HELP."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is required in CI (.ci/run installs Debian's prometheus)")
        pytest.skip("promtool not installed")
    fake_vllm.body = fixture_text(CASES[case])
    client = await exporter_for(fake_vllm.url)
    text = await scrape(client)
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_fixtures_are_the_real_ones():
    # Guard against an accidental edit of the recorded scrape the goldens rest on.
    text = (FIXTURES / "vllm-0.32.0-cpu/metrics_after.prom").read_text()
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 6784.0' in text
