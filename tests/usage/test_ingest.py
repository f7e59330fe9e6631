"""POST /v1/usage through the real aiohttp app: shapes, bad input, auth, size cap."""

from __future__ import annotations

import json

import pytest

from exporter.metrics import build_registry
from tests.helpers import scrape
from tests.usage.conftest import refused, value

GOOD = {
    "caller": "agent-1",
    "model": "tiny-llama",
    "prompt_tokens": 1396,
    "cached_tokens": 1376,
    "ttft_seconds": 0.4,
}


def ndjson(*objects: object) -> str:
    return "\n".join(json.dumps(obj) for obj in objects) + "\n"


def accepted(state) -> int:
    return sum(state.usage.events.values())


async def test_one_object(usage_client):
    client, state = await usage_client(signals_granularity=32)
    response = await client.post("/v1/usage", json=GOOD)
    assert response.status == 200
    assert await response.json() == {"accepted": 1, "rejected": 0, "errors": []}
    text = await scrape(client)
    assert 'vllm_cache_requests_total{caller="agent-1",model="tiny-llama",state="warm"} 1.0' in text


async def test_pretty_printed_object_and_array(usage_client):
    client, state = await usage_client()
    response = await client.post("/v1/usage", data=json.dumps(GOOD, indent=2))
    assert (await response.json())["accepted"] == 1
    response = await client.post("/v1/usage", data=json.dumps([GOOD, GOOD], indent=2))
    assert (await response.json())["accepted"] == 2
    assert accepted(state) == 3


async def test_ndjson_with_blank_lines_and_crlf(usage_client):
    client, state = await usage_client()
    body = ndjson(GOOD, GOOD).replace("\n", "\r\n") + "\n\n" + json.dumps(GOOD)
    response = await client.post("/v1/usage", data=body)
    assert await response.json() == {"accepted": 3, "rejected": 0, "errors": []}


async def test_a_partly_bad_batch_keeps_its_good_events(usage_client):
    client, state = await usage_client(signals_granularity=32)
    lines = [
        json.dumps(GOOD),
        '{"caller": "agent-1", "prompt_tokens": 10',  # malformed JSON
        json.dumps({**GOOD, "prompt_tokens": "many"}),
        json.dumps({**GOOD, "prompt_tokens": -5}),
        json.dumps({**GOOD, "cached_tokens": 2000}),
        json.dumps({**GOOD, "prompt_tokens": 10**8}),
        '{"caller": "agent-1", "prompt_tokens": NaN}',
        '{"caller": "agent-1", "prompt_tokens": 5, "ttft_seconds": Infinity}',
        json.dumps({**GOOD, "caller": "x" * 10_000}),
        json.dumps({**GOOD, "caller": "evil\u0007bell"}),
        json.dumps({k: v for k, v in GOOD.items() if k != "prompt_tokens"}),
        json.dumps({k: v for k, v in GOOD.items() if k != "caller"}),
        "[1, 2]",
        json.dumps(GOOD),
    ]
    response = await client.post("/v1/usage", data="\n".join(lines))
    assert response.status == 200
    reply = await response.json()
    assert reply["accepted"] == 2
    assert reply["rejected"] == 12
    assert [(e["index"], e["line"], e["reason"]) for e in reply["errors"]] == [
        (1, 2, "malformed_json"),
        (2, 3, "not_a_number"),
        (3, 4, "negative"),
        (4, 5, "cached_exceeds_prompt"),
        (5, 6, "too_large"),
        (6, 7, "not_finite"),
        (7, 8, "not_finite"),
        (8, 9, "caller_too_long"),
        (9, 10, "bad_caller"),
        (10, 11, "missing_prompt_tokens"),
        (11, 12, "missing_caller"),
        (12, 13, "not_an_object"),
    ]
    assert all(e["message"] for e in reply["errors"])
    registry = build_registry(state)
    assert (
        value(
            registry,
            "vllm_cache_requests_total",
            caller="agent-1",
            model="tiny-llama",
            state="warm",
        )
        == 2
    )
    assert value(registry, "vllm_cache_usage_events_total", reader="http") == 2
    assert (
        value(
            registry, "vllm_cache_usage_events_rejected_total", reader="http", reason="not_finite"
        )
        == 2
    )
    assert (
        value(
            registry,
            "vllm_cache_usage_events_rejected_total",
            reader="http",
            reason="malformed_json",
        )
        == 1
    )
    text = await scrape(client)
    assert "x" * 300 not in text
    assert "evil" not in text


async def test_array_with_bad_elements(usage_client):
    client, state = await usage_client()
    response = await client.post("/v1/usage", json=[GOOD, "nope", {**GOOD, "caller": None}, GOOD])
    reply = await response.json()
    assert reply["accepted"] == 2
    assert [(e["index"], e["reason"]) for e in reply["errors"]] == [
        (1, "not_an_object"),
        (2, "missing_caller"),
    ]
    assert "line" not in reply["errors"][0]


async def test_all_rejected_is_422_and_counted(usage_client):
    client, state = await usage_client()
    response = await client.post("/v1/usage", json={"caller": "a", "prompt_tokens": -1})
    assert response.status == 422
    assert (await response.json())["errors"][0]["reason"] == "negative"
    assert state.usage.rejected == {("http", "negative"): 1}
    assert accepted(state) == 0


@pytest.mark.parametrize("body", ["not json at all", "\xff\xfe garbage", "[1, 2"])
async def test_a_body_that_is_not_json_is_400(usage_client, body):
    client, state = await usage_client()
    data = body.encode("latin-1")
    response = await client.post("/v1/usage", data=data)
    assert response.status == 400
    reply = await response.json()
    assert reply["error"] == "bad_body" and reply["accepted"] == 0
    assert refused(state) == {"bad_body": 1}
    assert accepted(state) == 0


@pytest.mark.parametrize("body", [b"", b"   \n", b"\n\n", b"\xef\xbb\xbf", b"[]", b"[ ]\n"])
@pytest.mark.parametrize("encoding", ["identity", "gzip"])
async def test_a_body_without_events_is_an_empty_batch(usage_client, body, encoding):
    """docs/usage.md: 200 for an empty batch. No events at all (an empty body, blank lines,
    an empty array; sent as it is or gzipped) is a sender flushing an empty buffer: nothing
    accepted, nothing rejected, and no whole request counted as refused."""
    import gzip

    client, state = await usage_client()
    headers = {"Content-Encoding": "gzip"} if encoding == "gzip" else {}
    data = gzip.compress(body) if encoding == "gzip" else body
    response = await client.post("/v1/usage", data=data, headers=headers)
    assert response.status == 200
    assert await response.json() == {"accepted": 0, "rejected": 0, "errors": []}
    assert refused(state) == {} and accepted(state) == 0 and not state.usage.rejected


async def test_unknown_format_is_400(usage_client):
    client, state = await usage_client()
    response = await client.post("/v1/usage?format=yaml", json=GOOD)
    assert response.status == 400
    assert (await response.json())["error"] == "bad_format"
    response = await client.post("/v1/usage?format=mapping", json=GOOD)  # no mapping file
    assert response.status == 400
    assert accepted(state) == 0


async def test_token_required_when_set(usage_client):
    client, state = await usage_client(usage_ingest_token="s3cret-token")
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "s3cret-token"},
        {"Authorization": "Basic s3cret-token"},
        {"Authorization": "Bearer "},
    ):
        response = await client.post("/v1/usage", json=GOOD, headers=headers)
        assert response.status == 401, headers
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert (await response.json())["error"] == "unauthorized"
    assert accepted(state) == 0
    assert state.usage.series == {}
    assert refused(state) == {"unauthorized": 5}
    response = await client.post(
        "/v1/usage", json=GOOD, headers={"Authorization": "bearer s3cret-token"}
    )
    assert response.status == 200
    assert accepted(state) == 1
    text = await scrape(client)
    assert "s3cret" not in text


async def test_no_token_configured_means_open(usage_client):
    client, state = await usage_client()
    response = await client.post("/v1/usage", json=GOOD, headers={"Authorization": "Bearer x"})
    assert response.status == 200


async def test_body_over_the_cap_is_413(usage_client):
    client, state = await usage_client(usage_ingest_max_body_bytes=1000)
    body = ndjson(*[GOOD] * 20)
    assert len(body) > 1000
    response = await client.post("/v1/usage", data=body)
    assert response.status == 413
    reply = await response.json()
    assert reply["error"] == "body_too_large" and "1000" in reply["message"]
    assert accepted(state) == 0


async def test_chunked_body_over_the_cap_is_413(usage_client):
    client, state = await usage_client(usage_ingest_max_body_bytes=1000)

    async def chunks():
        for _ in range(50):
            yield (json.dumps(GOOD) + "\n").encode()

    response = await client.post("/v1/usage", data=chunks())
    assert response.status == 413
    assert (await response.json())["error"] == "body_too_large"
    assert accepted(state) == 0
    assert refused(state) == {"body_too_large": 1}
    # The server is still fine for the next sender.
    response = await client.post("/v1/usage", json=GOOD)
    assert response.status == 200


async def test_chunked_body_under_the_cap_is_read_whole(usage_client):
    client, state = await usage_client(usage_ingest_max_body_bytes=100_000)

    async def chunks():
        for _ in range(50):
            yield (json.dumps(GOOD) + "\n").encode()

    response = await client.post("/v1/usage", data=chunks())
    assert (await response.json())["accepted"] == 50


async def test_reply_lists_at_most_1000_errors_but_counts_all(usage_client):
    client, state = await usage_client()
    body = ndjson(*[{"caller": "a", "prompt_tokens": -1}] * 1500, GOOD)
    reply = await (await client.post("/v1/usage", data=body)).json()
    assert reply["accepted"] == 1 and reply["rejected"] == 1500
    assert len(reply["errors"]) == 1000 and reply["errors_truncated"] is True
    assert state.usage.rejected[("http", "negative")] == 1500


async def test_large_batches_are_processed_in_slices(usage_client, monkeypatch):
    import exporter.usage.ingest as ingest

    monkeypatch.setattr(ingest, "EVENTS_PER_SLICE", 7)
    client, state = await usage_client()
    body = ndjson(*[{**GOOD, "caller": f"c{i % 3}"} for i in range(100)])
    reply = await (await client.post("/v1/usage", data=body)).json()
    assert reply["accepted"] == 100
    assert (
        sum(s.requests["warm"] + s.requests["partial"] for s in state.usage.series.values()) == 100
    )


async def test_hostile_callers_through_the_app(usage_client):
    """Keys become short hashes, control characters and 10 kB names are refused: none of
    them ever reaches /metrics as it was sent."""
    client, state = await usage_client()
    key = "sk-proj-" + "Qw3rTy9UiOp2AsDf5GhJk8Lz"
    body = ndjson(
        {**GOOD, "caller": key},
        {**GOOD, "caller": "a\tb"},
        {**GOOD, "caller": "z" * 10_240},
        {**GOOD, "caller": "x\u202eevil"},
    )
    reply = await (await client.post("/v1/usage", data=body)).json()
    assert reply["accepted"] == 1
    assert [e["reason"] for e in reply["errors"]] == ["bad_caller", "caller_too_long", "bad_caller"]
    assert key not in json.dumps(reply)
    text = await scrape(client)
    assert key not in text and "Qw3rTy9U" not in text and "z" * 257 not in text
    assert 'caller="key-' in text


async def test_usage_exposition_passes_promtool(usage_client, tmp_path):
    import os
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is required in CI (.ci/run installs Debian's prometheus)")
        pytest.skip("promtool not installed")
    client, state = await usage_client(signals_granularity=32, usage_file=("/x/*.jsonl",))
    body = ndjson(
        GOOD,
        {**GOOD, "cached_tokens": 0, "queue_seconds": 0.1},
        {**GOOD, "cached_tokens": None, "caller": "b"},
        {**GOOD, "status": 500},
        {"caller": "c", "prompt_tokens": -1},
    )
    await client.post("/v1/usage", data=body)
    await client.post("/v1/usage", data="{", headers={})
    text = await scrape(client)
    assert "vllm_cache_ttft_seconds_bucket" in text
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
