"""Real hybrid engines: vLLM 0.32 (CPU) serving tiny random-weight hybrid models, built
offline (``build_model.py``), read by the exporter with no flag but the vLLM's URL.

Two architectures, one boot each, shared by every test of this module (``tests/vllm/
hybrid.py`` plays them): GraniteMoeHybrid, whose granule is 2,048 (the field reports'), and
NemotronH, whose granule is 384 (no power of two). Each is started with
``--max-num-batched-tokens`` at its granule: vLLM 0.32's CPU Mamba2 kernel ends the engine
when one step prefills more than one granule of a request. Granite's granule follows its
recurrent state's dtype, which vLLM's CPU build picks by host (float32 with AVX-512 BF16,
else bfloat16: 1,024), so both start with ``--mamba-ssm-cache-dtype float32``; a granule
other than the expected one fails before any conversation. Three conversations go through
the tap:
two of six turns, one of five whose last rewrites an early message. The same usage is then
posted to a second exporter through ``POST /v1/usage``. What must hold, as users read it:

- every cached count vLLM returns is a whole number of granules, the granule being the
  ``block_size`` of ``vllm:cache_config_info`` (its ``mamba_block_size`` is stale);
- first turns are cold, follow-ups warm, the rewritten history partial, through either reader;
- the granularity the exporter learns is that ``block_size``;
- the per-caller counters split vLLM's own hit and query counters exactly;
- while all three conversations decode a turn at once, the demand the exporter computes for
  them is within 10% of vLLM's own used KV tokens (and vLLM holds nothing once they finish);
- ``check`` names the granule and the CPU batching limit.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.engine.parse import parse
from exporter.signals.kvpool import layout
from tests.vllm import hybrid
from tests.vllm.harness import metric, vllm_counter
from tests.vllm.server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

HERE = Path(__file__).resolve().parent
DEMAND_TOLERANCE = 0.10


@pytest.fixture(scope="module", params=sorted(hybrid.ARCHITECTURES))
def played(
    request: pytest.FixtureRequest, vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[hybrid.Played]:
    architecture = request.param
    granule = hybrid.ARCHITECTURES[architecture]
    model_dir = tmp_path_factory.mktemp(architecture)
    built = subprocess.run(
        [str(vllm_python), str(HERE / "build_model.py"), str(model_dir), architecture],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if built.returncode != 0:
        pytest.fail(f"building {architecture} failed:\n{built.stderr[-3000:]}", pytrace=False)
    assert json.loads(built.stdout.strip().splitlines()[-1])["architecture"] == architecture
    model = f"tiny-{architecture}"
    server = VllmServer(
        vllm_python,
        model_dir,
        tmp_path_factory.mktemp(f"{architecture}-run"),
        architecture,
        hybrid.server_args(granule),
        served_model_name=model,
        base_args=hybrid.BASE_ARGS,
    )
    server.start()
    try:
        took = server.wait_ready()
        print(f"vLLM {architecture} healthy after {took:.1f}s on {server.url}")
        result = hybrid.Played(architecture, granule, model, server.url + "/metrics", took, {})
        asyncio.run(hybrid.play(result, server.url))
        result.cache_config = next(
            iter(_cache_configs(result.vllm_after))
        )  # the one engine's labels
        yield result
    except BaseException:
        print(f"\n----- last lines of {server.log_path} -----\n{server.log_tail()}")
        raise
    finally:
        server.stop()


def _cache_configs(text: str) -> Iterator[dict[str, str]]:
    from exporter.engine.parse import parse

    for config in parse(text).cache_configs.values():
        yield config.fields


def test_the_granule_is_the_block_size_vllm_chose(played: hybrid.Played) -> None:
    """Not a flag: vLLM raised the block until one attention page holds a state page."""
    fields = played.cache_config
    assert int(fields["block_size"]) == played.granule
    assert fields["mamba_cache_mode"] == "align"
    assert fields["mamba_block_size"] == "16", "stale on every hybrid vLLM 0.32 server"
    assert (
        metric(played.tap_text, "vllm_cache_engine_block_size_tokens", model_name=played.model)
        == played.granule
    )


def test_every_cached_count_is_whole_granules(played: hybrid.Played) -> None:
    counts = [turn.cached_tokens for turns in played.turns.values() for turn in turns]
    assert len(counts) == 2 * hybrid.TURNS + hybrid.EDIT_AFTER + 1
    assert all(count % played.granule == 0 for count in counts), counts
    assert sum(1 for count in counts if count) >= 8  # enough for the learner to adopt G


def test_first_turns_cold_follow_ups_warm_and_the_rewritten_history_partial(
    played: hybrid.Played,
) -> None:
    """Through the tap and through POST /v1/usage alike. Warm turns are well under 100%
    cached (whole granules, the last one re-read), and are warm all the same."""
    expected = {
        "alice": {"cold": 1, "warm": hybrid.TURNS - 1, "partial": 0},
        "bob": {"cold": 1, "warm": hybrid.TURNS - 1, "partial": 0},
        "carol": {"cold": 1, "warm": hybrid.EDIT_AFTER - 1, "partial": 1},
    }
    for text in (played.tap_text, played.ingest_text):
        for caller, states in expected.items():
            labels = {"caller": caller, "model": played.model}
            for state, count in states.items():
                assert metric(text, "vllm_cache_requests_total", state=state, **labels) == count, (
                    caller,
                    state,
                )
            for state in ("short", "unknown", "error"):
                assert metric(text, "vllm_cache_requests_total", state=state, **labels) == 0
    warm = [turn.cached_tokens / turn.prompt_tokens for turn in played.turns["alice"][1:]]
    assert min(warm) < 0.8, "warm turns far under a flat 90% rule's bar, warm all the same"
    # The rewrite: vLLM resumed at carol's first turn's last granule, far below what her
    # previous turn left cached.
    first, *_, before, rewritten = played.turns["carol"]
    assert rewritten.cached_tokens == (first.prompt_tokens - 1) // played.granule * played.granule
    assert (
        rewritten.cached_tokens
        < (before.prompt_tokens - 1) // played.granule * played.granule - 2 * played.granule
    )


def test_the_learned_granularity_is_the_block_size(played: hybrid.Played) -> None:
    for text in (played.tap_text, played.ingest_text):
        assert (
            metric(text, "vllm_cache_granularity_tokens", model=played.model, source="learned")
            == played.granule
        )


def test_per_caller_counters_split_vllms_own_exactly(played: hybrid.Played) -> None:
    """Each caller's hit ratio is its cached over its prompt tokens; summed over callers
    both are exactly what vLLM's own counters moved by."""
    hits = vllm_counter(played.vllm_after, "vllm:prefix_cache_hits_total") - vllm_counter(
        played.vllm_before, "vllm:prefix_cache_hits_total"
    )
    queries = vllm_counter(played.vllm_after, "vllm:prefix_cache_queries_total") - vllm_counter(
        played.vllm_before, "vllm:prefix_cache_queries_total"
    )
    for text in (played.tap_text, played.ingest_text):
        cached = prompt = 0.0
        for caller, turns in played.turns.items():
            labels = {"caller": caller, "model": played.model}
            caller_cached = metric(text, "vllm_cache_cached_tokens_total", **labels)
            caller_prompt = metric(text, "vllm_cache_prompt_tokens_total", **labels)
            assert caller_cached == sum(turn.cached_tokens for turn in turns)
            assert caller_prompt == sum(turn.prompt_tokens for turn in turns)
            cached += caller_cached or 0
            prompt += caller_prompt or 0
        assert (cached, prompt) == (hits, queries) and hits > 0


def test_the_demand_of_running_conversations_is_vllms_used_kv(played: hybrid.Played) -> None:
    """No --signals.state-tokens: the recurrent state comes from vllm:cache_config_info.
    While the three conversations decode a turn together, the demand the exporter computes
    from their last turns (each context in whole blocks, a state copy each, one more for a
    turn in flight) is within 10% of vLLM's own used KV tokens at the same scrapes (their
    median, each with or without the one in-flight state copy, which vLLM holds only while a
    step runs: on two loaded cores a scrape can fall between steps); no single scrape is
    further off than 10% plus that copy. Once they finish, vLLM holds nothing in use (their
    blocks stay cached, evictable)."""
    assert played.moments, "no scrape caught the three conversations decoding together"
    config = next(iter(parse(played.vllm_after).cache_configs.values()))
    pool = layout(config)
    assert pool is not None and pool.state_blocks > 0
    for moment in played.moments:
        assert moment.running == moment.conversations == len(hybrid.CALLERS)
        assert moment.used_tokens > 0
        assert (
            abs(moment.demand_tokens - moment.used_tokens)
            <= DEMAND_TOLERANCE * moment.used_tokens + pool.state_tokens
        ), moment
    # Each scrape against what vLLM held at it: within a step (the in-flight copy held) or
    # between two (not held); the median of those within 10%. (On a loaded CI machine only
    # one scrape may catch the three decoding together, between steps: 15,314 vs 13,893.)
    errors = sorted(
        min(
            abs(moment.demand_tokens - moment.used_tokens),
            abs(moment.demand_tokens - pool.state_tokens - moment.used_tokens),
        )
        / moment.used_tokens
        for moment in played.moments
    )
    assert errors[len(errors) // 2] <= DEMAND_TOLERANCE, played.moments
    print(
        f"{played.architecture}: demand vs vLLM's used KV tokens while running: "
        + ", ".join(f"{m.demand_tokens:,.0f} vs {m.used_tokens:,.0f}" for m in played.moments)
    )
    assert played.usage_after == 0.0


def test_check_names_the_granule_and_the_cpu_batching_limit(played: hybrid.Played) -> None:
    report = played.check
    assert report is not None and not report.problems, report.problems
    assert any(
        f"cached in whole {played.granule:,}-token granules: a warm turn re-reads its "
        "last granule" in line
        for line in report.lines
    ), report.lines
    assert any(
        f"keep --max-num-batched-tokens at {played.granule:,} or below" in note
        for note in report.notes
    ), report.notes
