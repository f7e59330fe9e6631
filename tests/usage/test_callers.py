"""Bounded, safe caller labels: the cap, __other__, the allowlist, aliases, hidden keys."""

from __future__ import annotations

import random

import pytest

from exporter.metrics import build_registry
from exporter.redaction import key_label
from exporter.signals.callers import OTHER, LabelCap, NamePolicy, looks_like_key, rank
from exporter.signals.usage import RETIRE_SECONDS
from exporter.values import UsageEvent
from tests.usage.conftest import FakeClock, make_state, value

KEYS = [
    "sk-proj-" + "Ab3dEf6hIj9kLm2nOp5qRs8t",
    "sk-1234",  # LiteLLM's documented master key
    "sk-ant-api03-" + "x" * 40,
    "ghp_" + "a1B2" * 9,
    "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz",
    "xoxb-123-456-abc",
    "AKIAIOSFODNN7EXAMPLE",
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig",
    "Bearer abc.def",
    "0123456789abcdef0123456789abcdef",  # a hex digest
    "Zx8Kq2Lm9Vb4Nc7Xs1Dw5Fe3Gr6Ht0Yj",  # random base62
]
NAMES = [
    "agent-1",
    "team-search-agent-2",
    "claude-code",
    "nightly-batch-2024-10-01",
    "6f1e2a0c-7b1d-4a58-9a3e-1c2b3d4e5f60",
    "MyServiceProductionAgent",
    "pk-search",
    "sess-caller",
    "rk-7",
]


@pytest.mark.parametrize("name", KEYS)
def test_key_like_names_are_shown_only_as_their_hash(name):
    assert NamePolicy().label(name) == key_label(name)


@pytest.mark.parametrize("name", NAMES)
def test_ordinary_names_are_kept(name):
    assert not looks_like_key(name)
    assert NamePolicy().label(name) == name


def test_a_key_is_never_a_label_only_its_short_hash():
    state = make_state()
    key = KEYS[0]
    state.usage.record(UsageEvent(key, "m", 100, 0), "http")
    from prometheus_client import generate_latest

    text = generate_latest(build_registry(state)).decode()
    assert key not in text
    assert "Ab3dEf6h" not in text
    hashed = key_label(key)
    assert hashed.startswith("key-") and len(hashed) == 16
    assert f'caller="{hashed}"' in text


def test_an_alias_can_name_a_hashed_key():
    key = KEYS[0]
    state = make_state(callers_alias=((key_label(key), "ci-bot"),))
    state.usage.record(UsageEvent(key, "m", 100, 0), "http")
    assert list(state.usage.series) == [("ci-bot", "m")]


def test_the_cap_keeps_the_callers_of_smallest_rank_and_counts_the_rest():
    state = make_state(callers_max=3)
    usage = state.usage
    names = [f"c{index}" for index in range(5)]
    kept = sorted(names, key=rank)[:3]
    for name in names:
        usage.record(UsageEvent(name, "m", 100, 0), "http")
    for name in names:  # memoized or decided again: the same answer
        usage.record(UsageEvent(name, "m", 100, 0), "http")
    registry = build_registry(state)
    assert {caller for caller, _ in usage.series} - {OTHER} <= set(names)
    assert set(usage.callers.admitted) == set(kept)
    for name in kept:
        assert value(registry, "vllm_cache_requests_total", caller=name, model="m", state="cold")
    # The second round of the two callers that lost is counted under __other__, and as an
    # overflow (the first may have been their own, until a caller of smaller rank came).
    assert value(registry, "vllm_cache_requests_total", caller=OTHER, model="m", state="cold") >= 2
    assert value(registry, "vllm_cache_callers_overflowed_total") >= 2


def test_two_exporters_fed_the_same_callers_in_other_orders_name_the_same_ones():
    """Naming is decided by rank, not arrival: a restart, or a second exporter behind the
    same gateway, names the same callers and details the same ones."""
    names = [f"agent-{index}" for index in range(1_000)]
    shuffled = list(names)
    random.Random(7).shuffle(shuffled)
    clock = FakeClock()
    states = [make_state(clock, callers_max=300, callers_detailed=20) for _ in range(2)]
    for state, order in zip(states, (names, shuffled), strict=True):
        for name in order:
            state.usage.record(UsageEvent(name, "m", 4096, 2048, ttft_seconds=0.2), "http")
    # Evicted callers' series are shown a while longer with their last counts, then go.
    clock.now += RETIRE_SECONDS
    for state, order in zip(states, (names, shuffled), strict=True):
        for name in reversed(order):  # the same traffic again, after every arrival
            state.usage.record(UsageEvent(name, "m", 4096, 2048, ttft_seconds=0.2), "http")
    first, second = (state.usage for state in states)
    assert set(first.series) == set(second.series)
    assert set(first.callers.admitted) == set(second.callers.admitted)
    assert set(first.callers.admitted) == set(sorted(names, key=rank)[:300])
    assert set(first.detailed.members) == set(second.detailed.members)
    assert set(first.detailed.members) == set(sorted(names, key=rank)[:20])
    # Only the detailed callers have TTFT histograms of their own; the rest are __other__'s.
    timed = {caller for (caller, _model), series in first.series.items() if series.ttft}
    assert timed == set(first.detailed.members) | {OTHER}


def test_allowlist_gets_a_label_past_the_cap_and_alias_renames():
    state = make_state(
        callers_max=1, callers_allow=("vip",), callers_alias=(("old-name", "new-name"),)
    )
    usage = state.usage
    usage.record(UsageEvent("old-name", "m", 100, 0), "http")  # takes the one free label
    usage.record(UsageEvent("vip", "m", 100, 0), "http")
    assert set(usage.series) == {("new-name", "m"), ("vip", "m")}
    # Of two callers for one label, the one of smaller rank has it.
    _loser, winner = sorted(("new-name", "someone"), key=rank, reverse=True)
    for name in ("someone", "old-name", "someone", "old-name"):
        usage.record(UsageEvent(name, "m", 100, 0), "http")
    assert set(usage.callers.admitted) == {winner}
    assert usage.callers_overflowed >= 2  # the loser's turns after it lost
    assert ("vip", "m") in usage.series  # allowed: never counted against the cap


def test_the_cap_survives_a_flood_of_distinct_names():
    """Memory stays bounded whatever the senders do (the memo is cleared, decisions kept)."""
    cap = LabelCap(max_labels=10, memo_size=100)
    labels = {cap.label(f"caller-{index}") for index in range(5_000)}
    assert labels == {f"caller-{index}" for index in range(10)} | {OTHER}
    assert len(cap._memo) <= 100
    assert cap.label("caller-3") == "caller-3"  # decided before the memo was cleared
    assert cap.label("caller-4999") == OTHER
    assert cap.overflowed == 4_990 + 1


def test_models_are_capped_too(monkeypatch):
    import exporter.signals.usage as usage_module

    monkeypatch.setattr(usage_module, "MAX_MODELS", 2)
    state = make_state()
    for index in range(5):
        state.usage.record(UsageEvent("a", f"model-{index}", 100, 0), "http")
    assert {model for _, model in state.usage.series} == {"model-0", "model-1", OTHER}
