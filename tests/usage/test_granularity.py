"""Where G comes from: configured, learned from cached counts, vLLM's block size, else 1."""

from __future__ import annotations

from exporter.engine.parse import parse
from exporter.metrics import build_registry
from exporter.signals.classify import PARTIAL, WARM
from exporter.signals.granularity import GranularityLearner
from exporter.values import UsageEvent
from tests.helpers import fixture_text
from tests.usage.conftest import make_state, value

TARGET = "http://vllm:8000/metrics"


def test_learns_the_gcd_once_enough_samples_agree():
    learner = GranularityLearner()
    counts = [
        4096,
        8192,
        2048 * 7,
        2048 * 3,
        2048 * 40,
        2048 * 11,
        2048 * 5,
        2048 * 2,
        2048 * 9,
        2048 * 13,
    ]
    learned = []
    for count in counts:
        learner.observe("m", count)
        learned.append(learner.learned("m"))
    # gcd: 4096, 4096, then 2048 from the third sample on; adopted when it has held for 8.
    assert learned[:9] == [None] * 9
    assert learned[9] == 2048
    assert learner.learned("other-model") is None


def test_zero_counts_carry_no_information():
    learner = GranularityLearner(min_agreeing=2)
    for count in (0, 0, 32, 0, 64):
        learner.observe("m", count)
    assert learner.learned("m") == 32


def test_a_tiny_gcd_is_not_adopted():
    """Counts that are not block-aligned (gcd 1 or 8) are not a granularity."""
    learner = GranularityLearner()
    for count in [1000 + i for i in range(20)]:
        learner.observe("m", count)
    assert learner.learned("m") is None
    learner = GranularityLearner()
    for count in [8 * (i + 3) for i in range(20)]:
        learner.observe("m", count)
    assert learner.learned("m") is None


def test_follows_a_reconfigured_engine_through_the_sliding_window():
    learner = GranularityLearner(window=16, min_agreeing=4)
    for index in range(16):
        learner.observe("m", 16 * (2 * index + 1))  # odd multiples of 16: G = 16
    assert learner.learned("m") == 16
    for index in range(40):  # the engine now caches in granules of 2,048
        learner.observe("m", 2048 * (index + 1))
    assert learner.learned("m") == 2048


def test_learned_granularity_classifies_and_is_exported_with_its_source():
    state = make_state()
    usage = state.usage
    # Before anything is known, the request's own count gives a provisional G (2,048 here):
    # 94.4% of a 91k prompt is already "warm", and no G is exported until it is learned.
    assert usage.record(UsageEvent("a", "qwen", 91_070, 86_016), "http") == WARM
    assert usage.granularities() == []
    for turn in range(10):
        usage.record(UsageEvent("a", "qwen", 30_000 + turn * 4_000, 2048 * (10 + turn)), "http")
    assert usage.granularity("qwen") == (2048, "learned")
    assert usage.record(UsageEvent("b", "qwen", 91_070, 86_016), "http") == WARM
    registry = build_registry(state)
    assert value(registry, "vllm_cache_granularity_tokens", model="qwen", source="learned") == 2048


def test_configured_granularity_wins():
    state = make_state(signals_granularity=32)
    for turn in range(10):
        state.usage.record(UsageEvent("a", "qwen", 30_000 + turn, 2048 * (10 + turn)), "http")
    assert state.usage.granularity("qwen") == (32, "configured")
    assert (
        value(
            build_registry(state),
            "vllm_cache_granularity_tokens",
            model="qwen",
            source="configured",
        )
        == 32
    )


def test_block_size_from_the_engine_until_learned():
    """The real vLLM 0.32 capture says block_size 32 (and prefix_match_unit None)."""
    state = make_state(vllm_url=(TARGET,))
    state.engine.record_success(
        TARGET, parse(fixture_text("vllm-0.32.0-cpu/metrics_after.prom")), 0.01, 1.0
    )
    usage = state.usage
    # 02_chat_warm.json: 1,396 prompt tokens, 1,376 cached.
    assert usage.record(UsageEvent("a", "tiny-llama", 1_396, 1_376), "http") == WARM
    assert usage.granularity("tiny-llama") == (32, "block_size")
    # One model served: its block size applies whatever the proxy calls the model.
    assert usage.granularity("litellm-alias") == (32, "block_size")
    assert (
        value(
            build_registry(state),
            "vllm_cache_granularity_tokens",
            model="tiny-llama",
            source="block_size",
        )
        == 32
    )


def test_prefix_match_unit_is_preferred_to_block_size():
    text = fixture_text("vllm-0.32.0-cpu/metrics_after.prom").replace(
        'prefix_match_unit="None"', 'prefix_match_unit="2048"'
    )
    state = make_state(vllm_url=(TARGET,))
    state.engine.record_success(TARGET, parse(text), 0.01, 1.0)
    state.usage.record(UsageEvent("a", "tiny-llama", 91_070, 86_016), "http")
    assert state.usage.granularity("tiny-llama") == (2048, "block_size")


def test_several_models_served_match_on_name_only():
    text = fixture_text("vllm-0.32.0-cpu/metrics_after.prom")
    other = (
        text.replace('model_name="tiny-llama"', 'model_name="other"')
        .replace('engine="0"', 'engine="1"')
        .replace('block_size="32"', 'block_size="16"')
    )
    state = make_state(vllm_url=(TARGET, "http://vllm2:8000/metrics"))
    state.engine.record_success(TARGET, parse(text), 0.01, 1.0)
    state.engine.record_success("http://vllm2:8000/metrics", parse(other), 0.01, 1.0)
    usage = state.usage
    for model in ("tiny-llama", "other", "unknown-model"):
        usage.record(UsageEvent("a", model, 100, 0), "http")
    assert usage.granularity("tiny-llama") == (32, "block_size")
    assert usage.granularity("other") == (16, "block_size")
    assert usage.granularity("unknown-model") == (1, "none")


def test_provisional_granularity_is_the_gcd_of_the_counts_so_far():
    """No power of two is assumed: the provisional G is the coarsest granule every count
    seen is a whole number of. Qwen3-Next on vLLM 0.32 caches in granules of 640: 5,120
    alone reads as 5,120 (a power-of-two reading said 1,024), then 4,480 narrows it to 640."""
    learner = GranularityLearner()
    assert learner.provisional("m") == 1  # nothing seen
    learner.observe("m", 5_120)
    assert learner.provisional("m") == 5_120
    learner.observe("m", 4_480)
    assert learner.provisional("m") == 640
    learner.observe("m", 384 * 3)  # 1,152: gcd 128
    assert learner.provisional("m") == 128
    learner.observe("m", 777 * 3)  # one count that is not block-aligned: left out
    assert learner.provisional("m") == 128
    learner.observe("m", 1_001)  # a second one: the counts are not aligned, no estimate
    assert learner.provisional("m") == 1
    learner.observe("other", 0)  # zeros carry nothing
    assert learner.provisional("other") == 1


def test_before_g_is_known_classification_narrows_with_the_counts():
    state = make_state()
    usage = state.usage
    assert usage.record(UsageEvent("a", "m1", 1_396, 1_376), "http") == WARM
    assert usage.record(UsageEvent("c", "m3", 3_000, 2_048), "http") == WARM
    # A granule of 640: the first count alone cannot say 5,120 of 10,000 is short of what
    # could be reused (G might be 5,120); with a second count G is 640, and 4,480 of 10,000
    # is well under the 9,600 a full hit would reuse.
    assert usage.record(UsageEvent("b", "m2", 10_000, 5_120), "http") == WARM
    assert usage.record(UsageEvent("d", "m2", 10_000, 4_480), "http") == PARTIAL


def test_a_stray_count_does_not_undo_an_adopted_granule():
    """One count that is no whole number of granules (a proxy's own, a request served
    elsewhere under the same name) is set aside; a second one within the window means the
    counts really are not aligned, and the learned value goes."""
    learner = GranularityLearner()
    for turn in range(2, 12):
        learner.observe("m", 2048 * turn)
    assert learner.learned("m") == 2048
    learner.observe("m", 1_000)
    assert learner.learned("m") == 2048
    for turn in range(3):
        learner.observe("m", 2048 * (turn + 20))
    assert learner.learned("m") == 2048
    learner.observe("m", 3_000)
    assert learner.learned("m") is None


def test_a_stray_count_before_adoption_is_left_out_too():
    learner = GranularityLearner()
    counts = [777, *(384 * turn for turn in (3, 5, 8, 11, 13, 16, 19, 21, 23))]
    for count in counts:
        learner.observe("m", count)
    assert learner.learned("m") == 384


def test_a_stray_count_leaves_with_the_window():
    learner = GranularityLearner(window=16, min_agreeing=4)
    for turn in range(1, 9):
        learner.observe("m", 640 * turn)
    learner.observe("m", 1_000)
    learner.observe("m", 1_001)  # two strays: the counts do not agree any more
    assert learner.learned("m") is None
    for turn in range(1, 30):  # both leave the window: 640 again
        learner.observe("m", 640 * (turn + 8))
    assert learner.learned("m") == 640


def test_a_hybrid_engine_gives_its_block_size_never_its_mamba_block_size():
    """vLLM 0.32 serving GraniteMoeHybrid (a real capture): block_size 2,048,
    mamba_cache_mode "align", and a stale mamba_block_size of 16. The granule is 2,048."""
    text = fixture_text("vllm-0.32.0-cpu-hybrid/granite-2048.prom")
    assert 'mamba_block_size="16"' in text and 'mamba_cache_mode="align"' in text
    state = make_state(vllm_url=(TARGET,))
    state.engine.record_success(TARGET, parse(text), 0.01, 1.0)
    assert state.usage.granularity("tiny-granite-2048") == (2048, "block_size")


def test_each_target_gives_its_own_models_granule():
    """Two vLLMs serving two hybrid models of different granules (real captures: 2,048 and
    384): each model is read from its own target's block_size, and learns its own gcd."""
    other = "http://vllm2:8000/metrics"
    state = make_state(vllm_url=(TARGET, other))
    for target, name in ((TARGET, "granite-2048"), (other, "nemotron-h-384")):
        text = fixture_text(f"vllm-0.32.0-cpu-hybrid/{name}.prom")
        state.engine.record_success(target, parse(text), 0.01, 1.0)
    usage = state.usage
    assert usage.granularity("tiny-granite-2048") == (2048, "block_size")
    assert usage.granularity("tiny-nemotron-h-384") == (384, "block_size")
    for turn in range(2, 12):
        usage.record(UsageEvent("a", "tiny-granite-2048", 2048 * turn + 100, 2048 * turn), "http")
        usage.record(UsageEvent("b", "tiny-nemotron-h-384", 384 * turn + 100, 384 * turn), "http")
    assert usage.granularity("tiny-granite-2048") == (2048, "learned")
    assert usage.granularity("tiny-nemotron-h-384") == (384, "learned")
