"""Per-target counters: a caller's hit ratio on each vLLM replica that served it.

Behind a gateway with many replicas a caller's blended ratio (0.60) hides that one replica
lost its cache for it (0.0017 there, 0.88 on the others). The events name the replica
(``backend``: the tap's upstream, LiteLLM's api_base, a record's key); the series carry it as
``target``, the engine series' own label where the exporter reads that vLLM, so a rule can
join the two.
"""

from __future__ import annotations

import json

import pytest

from exporter.config import Config, metrics_url
from exporter.metrics import build_registry
from exporter.metrics.exposition import generate_text
from exporter.signals.callers import OTHER, rank
from exporter.signals.usage import (
    MAX_TARGET_CHARS,
    MISS_SERIES,
    RETIRE_SECONDS,
    SERIES_PER_CALLER,
    TARGET_SERIES,
    url_origin,
)
from exporter.usage.formats import LiteLLMFormat, MappingFormat
from exporter.values import UsageEvent
from exporter.wiring import signals_state
from tests.tap.conftest import Reply, fixture_bytes
from tests.usage.conftest import FakeClock, make_state, value

PROMPT = "vllm_cache_target_prompt_tokens_total"
CACHED = "vllm_cache_target_cached_tokens_total"
OVERFLOWED = "vllm_cache_targets_overflowed_total"
LITELLM_FIELDS = ("metadata.user_api_key_alias", "metadata.user_api_key_team_alias", "end_user")


def target_values(state, caller: str, model: str, target: str) -> tuple[float, float]:
    registry = build_registry(state)
    labels = {"caller": caller, "model": model, "target": target}
    return value(registry, PROMPT, **labels), value(registry, CACHED, **labels)


def targets_of(state) -> set[tuple[str, str, str]]:
    """Every (caller, model, target) the exposition has."""
    text = generate_text(build_registry(state)).decode()
    found = set()
    for line in text.splitlines():
        if line.startswith(PROMPT + "{"):
            labels = dict(
                part.split("=", 1) for part in line[len(PROMPT) + 1 : line.index("}")].split(",")
            )
            found.add(tuple(labels[name].strip('"') for name in ("caller", "model", "target")))
    return found


def test_url_origin_is_the_label_form_of_an_endpoint():
    assert url_origin("http://VLLM-7.svc:8000/v1/chat/completions") == "http://vllm-7.svc:8000"
    assert url_origin("https://u:secret@vllm:443/v1") == "https://vllm"
    assert url_origin("http://vllm:80") == "http://vllm"
    assert url_origin("http://[::1]:8000/v1") == "http://[::1]:8000"
    for not_a_url in ("replica-7", "vllm:8000", "http://", "http://h:99999/", "http://[::1/"):
        assert url_origin(not_a_url) is None
    # The fallback label is the one the exporter would give the vLLM as a --vllm.url.
    assert url_origin("http://vllm:8000/v1") + "/metrics" == metrics_url("http://vllm:8000")


def test_a_backend_read_by_the_exporter_takes_its_engine_label():
    """The same vLLM as a --vllm.url (by origin, credentials and path aside): the per-target
    series carry the engine series' target label exactly; another URL its origin and
    /metrics; a name as it is."""
    state = make_state(vllm_url=("http://admin:pw@VLLM-0:8000",))
    (engine_label,) = [target.shown for target in state.engine.targets.values()]
    assert engine_label == "http://redacted@vllm-0:8000/metrics"
    usage = state.usage
    assert usage.target_label("http://vllm-0:8000/v1") == engine_label
    assert usage.target_label("http://vllm-1:8000/v1/chat/completions") == (
        "http://vllm-1:8000/metrics"
    )
    assert usage.target_label("replica-7") == "replica-7"
    for backend in ("http://vllm-0:8000/v1", "http://vllm-1:8000/v1", "replica-7"):
        usage.record(UsageEvent("agent-a", "m", 1000, 500, backend=backend), "http")
    assert targets_of(state) == {
        ("agent-a", "m", engine_label),
        ("agent-a", "m", "http://vllm-1:8000/metrics"),
        ("agent-a", "m", "replica-7"),
    }
    # The engine series' target label is the very same text: a rule joins on it.
    registry = build_registry(state)
    assert registry.get_sample_value("vllm_cache_engine_up", {"target": engine_label}) == 0.0


def test_replicas_behind_one_address_are_told_apart_by_path():
    """Two vLLMs behind one address, told apart by path (a path-routing proxy): each
    backend takes its own engine target's label, whatever OpenAI path it names; replicas
    the exporter does not read get their own labels too, not one per address."""
    state = make_state(
        vllm_url=("http://proxy:8000/replica-0/metrics", "http://proxy:8000/replica-1/metrics")
    )
    shown = sorted(target.shown for target in state.engine.targets.values())
    assert shown == ["http://proxy:8000/replica-0/metrics", "http://proxy:8000/replica-1/metrics"]
    usage = state.usage
    assert usage.target_label("http://proxy:8000/replica-0") == shown[0]
    assert usage.target_label("http://proxy:8000/replica-1/v1") == shown[1]
    assert usage.target_label("http://proxy:8000/replica-1/v1/chat/completions") == shown[1]
    assert usage.target_label("http://PROXY:8000/replica-2/v1/") == (
        "http://proxy:8000/replica-2/metrics"
    )
    # An address with two engine targets and a path matching neither: not either's.
    assert usage.target_label("http://proxy:8000/v1") == "http://proxy:8000/metrics"
    # One engine target at an address: its label whatever the backend's path.
    single = make_state(vllm_url=("http://vllm-0:8000/custom/metrics",)).usage
    assert single.target_label("http://vllm-0:8000/v1") == "http://vllm-0:8000/custom/metrics"


def test_per_replica_ratios_that_the_blended_ratio_hides():
    """agent-a on three replicas: 0.88, 0.88 and 0.0017 per replica, 0.60 blended. The
    per-target counters sum to the caller's own."""
    state = make_state()
    usage = state.usage
    turns = {
        "http://vllm-1:8000/v1": (100_000, 88_000),
        "http://vllm-2:8000/v1": (100_000, 88_000),
        "http://vllm-7:8000/v1": (93_600, 160),
    }
    for backend, (prompt, cached) in turns.items():
        for _ in range(4):
            usage.record(
                UsageEvent("agent-a", "m", prompt // 4, cached // 4, backend=backend), "http"
            )
    ratios = {}
    for backend in turns:
        prompt, cached = target_values(state, "agent-a", "m", url_origin(backend) + "/metrics")
        ratios[backend] = cached / prompt
    assert [round(ratio, 4) for ratio in ratios.values()] == [0.88, 0.88, 0.0017]
    registry = build_registry(state)
    pair = {"caller": "agent-a", "model": "m"}
    prompt_total = value(registry, "vllm_cache_prompt_tokens_total", **pair)
    cached_total = value(registry, "vllm_cache_cached_tokens_total", **pair)
    assert round(cached_total / prompt_total, 2) == 0.60
    rows = [target_values(state, "agent-a", "m", url_origin(b) + "/metrics") for b in turns]
    assert sum(row[0] for row in rows) == prompt_total == 293_600
    assert sum(row[1] for row in rows) == cached_total


def test_events_without_a_backend_or_unreported_add_nothing():
    state = make_state()
    usage = state.usage
    usage.record(UsageEvent("a", "m", 1000, 500), "http")
    usage.record(UsageEvent("b", "m", 1000, None, backend="replica-1"), "http")  # unreported
    usage.record(UsageEvent("a", "m", 0, None, status=503, backend="replica-1"), "http")
    assert targets_of(state) == set()
    # no entry charged, no empty label (each pair's miss causes, its first success on)
    assert usage.exposed == 2 * (SERIES_PER_CALLER + MISS_SERIES)
    assert (
        "target="
        not in generate_text(build_registry(state))
        .decode()
        .replace("# HELP", "")
        .split("vllm_cache_target_prompt_tokens_total", 1)[-1]
        .split("\n# ")[0]
    )


async def test_the_taps_upstream_is_the_engine_target(upstream, start_tap):
    """The tap in front of the vLLM the exporter reads: its calls count under that vLLM's
    engine label, credentials of the upstream URL never in it."""
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("02_chat_warm.json")))
    host = upstream.url.split("://", 1)[1]
    config = Config(vllm_url=(upstream.url,))
    state = signals_state(config, clock=FakeClock())
    tap = await start_tap(usage=state.usage, upstream_url=f"http://user:pw@{host}")
    payload = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    await tap.post("/v1/chat/completions", payload, headers={"X-Caller": "agent-a"})
    assert state.usage.events["tap"] == 1
    (engine_label,) = [target.shown for target in state.engine.targets.values()]
    ((caller, model, target),) = targets_of(state)
    assert (caller, target) == ("agent-a", engine_label)
    assert "pw" not in target and "user" not in target
    reply = json.loads(fixture_bytes("02_chat_warm.json"))
    assert target_values(state, caller, model, target) == (
        reply["usage"]["prompt_tokens"],
        reply["usage"]["prompt_tokens_details"]["cached_tokens"],
    )


def test_litellm_and_mapping_backends_join_the_engine_target():
    state = make_state(vllm_url=("http://vllm:8000",))
    (engine_label,) = [target.shown for target in state.engine.targets.values()]
    payload = {
        "model": "hosted_vllm/m",
        "custom_llm_provider": "hosted_vllm",
        "end_user": "agent-b",
        "status": "success",
        "prompt_tokens": 100,
        "api_base": "http://vllm:8000/v1/chat/completions",
        "metadata": {"usage_object": {"prompt_tokens": 100, "prompt_tokens_details": {}}},
    }
    payload["metadata"]["usage_object"]["prompt_tokens_details"]["cached_tokens"] = 64
    state.usage.record(LiteLLMFormat(LITELLM_FIELDS)(payload), "http")
    mapping = MappingFormat(
        {"caller": "who", "prompt_tokens": "p", "cached_tokens": "c", "backend": "upstream"}
    )
    state.usage.record(
        mapping({"who": "agent-c", "p": 10, "c": 5, "upstream": "http://VLLM:8000/"}), "http"
    )
    assert targets_of(state) == {("agent-b", "m", engine_label), ("agent-c", "", engine_label)}
    assert target_values(state, "agent-b", "m", engine_label) == (100, 64)


@pytest.mark.parametrize(
    "backend",
    [
        "x" * (MAX_TARGET_CHARS + 1),  # a name too long for a label
        OTHER,  # the overflow label itself
    ],
)
def test_a_backend_that_cannot_be_a_label_is_folded_and_counted(backend):
    state = make_state()
    state.usage.record(UsageEvent("a", "m", 100, 50, backend=backend), "http")
    assert targets_of(state) == {("a", "m", OTHER)}
    assert value(build_registry(state), OVERFLOWED) == 1


def test_a_long_url_is_labelled_by_its_origin():
    state = make_state()
    backend = "http://vllm-9:8000/" + "p" * 200
    state.usage.record(UsageEvent("a", "m", 100, 50, backend=backend), "http")
    assert targets_of(state) == {("a", "m", "http://vllm-9:8000/metrics")}
    assert value(build_registry(state), OVERFLOWED) == 0


def test_past_targets_max_later_backends_are_other():
    """The first targets_max labels (the engine targets read first) keep their own; the
    rest count under __other__, each event counted in the overflow counter."""
    state = make_state(vllm_url=("http://vllm-0:8000",), callers_targets_max=3)
    usage = state.usage
    (engine_label,) = list(usage.target_labels)
    for index in range(1, 6):
        usage.record(UsageEvent("a", "m", 100, 10, backend=f"replica-{index}"), "http")
    usage.record(UsageEvent("a", "m", 100, 10, backend="replica-5"), "http")
    usage.record(UsageEvent("a", "m", 100, 10, backend="http://vllm-0:8000/v1"), "http")
    assert {target for _c, _m, target in targets_of(state)} == {
        "replica-1",
        "replica-2",
        OTHER,
        engine_label,
    }
    assert target_values(state, "a", "m", OTHER) == (400, 40)  # replica-3, 4, 5 and 5 again
    assert value(build_registry(state), OVERFLOWED) == 4
    assert usage.exposed == SERIES_PER_CALLER + MISS_SERIES + 4 * TARGET_SERIES


def test_target_entries_are_charged_and_refunded_on_retire():
    """Each (caller, model, target) costs TARGET_SERIES of the budget; past it, __other__'s
    entry for the target takes the tokens. An evicted caller's entries go with its series
    after the hold, and the budget has them back."""
    clock = FakeClock()
    pair = SERIES_PER_CALLER + MISS_SERIES  # with its first success, its miss causes
    state = make_state(clock, callers_max_series=pair + TARGET_SERIES, callers_max=1)
    usage = state.usage
    second, first = sorted(["agent-x", "agent-y"], key=rank)  # the second ranks first
    usage.record(UsageEvent(first, "m", 100, 50, backend="replica-1"), "http")
    assert usage.exposed == pair + TARGET_SERIES
    usage.record(UsageEvent(first, "m", 100, 50, backend="replica-2"), "http")  # no room
    assert usage.series_folded == 1
    assert targets_of(state) == {(first, "m", "replica-1"), (OTHER, "m", "replica-2")}
    # A caller of smaller rank takes the only caller label: the first is evicted, and its
    # series (target entries too) stay shown for the hold, still charged.
    usage.record(UsageEvent(second, "m", 100, 50, backend="replica-1"), "http")
    assert (first, "m", "replica-1") in targets_of(state)
    assert (second, "m", "replica-1") not in targets_of(state)  # no room: __other__'s
    held = usage.exposed
    clock.now += RETIRE_SECONDS + 1
    usage.record(UsageEvent(second, "m", 1, 0), "http")  # the next event retires them
    assert {row for row in targets_of(state) if row[0] == first} == set()
    assert usage.exposed == held - pair - TARGET_SERIES
    assert usage.exposed == sum(series.charged for series in usage.series.values())
    text = generate_text(build_registry(state)).decode()
    per_caller = [
        line
        for line in text.splitlines()
        if line.startswith(
            (
                "vllm_cache_requests_total",
                "vllm_cache_prompt_tokens_total",
                "vllm_cache_cached_tokens_total",
                "vllm_cache_unreported_prompt_tokens_total",
                "vllm_cache_missed_prompt_tokens_total",
                "vllm_cache_missed_requests_total",
                PROMPT,
                CACHED,
            )
        )
    ]
    assert len(per_caller) == usage.exposed


@pytest.mark.new_series_hold
def test_a_new_target_entry_shows_zero_during_the_hold():
    clock = FakeClock()
    state = make_state(clock, usage_new_series_hold=60.0)
    state.usage.record(UsageEvent("a", "m", 100, 50, backend="replica-1"), "http")
    assert target_values(state, "a", "m", "replica-1") == (0, 0)
    assert ("a", "m", "replica-1") in targets_of(state)
    clock.now += 61
    assert target_values(state, "a", "m", "replica-1") == (100, 50)


def test_the_fast_render_equals_the_reference_with_targets():
    """render_slices (cached label text, reused lines) writes what client_python's encoder
    writes from collect(), across renders as counts change."""
    from exporter.metrics.exposition import OPENMETRICS, TEXT, encode_families
    from exporter.metrics.usage import UsageCollector

    state = make_state()
    collector = UsageCollector(state.usage)
    for round_ in range(3):
        for index in range(40):
            backend = f"http://vllm-{index % 7}:8000/v1"
            state.usage.record(
                UsageEvent(f"c{index}", "m", 100 + round_, 50, backend=backend), "http"
            )
        for fmt in (TEXT, OPENMETRICS):
            fast: list[str] = []
            for _ in collector.render_slices(fast, fmt, series_per_slice=2):
                pass
            reference: list[str] = []
            encode_families(collector.collect(), reference, fmt)
            assert "".join(fast) == "".join(reference)
