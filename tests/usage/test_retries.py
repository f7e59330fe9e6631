"""Retried events and batches, forged caller names and inconsistent timings (issue 29),
through the real POST /v1/usage, a followed file and the tap."""

from __future__ import annotations

import dataclasses
import json
import tracemalloc

from exporter.config import Config
from exporter.metrics import build_registry
from exporter.redaction import key_label
from exporter.server import create_app
from exporter.signals.classify import WARM
from exporter.usage.ingest import IN_PROGRESS, batch_key
from exporter.values import MAX_EVENT_ID_CHARS, RecentKeys, UsageEvent
from exporter.wiring import file_follower, signals_state
from tests.tap.conftest import Reply, fixture_bytes
from tests.usage.conftest import FakeClock, refused, value

TURN = {
    "caller": "agent-1",
    "model": "m",
    "prompt_tokens": 4096,
    "cached_tokens": 4096,
    "session": "conv-1",
}


def ndjson(*objects: object) -> str:
    return "\n".join(json.dumps(obj) for obj in objects) + "\n"


async def start(aiohttp_client, clock: FakeClock | None = None, **overrides):
    config = dataclasses.replace(Config(signals_granularity=32), **overrides)
    state = signals_state(config, clock=clock or FakeClock())
    client = await aiohttp_client(create_app(config, state, initial_refresh=False))
    return client, state


def rejected(state, reason: str, reader: str = "http") -> int:
    return state.usage.rejected.get((reader, reason), 0)


def requests_of(state, caller: str = "agent-1", state_name: str = WARM) -> float:
    return value(
        build_registry(state),
        "vllm_cache_requests_total",
        caller=caller,
        model="m",
        state=state_name,
    )


# --- event ids ------------------------------------------------------------------------------


async def test_a_batch_retried_after_a_lost_reply_counts_once(aiohttp_client):
    """The same two turns posted again (the sender never saw the first reply): the copies are
    answered 200 so the sender stops, counted as duplicate, and counted nowhere else: not
    as requests, not as tokens, not as a warm follow-up of their own conversation."""
    client, state = await start(aiohttp_client)
    body = ndjson({**TURN, "id": "r1"}, {**TURN, "prompt_tokens": 8192, "id": "r2"})
    first = await client.post("/v1/usage", data=body)
    assert (first.status, await first.json()) == (200, {"accepted": 2, "rejected": 0, "errors": []})
    totals = state.usage.caller_totals()
    again = await client.post("/v1/usage", data=body)
    assert (again.status, await again.json()) == (
        200,
        {"accepted": 0, "rejected": 0, "errors": [], "duplicates": 2},
    )
    assert state.usage.caller_totals() == totals
    assert state.usage.events["http"] == 2
    assert rejected(state, "duplicate") == 2
    metrics = await (await client.get("/metrics")).text()
    assert 'vllm_cache_usage_events_rejected_total{reader="http",reason="duplicate"} 2.0' in metrics


async def test_ids_name_a_request_of_one_caller(aiohttp_client):
    """Two callers' proxies may number their requests alike: an id is compared within its
    caller only. Events without an id are never taken for copies."""
    client, state = await start(aiohttp_client)
    body = ndjson({**TURN, "id": "1"}, {**TURN, "caller": "agent-2", "id": "1"}, TURN, TURN)
    reply = await (await client.post("/v1/usage", data=body)).json()
    assert reply == {"accepted": 4, "rejected": 0, "errors": []}
    # Inside one body too: a line repeated with its id is a copy.
    reply = await (
        await client.post("/v1/usage", data=ndjson({**TURN, "id": "2"}, {**TURN, "id": "2"}))
    ).json()
    assert reply == {"accepted": 1, "rejected": 0, "errors": [], "duplicates": 1}


async def test_an_id_is_remembered_for_the_window_then_forgotten(aiohttp_client):
    clock = FakeClock()
    client, state = await start(aiohttp_client, clock, usage_dedup_window=600.0)
    line = ndjson({**TURN, "id": "late"})
    await client.post("/v1/usage", data=line)
    clock.now += 599.0
    assert (await (await client.post("/v1/usage", data=line)).json())["accepted"] == 0
    clock.now += 2 * 600.0  # past twice the window: surely forgotten
    assert (await (await client.post("/v1/usage", data=line)).json())["accepted"] == 1
    assert state.usage.events["http"] == 2


async def test_bad_ids_are_refused_with_their_reason(aiohttp_client):
    client, state = await start(aiohttp_client)
    body = ndjson(
        {**TURN, "id": ""},
        {**TURN, "id": "x" * (MAX_EVENT_ID_CHARS + 1)},
        {**TURN, "id": "tab\there"},
        {**TURN, "id": ["r"]},
        {**TURN, "id": 17},
        {**TURN, "id": "x" * MAX_EVENT_ID_CHARS},
    )
    reply = await (await client.post("/v1/usage", data=body)).json()
    assert (reply["accepted"], reply["rejected"]) == (2, 4)
    assert {error["reason"] for error in reply["errors"]} == {"bad_id"}
    assert rejected(state, "bad_id") == 4


def test_the_memory_of_ids_is_bounded_at_its_cap():
    """Filled past its cap with ids of the longest form: never more than the cap is held,
    the ids pushed out early are counted, and the memory stays under the documented 10 MB
    (about 90 bytes an id: each is kept as a hash)."""
    clock = FakeClock()
    state = signals_state(Config(), clock=clock)
    usage = state.usage
    cap = usage.event_ids.generation_keys * 2
    assert cap == 100_000
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    prefix = "x" * (MAX_EVENT_ID_CHARS - 8)
    for start_at in range(0, 250_000, 2000):
        usage.record_batch(
            [
                UsageEvent("agent-1", "m", 10, id=f"{prefix}{n:08d}")
                for n in range(start_at, start_at + 2000)
            ],
            "http",
        )
        assert len(usage.event_ids) <= cap
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert held < 10_000_000, held
    assert usage.event_ids.forgotten_early >= 100_000
    # The most recent half of the cap is still known: their copies count once.
    assert (
        usage.record_batch([UsageEvent("agent-1", "m", 10, id=f"{prefix}{249_999:08d}")], "http")
        == 1
    )


def test_recent_keys_keep_each_key_at_least_the_window_and_at_most_twice():
    keys = RecentKeys(max_keys=100, seconds=10.0)
    assert not keys.seen("a", 0.0)
    assert keys.seen("a", 9.9)
    assert not keys.seen("b", 10.0)  # a new generation begins; "a" is in the previous one
    assert keys.seen("a", 19.9)
    assert not keys.seen("a", 20.0)  # two windows after it began: gone
    # A wall clock stepped back a little changes nothing; one gone back far forgets all.
    assert keys.seen("a", 19.0)
    assert not keys.seen("a", -100.0)


async def test_a_followed_file_with_a_line_written_twice_counts_it_once(tmp_path):
    """A proxy that writes a record again after an error it took for a failed write: the
    file's copy counts as duplicate, under the file reader."""
    path = tmp_path / "usage.jsonl"
    path.write_text("")
    config = Config(usage_file=(str(path),), signals_granularity=32)
    state = signals_state(config, clock=FakeClock())
    follower = file_follower(config, state.usage)
    follower.poll()
    with path.open("a") as handle:
        handle.write(ndjson({**TURN, "id": "f1"}, {**TURN, "id": "f1"}, {**TURN, "id": "f2"}))
    while follower.poll():
        pass
    follower.close()
    assert state.usage.events["file"] == 2
    assert rejected(state, "duplicate", "file") == 1


# --- Idempotency-Key ---------------------------------------------------------------------------


async def test_a_batch_retried_with_its_idempotency_key_is_answered_as_before(aiohttp_client):
    """Events without ids, retried whole with the key: the first answer again (its status and
    counts, "duplicate": true), nothing counted twice, the repeat counted as a refused
    request of reason duplicate."""
    client, state = await start(aiohttp_client)
    body = ndjson(TURN, {**TURN, "prompt_tokens": -1})
    headers = {"Idempotency-Key": "batch-0001"}
    first = await client.post("/v1/usage", data=body, headers=headers)
    assert (await first.json())["accepted"] == 1
    totals = state.usage.caller_totals()
    again = await client.post("/v1/usage", data=body, headers=headers)
    reply = await again.json()
    assert again.status == 200
    assert (reply["accepted"], reply["rejected"], reply["duplicate"]) == (1, 1, True)
    assert state.usage.caller_totals() == totals
    assert state.usage.events["http"] == 1 and rejected(state, "negative") == 1
    assert refused(state) == {"duplicate": 1}
    # Another key is another batch.
    other = await client.post("/v1/usage", data=body, headers={"Idempotency-Key": "b-2"})
    assert (await other.json()).get("duplicate") is None
    assert state.usage.events["http"] == 2


async def test_a_refused_batch_keeps_no_key_and_a_rejected_one_answers_422_again(aiohttp_client):
    client, state = await start(aiohttp_client, usage_ingest_max_body_bytes=1000)
    headers = {"Idempotency-Key": "k1"}
    too_large = await client.post("/v1/usage", data=ndjson(*[TURN] * 20), headers=headers)
    assert too_large.status == 413
    retried = await client.post("/v1/usage", data=ndjson(TURN), headers=headers)
    assert (retried.status, (await retried.json())["accepted"]) == (200, 1)
    bad = ndjson({**TURN, "prompt_tokens": "many"})
    headers = {"Idempotency-Key": "k2"}
    assert (await client.post("/v1/usage", data=bad, headers=headers)).status == 422
    again = await client.post("/v1/usage", data=bad, headers=headers)
    assert again.status == 422 and (await again.json())["duplicate"] is True
    assert rejected(state, "not_a_number") == 1


async def test_malformed_and_in_progress_keys(aiohttp_client):
    client, state = await start(aiohttp_client)
    for key in ("", "x" * 256, "with space", "caf\u00e9".encode().decode("latin-1")):
        response = await client.post(
            "/v1/usage", data=ndjson(TURN), headers={"Idempotency-Key": key}
        )
        assert response.status == 400, key
        assert (await response.json())["error"] == "bad_idempotency_key"
    # A first request with the key still being processed (its slices yield to the loop):
    # the ingest keeps its keys in the usage state.
    state.usage.batch_keys.put(batch_key("busy"), IN_PROGRESS, state.usage.now())
    busy = await client.post("/v1/usage", data=ndjson(TURN), headers={"Idempotency-Key": "busy"})
    assert busy.status == 409 and busy.headers["Retry-After"] == "1"
    assert state.usage.events["http"] == 0
    assert refused(state) == {"bad_idempotency_key": 4, "in_progress": 1}


async def test_the_memory_of_batch_keys_is_bounded(aiohttp_client):
    """With --usage.dedup.max-ids 20 the ingest keeps 2 keys at most (a tenth): a third
    pushes the first out early, counted, and its retry is counted again."""
    client, state = await start(aiohttp_client, usage_dedup_max_ids=20)
    for key in ("a", "b", "c", "d"):
        await client.post("/v1/usage", data=ndjson(TURN), headers={"Idempotency-Key": key})
        assert len(state.usage.batch_keys) <= 2
    assert state.usage.batch_keys.forgotten_early >= 1
    await client.post("/v1/usage", data=ndjson(TURN), headers={"Idempotency-Key": "a"})
    assert state.usage.events["http"] == 5
    metrics = await (await client.get("/metrics")).text()
    assert 'vllm_cache_usage_ids_forgotten_early_total{kind="idempotency_key"}' in metrics


# --- reserved caller names ----------------------------------------------------------------------

FORGED = [
    "__other__",
    "__OTHER__",
    " __other__ ",
    "key-0123456789ab",
    "KEY-0123456789AB",
    "key-abcdefABCDEF",
]


async def test_callers_may_not_take_the_names_the_exporter_gives(aiohttp_client):
    """The overflow label and the form of a hashed key are refused as callers (every time:
    also on the quick reading of a line seen before), so an alias of a hash renames only the
    key the exporter hashed. Names that merely resemble them are names."""
    client, state = await start(aiohttp_client, callers_alias=(("key-0123456789ab", "billing"),))
    for _ in range(2):
        reply = await (
            await client.post(
                "/v1/usage", data=ndjson(*[{**TURN, "caller": name} for name in FORGED])
            )
        ).json()
        assert reply["accepted"] == 0
        assert {error["reason"] for error in reply["errors"]} == {"reserved_caller"}
    assert rejected(state, "reserved_caller") == 2 * len(FORGED)
    near = ["key-0123456789abc", "key-0123456789ag", "other", "_other_", "anonymous"]
    reply = await (
        await client.post("/v1/usage", data=ndjson(*[{**TURN, "caller": name} for name in near]))
    ).json()
    assert reply["accepted"] == len(near)
    metrics = await (await client.get("/metrics")).text()
    samples = [line for line in metrics.splitlines() if not line.startswith("#")]
    assert [
        line for line in samples if 'caller="billing"' in line or 'caller="__other__"' in line
    ] == []


async def test_only_the_taps_own_hash_of_a_key_may_have_the_hashed_form(
    upstream, start_tap, aiohttp_client
):
    """Through the tap: a caller header or body user of the hashed form is refused
    (counted under the tap), the tap's own hash of a key is counted and aliased; and a
    sender posting that hash to /v1/usage afterwards is still refused."""
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("02_chat_warm.json")))
    api_key = "sk-live-0123456789abcdefghij"
    hashed = key_label(api_key)
    config = Config(callers_alias=((hashed, "billing"),))
    state = signals_state(config, clock=FakeClock())
    tap = await start_tap(usage=state.usage)
    payload = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    await tap.post("/v1/chat/completions", payload, headers={"X-Caller": hashed})
    await tap.post("/v1/chat/completions", {**payload, "user": "__other__"})
    assert state.usage.rejected.get(("tap", "reserved_caller")) == 2
    await tap.post("/v1/chat/completions", payload, headers={"Authorization": f"Bearer {api_key}"})
    assert state.usage.events["tap"] == 1
    client = await aiohttp_client(create_app(config, state, initial_refresh=False))
    reply = await (await client.post("/v1/usage", data=ndjson({**TURN, "caller": hashed}))).json()
    assert reply["errors"][0]["reason"] == "reserved_caller"
    metrics = await (await client.get("/metrics")).text()
    assert 'vllm_cache_requests_total{caller="billing"' in metrics


# --- timings -----------------------------------------------------------------------------------


async def test_a_queue_wait_longer_than_its_ttft_drops_both_and_keeps_the_event(
    aiohttp_client, tmp_path
):
    """queue_seconds 3 s inside a TTFT of 1 s: the event's tokens and state count, neither
    timing does (no TTFT in the 0.05 s bucket), counted under queue_exceeds_ttft. A wait a
    few ms past the TTFT is a turn whose engine part is too short to see (TTFT 0)."""
    client, state = await start(aiohttp_client)
    body = ndjson(
        {**TURN, "ttft_seconds": 1.0, "queue_seconds": 3.0},
        {**TURN, "session": "conv-2", "ttft_seconds": 0.2, "queue_seconds": 0.205},
    )
    reply = await (await client.post("/v1/usage", data=body)).json()
    assert reply == {"accepted": 2, "rejected": 0, "errors": []}
    registry = build_registry(state)
    labels = {"caller": "agent-1", "model": "m", "source": "proxy"}
    assert requests_of(state) == 2
    assert value(registry, "vllm_cache_ttft_seconds_count", state=WARM, **labels) == 1
    assert value(registry, "vllm_cache_queue_wait_seconds_count", **labels) == 1
    assert value(registry, "vllm_cache_queue_wait_seconds_sum", **labels) == 0.205
    assert (
        value(
            registry,
            "vllm_cache_usage_timings_dropped_total",
            reader="http",
            reason="queue_exceeds_ttft",
        )
        == 1
    )
    # The same from a followed file.
    path = tmp_path / "usage.jsonl"
    path.write_text(ndjson({**TURN, "ttft_seconds": 1.0, "queue_seconds": 3.0}))
    config = Config(usage_file=(str(path),), usage_file_from_start=True)
    follower = file_follower(config, state.usage)
    while follower.poll():
        pass
    follower.close()
    assert state.usage.timings_dropped[("file", "queue_exceeds_ttft")] == 1
    assert state.usage.events["file"] == 1
