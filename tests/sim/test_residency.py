"""The simulator's --kv-cache-metrics: sampled blocks followed from allocation through their
prefix-cache hits to their eviction, served as vLLM's three residency histograms."""

from __future__ import annotations

import pytest

from exporter.sim import scenario as scenarios
from exporter.sim.engine import Engine, EngineConfig, EngineConfigError, Evicted
from exporter.sim.kvcache import RESIDENCY_HISTORY, CachedBlock, ResidencySampler, block_keys
from exporter.sim.metrics import SimMetrics
from tests.helpers import value
from tests.sim.conftest import played
from tests.sim.test_engine import request, settle, tokens

MODEL = "qwen3.8-27b"


def small_pool(**overrides: object) -> Engine:
    """Eight blocks of 32 tokens, prompts read and tokens made in microseconds: time is what
    the test submits."""
    values: dict[str, object] = {
        "block_size": 32,
        "kv_pool_tokens": 8 * 32,
        "enable_prefix_caching": True,
        "prefill_rate": 1e9,
        "decode_rate": 1e9,
        "kv_cache_metrics": True,
        "kv_cache_metrics_sample": 1.0,
    }
    values.update(overrides)
    return Engine(EngineConfig(**values))  # type: ignore[arg-type]


def submit_at(engine: Engine, prompt: list[int], at: float) -> list:
    engine.advance(at)
    engine.submit(request(prompt, 1, at), at)
    return settle(engine)


def test_a_conversation_evicted_by_another_reports_each_block_s_life():
    engine = small_pool()
    conversation = tokens(160)
    submit_at(engine, conversation[:96], 0.0)  # blocks 1-3 computed
    submit_at(engine, conversation[:128], 10.0)  # hits 1-3, computes block 4
    submit_at(engine, conversation, 30.0)  # hits 1-4, computes block 5
    evictions = [
        event
        for event in submit_at(engine, tokens(255, start=50_000), 50.0)
        if isinstance(event, Evicted)
    ]
    # The newcomer needs the whole pool: all five blocks go, the tail first.
    lives = [
        (
            round(e.residency.lifetime, 3),
            round(e.residency.idle, 3),
            tuple(round(gap, 3) for gap in e.residency.reuse_gaps),
        )
        for e in evictions
    ]
    assert lives == [
        (20.0, 20.0, ()),  # block 5: computed at 30, never hit
        (40.0, 20.0, ()),  # block 4: computed at 10, hit once at 30
        (50.0, 20.0, (20.0,)),  # blocks 1-3: computed at 0, hit at 10 and 30
        (50.0, 20.0, (20.0,)),
        (50.0, 20.0, (20.0,)),
    ]
    assert all(event.time == 50.0 and event.seq.prompt_tokens == 255 for event in evictions)


def test_only_the_last_hits_give_gaps_as_in_vllm():
    """vLLM keeps a block's last 4 accesses: at most 3 gaps per eviction."""
    sampler = ResidencySampler(1.0)
    block = CachedBlock(key=12345)
    sampler.allocated(block, 0.0)
    for when in (1.0, 3.0, 6.0, 10.0, 15.0, 21.0):
        sampler.hit(block, when)
    residency = sampler.evicted(block, 30.0)
    assert residency is not None
    assert residency.reuse_gaps == (4.0, 5.0, 6.0)
    assert len(residency.reuse_gaps) == RESIDENCY_HISTORY - 1
    assert (residency.lifetime, residency.idle) == (30.0, 9.0)
    assert sampler.evicted(block, 31.0) is None  # reported once
    assert sampler.lives == {}


def test_the_sample_follows_its_share_of_blocks():
    keys = block_keys(tokens(32 * 20_000), 32)
    for rate in (0.01, 0.1, 0.5):
        sampler = ResidencySampler(rate)
        share = sum(sampler.sampled(CachedBlock(key)) for key in keys) / len(keys)
        assert share == pytest.approx(rate, rel=0.15), rate
    assert all(ResidencySampler(1.0).sampled(CachedBlock(key)) for key in keys[:1000])


@pytest.mark.parametrize("sample", [0.0, -0.5, 1.5])
def test_a_sample_outside_0_to_1_is_refused(sample):
    with pytest.raises(EngineConfigError, match="kv_cache_metrics_sample"):
        EngineConfig(kv_cache_metrics=True, kv_cache_metrics_sample=sample)


def test_without_the_flag_nothing_is_followed_and_vllm_s_families_are_absent():
    engine = small_pool(kv_cache_metrics=False)
    submit_at(engine, tokens(160), 0.0)
    events = submit_at(engine, tokens(255, start=50_000), 5.0)
    assert engine.pool.evicted_blocks == 5
    assert not [event for event in events if isinstance(event, Evicted)]
    text = SimMetrics(engine.config).render(engine).decode()
    assert "vllm:kv_block_" not in text


def test_with_the_flag_the_families_exist_at_zero_then_count_evictions():
    engine = small_pool()
    metrics = SimMetrics(engine.config)
    before = metrics.render(engine).decode()
    labels = {"model_name": engine.config.served_model_name, "engine": "0"}
    for family in ("lifetime", "idle_before_evict", "reuse_gap"):
        assert value(before, f"vllm:kv_block_{family}_seconds_count", **labels) == 0
    conversation = tokens(160)
    for prompt, at in (
        (conversation[:96], 0.0),
        (conversation[:128], 10.0),
        (conversation, 30.0),
        (tokens(255, start=50_000), 50.0),
    ):
        for event in submit_at(engine, prompt, at):
            metrics.observe(event)
    after = metrics.render(engine).decode()
    assert value(after, "vllm:kv_block_lifetime_seconds_count", **labels) == 5
    assert value(after, "vllm:kv_block_lifetime_seconds_sum", **labels) == pytest.approx(
        20 + 40 + 3 * 50, abs=0.01
    )
    assert value(after, "vllm:kv_block_idle_before_evict_seconds_bucket", le="10.0", **labels) == 0
    assert (
        value(after, "vllm:kv_block_idle_before_evict_seconds_bucket", le="20.0", **labels) == 5
    )  # all idle since their last use at 30 s
    assert value(after, "vllm:kv_block_reuse_gap_seconds_count", **labels) == 3


def test_the_collapse_seen_from_inside():
    """two-agents-collapse: nothing is evicted while agent-a is alone; once agent-b arrives
    the evicted blocks are mostly ones no turn ever came back to (idle for their whole life),
    the conversations' prefixes gone before they return. two-agents-fit evicts nothing."""
    fit = played("two-agents-fit").metrics_text
    assert value(fit, "vllm:kv_block_idle_before_evict_seconds_count") == 0
    collapse = played("two-agents-collapse").metrics_text
    evictions = value(collapse, "vllm:kv_block_idle_before_evict_seconds_count")
    assert evictions and evictions > 100
    idle = value(collapse, "vllm:kv_block_idle_before_evict_seconds_sum")
    lifetime = value(collapse, "vllm:kv_block_lifetime_seconds_sum")
    assert idle / lifetime > 0.8
    gaps = value(collapse, "vllm:kv_block_reuse_gap_seconds_count")
    assert gaps / evictions < 0.5


def test_eviction_evidence_trails_the_hit_ratio_in_the_field_report_collapse(monkeypatch):
    """Why the collapse alert stays on the hit ratio (docs/runbook.md): in two-agents-collapse
    the engine's 5-minute hit ratio falls under half its healthy value before the evicted
    blocks' 5-minute idle share of their lifetime passes 0.8 (over 10 samples or more).
    The one eviction that causes the collapse (agent-b's arrival takes agent-a's checkpoint
    block) comes first, but alone it looks like any never-reused block a busy cache evicts;
    the burst after it is agent-a's own prefix blocks, reused every turn until then; only
    later are the evicted blocks ones no turn ever came back to."""
    from exporter.sim import virtual
    from exporter.sim.engine import Admitted

    events: list = []
    build = virtual.build_simulator

    def observed(config, clock=None):
        simulator = build(config, clock)
        simulator.runner.observers.append(events.append)
        return simulator

    monkeypatch.setattr(virtual, "build_simulator", observed)
    run = virtual.play(scenarios.load("two-agents-collapse"))
    assert run.stats.errors == 0
    window = 300.0
    arrival = scenarios.load("two-agents-collapse").agents[1].start
    lookups = [
        (e.time, e.seq.prompt_tokens, e.hit_tokens)
        for e in events
        if isinstance(e, Admitted) and not e.resumed
    ]
    evictions = [(e.time, e.residency) for e in events if isinstance(e, Evicted)]
    healthy = sum(hit for at, _, hit in lookups if at < arrival) / sum(
        queried for at, queried, _ in lookups if at < arrival
    )

    def first_time(condition) -> float:
        at = arrival
        while not condition(at):
            at += 15.0
            assert at < run.duration, "never"
        return at

    def ratio(at: float) -> bool:
        recent = [(queried, hit) for when, queried, hit in lookups if at - window < when <= at]
        queried = sum(queried for queried, _ in recent)
        return queried > 0 and sum(hit for _, hit in recent) / queried < 0.5 * healthy

    def idle_share(at: float) -> bool:
        # A share needs a few samples: a busy healthy cache evicts single never-reused blocks
        # (one-shot prompts, abandoned tails) all the time.
        recent = [residency for when, residency in evictions if at - window < when <= at]
        lifetime = sum(residency.lifetime for residency in recent)
        return len(recent) >= 10 and sum(r.idle for r in recent) / lifetime > 0.8

    assert first_time(ratio) + 60 < first_time(idle_share)
    first_eviction = min(when for when, _ in evictions)
    assert arrival <= first_eviction < first_time(ratio)


def test_the_residency_families_are_vllm_s():
    """Name, type, help, labels and buckets as vLLM 0.33 declares them (the derived fixture
    tests/fixtures/vllm-0.33.0-kv-cache-metrics.prom); and every family the simulator serves
    there exists in that exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.helpers import fixture_text

    def shapes(text: str) -> dict[str, tuple[str, str, set[str], list[str]]]:
        out = {}
        for family in text_string_to_metric_families(text):
            if family.name.startswith("vllm:kv_block_") and family.type == "histogram":
                out[family.name] = (
                    family.type,
                    family.documentation,
                    {frozenset(set(sample.labels) - {"le"}) for sample in family.samples},
                    [sample.labels["le"] for sample in family.samples if "le" in sample.labels],
                )
        return out

    engine = small_pool(served_model_name="meta-llama/Llama-3.1-8B-Instruct")
    ours = shapes(SimMetrics(engine.config).render(engine).decode())
    real = shapes(fixture_text("vllm-0.33.0-kv-cache-metrics.prom"))
    assert (
        set(ours)
        == set(real)
        == {
            "vllm:kv_block_lifetime_seconds",
            "vllm:kv_block_idle_before_evict_seconds",
            "vllm:kv_block_reuse_gap_seconds",
        }
    )
    for name in real:
        assert ours[name] == real[name], name
