"""Whole (non-streamed) answers and every other path: the client gets what vLLM sent,
byte for byte, and each chat/completions/responses call becomes one event."""

from __future__ import annotations

import json

from yarl import URL

from .conftest import Reply, fixture_bytes

CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def test_chat_body_passes_byte_for_byte_and_is_recorded(upstream, start_tap):
    body = fixture_bytes("01_chat_cold.json")
    upstream.reply("/v1/chat/completions", Reply(body=body, headers={"X-Request-Id": "r-1"}))
    tap = await start_tap()
    status, headers, received = await tap.post(
        "/v1/chat/completions", CHAT, headers={"X-Caller": "alice"}
    )
    assert status == 200
    assert received == body
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Request-Id"] == "r-1"
    event = await tap.usage.next_event()
    assert (
        event.caller,
        event.model,
        event.prompt_tokens,
        event.cached_tokens,
        event.completion_tokens,
        event.status,
    ) == ("alice", "tiny-llama", 1395, 0, 8, 200)
    assert event.ttft_seconds is None  # a whole answer has no first-token time
    assert tap.usage.rejected == []


async def test_request_body_reaches_vllm_unchanged(upstream, start_tap):
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("02_chat_warm.json")))
    tap = await start_tap()
    raw = b'{"model": "tiny-llama",  "messages": [{"role":"user","content":"h\\u00e9"}]}'
    await tap.post(
        "/v1/chat/completions",
        data=raw,
        headers={"Authorization": "Bearer sk-abc", "X-Custom": "1"},
    )
    (seen,) = upstream.received
    assert seen.body == raw
    assert seen.headers["Authorization"] == "Bearer sk-abc"
    assert seen.headers["X-Custom"] == "1"
    assert (await tap.usage.next_event()).cached_tokens == 1376


async def test_completions_carry_only_cached_tokens(upstream, start_tap):
    upstream.reply("/v1/completions", Reply(body=fixture_bytes("05_completion_repeat.json")))
    tap = await start_tap()
    status, _, body = await tap.post("/v1/completions", {"model": "tiny-llama", "prompt": "x"})
    assert status == 200 and body == fixture_bytes("05_completion_repeat.json")
    event = await tap.usage.next_event()
    assert (event.prompt_tokens, event.cached_tokens) == (1373, 1344)


async def test_responses_api_reads_input_tokens_details(upstream, start_tap):
    upstream.reply("/v1/responses", Reply(body=fixture_bytes("10_responses_warm.json")))
    tap = await start_tap()
    status, _, body = await tap.post("/v1/responses", {"model": "tiny-llama", "input": "x"})
    assert status == 200 and body == fixture_bytes("10_responses_warm.json")
    event = await tap.usage.next_event()
    assert (event.prompt_tokens, event.cached_tokens, event.completion_tokens) == (268, 256, 4)


async def test_an_answer_over_256_kib_is_read_off_the_loop_and_relayed_unchanged(
    upstream, start_tap
):
    """Past PARSE_INLINE_MAX_BYTES the answer's JSON is decoded in a worker thread, before
    it is sent; the client gets it byte for byte, and its usage or its fault is counted."""
    answer = json.loads(fixture_bytes("02_chat_warm.json"))
    answer["choices"][0]["message"]["content"] = "tok " * 80_000  # 320 KB
    body = json.dumps(answer).encode()
    assert len(body) > 256 * 1024
    upstream.reply("/v1/chat/completions", Reply(body=body))
    tap = await start_tap()
    status, _, received = await tap.post("/v1/chat/completions", CHAT)
    assert (status, received) == (200, body)
    event = await tap.usage.next_event()
    assert (event.prompt_tokens, event.cached_tokens) == (1396, 1376)

    broken = body[:-1]  # cut short: not JSON
    upstream.reply("/v1/chat/completions", Reply(body=broken))
    status, _, received = await tap.post("/v1/chat/completions", CHAT)
    assert (status, received) == (200, broken)
    assert tap.usage.rejected == [("tap", "malformed_response")]
    assert len(tap.usage.events) == 1


async def test_missing_prompt_tokens_details_is_not_reported_not_zero(upstream, start_tap):
    """vLLM without --enable-prompt-tokens-details: prompt_tokens_details is null."""
    answer = json.loads(fixture_bytes("02_chat_warm.json"))
    answer["usage"]["prompt_tokens_details"] = None
    upstream.reply("/v1/chat/completions", Reply(body=json.dumps(answer).encode()))
    tap = await start_tap()
    await tap.post("/v1/chat/completions", CHAT)
    event = await tap.usage.next_event()
    assert event.prompt_tokens == 1396
    assert event.cached_tokens is None


async def test_other_paths_are_proxied_untouched_and_not_recorded(upstream, start_tap):
    models = fixture_bytes("models.json")
    metrics = fixture_bytes("metrics_after.prom")
    upstream.reply("/v1/models", Reply(body=models))
    upstream.reply("/metrics", Reply(body=metrics, content_type="text/plain; version=0.0.4"))
    upstream.reply("/health", Reply(body=b""))
    upstream.reply("/tokenize", Reply(body=b'{"count":3,"tokens":[1,2,3]}'))
    tap = await start_tap()
    async with tap.session.get(tap.url + "/v1/models") as response:
        assert response.status == 200 and await response.read() == models
    # encoded=True: the test client must not normalise the query either.
    async with tap.session.get(URL(tap.url + "/metrics?name[]=x%20y", encoded=True)) as response:
        assert response.status == 200 and await response.read() == metrics
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4"
    async with tap.session.get(tap.url + "/health") as response:
        assert response.status == 200 and await response.read() == b""
    status, _, body = await tap.post("/tokenize", {"prompt": "abc"})
    assert (status, body) == (200, b'{"count":3,"tokens":[1,2,3]}')
    async with tap.session.delete(tap.url + "/nowhere/at/all?a=1") as response:
        assert response.status == 404
        assert response.headers["X-Mock"] == "404"
        assert await response.read() == b"no route /nowhere/at/all"
    # A GET on a recorded path is not a call either.
    async with tap.session.get(tap.url + "/v1/chat/completions") as response:
        assert response.status == 404
    assert [r.path_qs for r in upstream.received] == [
        "/v1/models",
        "/metrics?name[]=x%20y",
        "/health",
        "/tokenize",
        "/nowhere/at/all?a=1",
        "/v1/chat/completions",
    ]
    assert [r.method for r in upstream.received][-2:] == ["DELETE", "GET"]
    assert tap.usage.events == [] and tap.usage.rejected == []


async def test_hop_by_hop_headers_are_not_forwarded(upstream, start_tap):
    upstream.reply("/v1/models", Reply(body=b"{}", headers={"X-Keep": "yes"}))
    tap = await start_tap()
    async with tap.session.get(
        tap.url + "/v1/models",
        headers={
            "Connection": "keep-alive, X-Drop-Me",
            "X-Drop-Me": "1",
            "TE": "trailers",
            "Proxy-Authorization": "Basic abc",
            "X-Keep-Me": "1",
        },
    ) as response:
        assert response.headers["X-Keep"] == "yes"
    (seen,) = upstream.received
    lowered = {name.lower() for name in seen.headers}
    assert "x-drop-me" not in lowered and "te" not in lowered
    assert "proxy-authorization" not in lowered
    assert seen.headers["X-Keep-Me"] == "1"
    assert seen.headers["Host"] == upstream.url.removeprefix("http://")


async def test_upstream_base_path_is_kept(upstream, start_tap):
    upstream.reply("/vllm/v1/chat/completions", Reply(body=fixture_bytes("01_chat_cold.json")))
    tap = await start_tap(upstream_url=upstream.url + "/vllm/")
    status, _, _ = await tap.post("/v1/chat/completions", CHAT)
    assert status == 200
    assert upstream.received[0].path_qs == "/vllm/v1/chat/completions"
    assert (await tap.usage.next_event()).prompt_tokens == 1395
