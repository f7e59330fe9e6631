"""Bounded, safe caller labels: the cap, __other__, the allowlist, aliases, hidden keys."""

from __future__ import annotations

import pytest

from exporter.metrics import build_registry
from exporter.redaction import key_label
from exporter.signals.callers import OTHER, LabelCap, NamePolicy, looks_like_key
from exporter.values import UsageEvent
from tests.usage.conftest import make_state, value

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


def test_cap_sends_later_callers_to_other_and_counts_them():
    state = make_state(callers_max=3)
    usage = state.usage
    for index in range(5):
        usage.record(UsageEvent(f"c{index}", "m", 100, 0), "http")
    usage.record(UsageEvent("c4", "m", 100, 0), "http")  # memoized: still counted
    usage.record(UsageEvent("c0", "m", 100, 0), "http")  # admitted: not an overflow
    registry = build_registry(state)
    callers = {caller for caller, _ in usage.series}
    assert callers == {"c0", "c1", "c2", OTHER}
    assert value(registry, "vllm_cache_callers_overflowed_total") == 3
    assert value(registry, "vllm_cache_requests_total", caller=OTHER, model="m", state="cold") == 3
    assert value(registry, "vllm_cache_requests_total", caller="c0", model="m", state="cold") == 2


def test_allowlist_gets_a_label_past_the_cap_and_alias_renames():
    state = make_state(
        callers_max=1, callers_allow=("vip",), callers_alias=(("old-name", "new-name"),)
    )
    usage = state.usage
    usage.record(UsageEvent("old-name", "m", 100, 0), "http")  # takes the one free label
    usage.record(UsageEvent("someone", "m", 100, 0), "http")
    usage.record(UsageEvent("vip", "m", 100, 0), "http")
    assert set(usage.series) == {("new-name", "m"), (OTHER, "m"), ("vip", "m")}
    assert usage.callers_overflowed == 1


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
