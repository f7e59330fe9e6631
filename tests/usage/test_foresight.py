"""Foresight signals: live conversations against the pool, the smallest pool across vLLM
restarts and the budget under it, declared vs used completion tokens; every bound filled."""

from __future__ import annotations

import re

import msgspec
import pytest

from exporter.engine.parse import parse
from exporter.metrics import build_registry
from exporter.signals import foresight
from exporter.signals.engine import MAX_POOL_ENGINES, EngineState
from exporter.values import CacheConfig, EngineSnapshot, UsageEvent
from tests.helpers import fixture_text
from tests.usage.conftest import FakeClock, make_state, value

REAL = fixture_text("vllm-0.32.0-cpu/metrics_after.prom")  # tiny-llama, pool 1,048,576
TARGET = "http://vllm:8000/metrics"


def turn(
    caller: str,
    prompt: int,
    completion: int | None = 300,
    session: str | None = None,
    model: str = "qwen",
    **fields: object,
) -> UsageEvent:
    return UsageEvent(caller, model, prompt, 0, completion, session=session, **fields)  # type: ignore[arg-type]


def follow(state, event: UsageEvent, reader: str = "http") -> None:  # type: ignore[no-untyped-def]
    """``event`` as the follow-up of a first, shorter turn of its conversation: only a
    conversation that has had a follow-up counts as live demand."""
    first = msgspec.structs.replace(event, prompt_tokens=max(1, event.prompt_tokens - 1_000))
    state.usage.record(first, reader)
    state.usage.record(event, reader)


def demand(state, model: str = "qwen") -> tuple[float, float]:  # type: ignore[no-untyped-def]
    registry = build_registry(state)
    return (
        value(registry, "vllm_cache_conversations_active", model=model),
        value(registry, "vllm_cache_conversations_demand_tokens", model=model),
    )


def test_demand_is_the_latest_context_of_each_live_conversation():
    clock = FakeClock()
    state = make_state(clock)
    state.usage.record(turn("a", 60_000, session="s1"), "http")
    state.usage.record(turn("a", 62_300, session="s1"), "http")  # the same conversation grew
    follow(state, turn("a", 30_000, completion=None, session="s2"))
    follow(state, turn("b", 35_000))  # no session: the caller's conversation
    # A failed turn says nothing about what is cached.
    state.usage.record(turn("b", 0, completion=None, status=503), "http")
    assert demand(state) == (3, 62_600 + 30_000 + 35_300)


def test_a_conversation_stops_counting_after_the_idle_window():
    clock = FakeClock()
    state = make_state(clock, signals_conversation_idle=600.0)
    follow(state, turn("a", 60_000))
    clock.now += 300
    follow(state, turn("b", 35_000))
    clock.now += 300  # a's last turn is exactly 600 s old: still live
    assert demand(state) == (2, 95_600)
    clock.now += 1
    assert demand(state) == (1, 35_300)
    clock.now += 600
    assert demand(state) == (0, 0), "a model seen keeps its series, at 0"


def test_event_times_decide_liveness_so_a_replayed_file_is_not_live():
    clock = FakeClock()
    state = make_state(clock)
    follow(state, turn("old", 90_000, time=clock.now - 3_600), "file")
    follow(state, turn("new", 10_000, time=clock.now - 5), "file")
    assert demand(state) == (1, 10_300)


def test_a_configured_state_is_charged_per_conversation_and_for_the_turn_in_flight():
    """--signals.state-tokens: one copy per live conversation (the checkpoint its next turn
    resumes from) and one for the turn being computed (its live state); not on other models."""
    state = make_state(signals_state_tokens=(("qwen", 12_288),))
    follow(state, turn("a", 90_000))
    follow(state, turn("b", 35_000))
    follow(state, turn("c", 1_000, model="dense"))
    assert demand(state) == (2, 90_300 + 35_300 + 3 * 12_288)
    assert demand(state, "dense") == (1, 1_300)


def test_the_conversation_lru_is_bounded_and_counts_live_ones_it_forgets():
    """Filled past its cap with live conversations: it holds exactly the cap, the demand is
    that of the newest ones, and every live one forgotten is counted."""
    cap = 50
    state = make_state(signals_conversations_max=cap)
    for index in range(cap + 7):
        follow(state, turn(f"c{index}", 1_000 + index, completion=0))
    assert len(state.usage.conversations) == cap
    registry = build_registry(state)
    assert value(registry, "vllm_cache_conversations_dropped_total") == 7
    assert value(registry, "vllm_cache_conversations_active", model="qwen") == cap
    assert value(registry, "vllm_cache_conversations_demand_tokens", model="qwen") == sum(
        1_000 + index for index in range(7, cap + 7)
    )


def test_forgetting_an_idle_conversation_is_not_a_loss():
    clock = FakeClock()
    state = make_state(clock, signals_conversations_max=1)
    follow(state, turn("a", 1_000))
    clock.now += 3_600
    follow(state, turn("b", 2_000))
    assert value(build_registry(state), "vllm_cache_conversations_dropped_total") == 0


# ---- attribution -----------------------------------------------------------------------


def served(*rows: tuple[str, str]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for target, model in rows:
        out.setdefault(model, set()).add(target)
    return out


def test_attribution_by_model_name():
    one = served(("t1", "qwen"), ("t2", "llama"))
    assert foresight.attribute("qwen", one) == ("t1", "qwen")
    assert foresight.attribute("llama", one) == ("t2", "llama")
    assert foresight.attribute("mistral", one) is None  # two models, neither is it
    # one model on one target: a proxy's alias is that model
    assert foresight.attribute("my-alias", served(("t1", "qwen"))) == ("t1", "qwen")
    # replicas: the conversations are spread over pools that cannot be told apart
    assert foresight.attribute("qwen", served(("t1", "qwen"), ("t2", "qwen"))) is None
    assert foresight.attribute("alias", served(("t1", "qwen"), ("t2", "qwen"))) is None
    assert foresight.attribute("qwen", {}) is None


async def test_demand_is_attributed_to_the_vllm_serving_the_model():
    state = make_state(vllm_url=(TARGET,))
    state.engine.record_success(TARGET, parse(REAL), 0.01, 1.0)
    follow(state, turn("a", 1_000, model="tiny-llama"))
    follow(state, turn("b", 2_000, model="tiny-llama"))
    registry = build_registry(state)
    labels = {"target": TARGET, "model_name": "tiny-llama"}
    assert value(registry, "vllm_cache_engine_conversations_active", **labels) == 2
    # In whole blocks of 32 (each worth 32 of the pool's tokens on a dense model): 1,300
    # tokens hold 41 blocks, 2,300 hold 72.
    assert (
        value(registry, "vllm_cache_engine_conversations_demand_tokens", **labels) == (41 + 72) * 32
    )
    assert (
        value(registry, "vllm_cache_conversations_demand_tokens", model="tiny-llama")
        == (41 + 72) * 32
    )
    # the target goes down: nothing to attribute to, so no per-engine series
    state.engine.record_failure(TARGET, "connect", "refused", 0.01)
    registry = build_registry(state)
    assert registry.get_sample_value("vllm_cache_engine_conversations_active", labels) is None
    assert value(registry, "vllm_cache_conversations_active", model="tiny-llama") == 2


HYBRID = fixture_text("vllm-0.32.0-cpu-hybrid/granite-2048.prom")  # GraniteMoeHybrid, G 2,048


def test_a_hybrid_engine_says_what_its_conversations_hold_without_a_flag():
    """vLLM 0.32 serving GraniteMoeHybrid (a real capture): 512 blocks of 2,048 tokens,
    reported as an 883,011-token pool (26.947 requests of 32,768 tokens, each taking 16
    attention blocks and 3 reserved state blocks: one state group). A conversation holds its
    context in whole blocks plus one state block; the turn in flight one more. Each block is
    worth 883,011 / 512 of the pool's tokens."""
    state = make_state(vllm_url=(TARGET,))
    state.engine.record_success(TARGET, parse(HYBRID), 0.01, 1.0)
    model = "tiny-granite-2048"
    follow(state, turn("a", 7_000, completion=50, model=model))  # 4 blocks
    follow(state, turn("b", 20_000, completion=500, model=model))  # 11 blocks
    block = 883_011 / 512
    expected = round((4 + 11) * block) + 2 * round(block) + round(block)
    labels = {"target": TARGET, "model_name": model}
    registry = build_registry(state)
    assert value(registry, "vllm_cache_engine_conversations_demand_tokens", **labels) == expected
    assert value(registry, "vllm_cache_conversations_demand_tokens", model=model) == expected
    # --signals.state-tokens still overrides what the engine implies
    state = make_state(vllm_url=(TARGET,), signals_state_tokens=((model, 10_000),))
    state.engine.record_success(TARGET, parse(HYBRID), 0.01, 1.0)
    follow(state, turn("a", 7_000, completion=50, model=model))
    registry = build_registry(state)
    assert (
        value(registry, "vllm_cache_engine_conversations_demand_tokens", **labels)
        == round(4 * block) + 2 * 10_000
    )


@pytest.mark.parametrize(
    ("name", "block", "pool", "blocks", "state_blocks"),
    [
        ("granite-2048", 2048, 883_011, 512, 1),  # Mamba2, one state group
        ("nemotron-h-384", 384, 1_945_065, 5_461, 2),  # Mamba2, two state groups
        ("qwen3-next-640", 640, 1_987_925, 3_276, 1),  # gated DeltaNet, one state group
    ],
)
def test_the_pool_layout_of_real_hybrid_engines(
    name: str, block: int, pool: int, blocks: int, state_blocks: int
) -> None:
    """What vLLM 0.32's cache_config_info implies on three tiny hybrids (real captures): the
    granule is block_size, each block is worth pool / num_gpu_blocks, and the state groups
    come out of its concurrency arithmetic (measured: a decoding sequence held exactly one
    block per group beside its attention blocks)."""
    from exporter.signals.kvpool import granule, is_hybrid, layout

    config = parse(fixture_text(f"vllm-0.32.0-cpu-hybrid/{name}.prom")).cache_config_for("0")
    assert config is not None and is_hybrid(config)
    assert config.fields["mamba_block_size"] == "16"  # stale: never the granule
    assert granule(config) == block
    pool_layout = layout(config)
    assert pool_layout == foresight.PoolLayout(block, pool / blocks, state_blocks)


def test_a_dense_engine_has_no_state_and_blocks_worth_their_tokens():
    from exporter.signals.kvpool import is_hybrid, layout

    config = parse(REAL).cache_config_for("0")
    assert config is not None and not is_hybrid(config)
    assert layout(config) == foresight.PoolLayout(32, 32.0, 0)


# ---- the smallest pool across restarts, and the budget ----------------------------------------


def snapshot(pools: dict[str, int]) -> EngineSnapshot:
    return EngineSnapshot(
        engines={},
        present={},
        cache_configs={
            engine: CacheConfig(engine, {"kv_cache_size_tokens": str(pool)})
            for engine, pool in pools.items()
        },
    )


def test_the_smallest_pool_survives_restarts():
    engine = EngineState((TARGET,))
    for pool in (210_828, 193_732, 203_372):
        engine.record_success(TARGET, snapshot({"0": pool}), 0.0, 1.0)
    assert engine.targets[TARGET].smallest_pool == {"0": 193_732}
    assert foresight.admission_budget(193_732, 4096) == 189_636
    assert foresight.admission_budget(1_000, 4096) == 0


def test_the_smallest_pool_memory_is_bounded():
    engine = EngineState((TARGET,))
    for index in range(MAX_POOL_ENGINES + 10):
        engine.record_success(TARGET, snapshot({str(index): 1_000 + index}), 0.0, 1.0)
    kept = engine.targets[TARGET].smallest_pool
    assert len(kept) == MAX_POOL_ENGINES
    assert "0" not in kept and str(MAX_POOL_ENGINES + 9) in kept


def test_smallest_pool_and_budget_are_served_with_the_engine_row():
    state = make_state(vllm_url=(TARGET,), signals_admission_headroom=1_000)
    smaller = REAL.replace('kv_cache_size_tokens="1048576"', 'kv_cache_size_tokens="900000"')
    assert smaller != REAL
    state.engine.record_success(TARGET, parse(smaller), 0.01, 1.0)
    state.engine.record_success(TARGET, parse(REAL), 0.01, 2.0)
    registry = build_registry(state)
    labels = {"target": TARGET, "model_name": "tiny-llama", "engine": "0"}
    assert value(registry, "vllm_cache_engine_kv_pool_tokens", **labels) == 1_048_576
    assert value(registry, "vllm_cache_engine_kv_pool_min_tokens", **labels) == 900_000
    assert value(registry, "vllm_cache_engine_admission_budget_tokens", **labels) == 899_000


# ---- declared vs used completion tokens ----------------------------------------------------


def test_declared_and_used_completions_per_caller():
    state = make_state()
    for completion in (769, 800, 8_948):
        state.usage.record(turn("a", 1_000, completion=completion, max_tokens=65_536), "http")
    state.usage.record(turn("a", 1_000, completion=50), "http")  # declared nothing: not in it
    state.usage.record(turn("a", 1_000, completion=None, max_tokens=512), "http")  # no usage
    registry = build_registry(state)
    pair = {"caller": "a", "model": "qwen"}
    assert value(registry, "vllm_cache_completion_used_tokens_count", **pair) == 3
    assert value(registry, "vllm_cache_completion_used_tokens_sum", **pair) == 769 + 800 + 8_948
    assert value(registry, "vllm_cache_completion_declared_tokens_total", **pair) == 3 * 65_536
    assert value(registry, "vllm_cache_completion_used_tokens_bucket", le="1024.0", **pair) == 2
    assert value(registry, "vllm_cache_completion_used_tokens_bucket", le="8192.0", **pair) == 2
    assert value(registry, "vllm_cache_completion_used_tokens_bucket", le="12288.0", **pair) == 3


def test_a_caller_that_never_declares_has_no_completion_series():
    state = make_state()
    state.usage.record(turn("a", 1_000, completion=300), "http")
    registry = build_registry(state)
    assert (
        registry.get_sample_value(
            "vllm_cache_completion_used_tokens_count", {"caller": "a", "model": "qwen"}
        )
        is None
    )


@pytest.mark.new_series_hold
def test_completion_series_start_at_zero_while_held():
    clock = FakeClock()
    state = make_state(clock, usage_new_series_hold=60.0)
    state.usage.record(turn("a", 1_000, completion=800, max_tokens=65_536), "http")
    pair = {"caller": "a", "model": "qwen"}
    registry = build_registry(state)
    assert registry.get_sample_value("vllm_cache_completion_used_tokens_count", pair) == 0
    assert registry.get_sample_value("vllm_cache_completion_declared_tokens_total", pair) == 0
    clock.now += 61
    assert registry.get_sample_value("vllm_cache_completion_used_tokens_count", pair) == 1
    assert registry.get_sample_value("vllm_cache_completion_declared_tokens_total", pair) == 65_536


# ---- what counts as a conversation, and what ends one ---------------------------------------


def test_one_request_alone_is_no_conversation():
    """A record posted by hand (or a one-shot request) holds nothing a next turn wants: it
    counts as live demand only once its conversation has had a follow-up, a later turn whose
    prompt is longer. The same record sent again is no follow-up either."""
    state = make_state()
    state.usage.record(turn("a", 91_070, session="conv-42"), "http")
    assert demand(state) == (0, 0)
    state.usage.record(turn("a", 91_070, session="conv-42"), "http")
    assert demand(state) == (0, 0)
    state.usage.record(turn("a", 93_370, session="conv-42"), "http")
    assert demand(state) == (1, 93_670)


def restarted(text: str, seconds: float) -> str:
    """The exposition of the same vLLM started ``seconds`` later: every _created moved."""
    return re.sub(
        r"^(\S+_created(?:\{[^}]*\})?) (\S+)$",
        lambda m: f"{m.group(1)} {float(m.group(2)) + seconds!r}",
        text,
        flags=re.M,
    )


def counters_fallen(text: str) -> str:
    """The same process (its _created unchanged) with every counter read as 0: a glitch."""
    return re.sub(r"^(\S+_total(?:\{[^}]*\})?) (\S+)$", r"\1 0.0", text, flags=re.M)


CREATED = 1.7959921637417994e09  # the capture's _created times, about


def engine_demand(state) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    registry = build_registry(state)
    labels = {"target": TARGET, "model_name": "tiny-llama"}
    return (
        value(registry, "vllm_cache_engine_conversations_active", **labels),
        value(registry, "vllm_cache_engine_conversations_demand_tokens", **labels),
    )


def test_a_vllm_restart_ends_the_conversations_it_held():
    """vLLM restarts (a newer _created): what its conversations had cached is gone, so their
    demand leaves the fit at once; one that came back between the restart and the read that
    showed it still counts, and one that comes back later counts again from that turn, which
    is judged as a first turn (cold, not a follow-up the cache lost)."""
    clock = FakeClock()
    state = make_state(clock, vllm_url=(TARGET,))
    state.engine.record_success(TARGET, parse(REAL), 0.01, CREATED + 100)
    follow(state, turn("a", 2_000, model="tiny-llama"))
    follow(state, turn("b", 3_000, model="tiny-llama"))
    assert engine_demand(state) == (2, (72 + 104) * 32)
    # vLLM restarts 100 s later; b's next turn comes 50 s after that, before the exporter
    # reads the restarted vLLM, 100 s after the restart.
    clock.now += 150
    state.usage.record(turn("b", 3_500, model="tiny-llama"), "http")
    clock.now += 50
    state.engine.record_success(TARGET, parse(restarted(REAL, 900)), 0.01, CREATED + 1_000)
    assert engine_demand(state) == (1, 119 * 32), "only b, which came back, is live"
    assert value(build_registry(state), "vllm_cache_conversations_active", model="tiny-llama") == 1
    # a comes back: live again, its turn cold and a first turn (nothing was lost to eviction)
    followups = state.usage.series[("a", "tiny-llama")].followups
    clock.now += 30
    state.usage.record(turn("a", 2_500, model="tiny-llama"), "http")
    assert engine_demand(state) == (2, (88 + 119) * 32)
    series = state.usage.series[("a", "tiny-llama")]
    assert series.requests["cold"] == 3  # its two first turns and this one (0 cached)
    assert series.followups == followups
    assert state.usage.conversations.ended_by_restart == 1


def test_without_created_times_a_restart_ends_every_conversation_seen_before_the_read():
    """A vLLM exposing no _created (an old one) shows its restart by its counters falling:
    when it restarted within the last read interval cannot be told, so every conversation
    on it seen before the read ends (each counts again from its next turn)."""
    clock = FakeClock()
    state = make_state(clock, vllm_url=(TARGET,))
    bare = "\n".join(line for line in REAL.splitlines() if "_created" not in line) + "\n"
    state.engine.record_success(TARGET, parse(bare), 0.01, 100.0)
    follow(state, turn("a", 2_000, model="tiny-llama"))
    clock.now += 10
    state.engine.record_success(TARGET, parse(counters_fallen(bare)), 0.01, 115.0)
    assert state.engine.targets[TARGET].restarts == 1
    assert engine_demand(state) == (0, 0)


def test_a_glitch_or_another_vllm_restarting_ends_nothing():
    """Counters falling with their _created unchanged are a glitch, not a restart; and a
    restart of one vLLM ends only the conversations attributed to it."""
    other = "http://vllm-2:8000/metrics"
    clock = FakeClock()
    state = make_state(clock, vllm_url=(TARGET, other))
    granite = "tiny-granite-2048"
    state.engine.record_success(TARGET, parse(REAL), 0.01, CREATED + 100)
    state.engine.record_success(other, parse(HYBRID), 0.01, CREATED + 100)
    follow(state, turn("a", 2_000, model="tiny-llama"))
    follow(state, turn("b", 7_000, completion=50, model=granite))
    clock.now += 60
    state.engine.record_success(TARGET, parse(counters_fallen(REAL)), 0.01, CREATED + 160)
    assert state.engine.targets[TARGET].invalid["fell_without_restart"] > 0
    assert engine_demand(state) == (1, 72 * 32)
    state.engine.record_success(other, parse(restarted(HYBRID, 1_000)), 0.01, CREATED + 5_000)
    assert state.engine.targets[other].restarts == 1
    assert engine_demand(state) == (1, 72 * 32), "tiny-llama's vLLM did not restart"
    registry = build_registry(state)
    assert value(registry, "vllm_cache_conversations_active", model=granite) == 0


def test_behind_a_gateway_each_replica_holds_the_conversations_it_served():
    """One exporter reading two replicas of one model, the usage naming the replica that
    served each turn (``backend``: the tap's upstream, LiteLLM's api_base): each replica's
    demand is the conversations it served, and a restart of one ends only those. Without a
    backend the model's conversations cannot be placed (the pools cannot be told apart)."""
    other = "http://vllm-2:8000/metrics"
    clock = FakeClock()
    state = make_state(clock, vllm_url=(TARGET, other))
    for target in (TARGET, other):
        state.engine.record_success(target, parse(REAL), 0.01, CREATED + 100)
    on = {TARGET: "http://vllm:8000/v1", other: "http://vllm-2:8000/v1"}
    follow(state, turn("a", 2_000, model="tiny-llama", backend=on[TARGET]))
    follow(state, turn("b", 3_000, model="tiny-llama", backend=on[other]))
    follow(state, turn("c", 1_000, model="tiny-llama"))  # no backend: on neither

    def replica(target: str) -> tuple[float, float]:
        registry = build_registry(state)
        labels = {"target": target, "model_name": "tiny-llama"}
        return (
            value(registry, "vllm_cache_engine_conversations_active", **labels),
            value(registry, "vllm_cache_engine_conversations_demand_tokens", **labels),
        )

    assert replica(TARGET) == (1, 72 * 32)
    assert replica(other) == (1, 104 * 32)
    assert value(build_registry(state), "vllm_cache_conversations_active", model="tiny-llama") == 3
    # b moves to the first replica: its context is there now
    clock.now += 10
    state.usage.record(turn("b", 3_500, model="tiny-llama", backend=on[TARGET]), "http")
    assert replica(TARGET) == (2, (72 + 119) * 32)
    assert replica(other) == (0, 0), "a replica that served a conversation keeps its series"
    # the first replica restarts 30 s before it is read, after a's and b's last turns: they
    # hold nothing there any more; c is on neither
    clock.now += 60
    state.engine.record_success(TARGET, parse(restarted(REAL, 1_970)), 0.01, CREATED + 2_000)
    assert replica(TARGET) == (0, 0)
    assert state.usage.conversations.ended_by_restart == 2
    assert value(build_registry(state), "vllm_cache_conversations_active", model="tiny-llama") == 1
