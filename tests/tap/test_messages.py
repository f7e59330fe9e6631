"""Anthropic's Messages API through the tap (vLLM 0.32 serves ``/v1/messages``): recorded as
the other endpoints are, whole and streamed, from real vLLM captures.

vLLM's Anthropic usage counts the prompt in three parts: ``input_tokens`` (computed anew),
``cache_read_input_tokens`` (from the prefix cache) and ``cache_creation_input_tokens``
(written to it), so the prompt is their sum and the cached part the cache read. A stream
says the usage in ``message_start`` (before any cache figure) and, final, in
``message_delta``.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from exporter.usage.openai import StreamReader, read_response

from .conftest import Reply, fixture_bytes, sse_events

SSE = "text/event-stream; charset=utf-8"
COLD = fixture_bytes("19_messages_cold.json")
WARM = fixture_bytes("20_messages_warm.json")
STREAM = fixture_bytes("21_messages_stream_warm.sse.txt")
ERROR = fixture_bytes("22_messages_error_400.json")
MESSAGE = {
    "model": "tiny-llama",
    "max_tokens": 8,
    "system": "be brief",
    "messages": [{"role": "user", "content": "hi"}],
}
KEY = "sk-ant-0123456789-SECRET"


def usage_of(body: bytes) -> dict[str, int]:
    return json.loads(body)["usage"]


async def test_whole_messages_are_recorded_with_the_prompt_in_three_parts(upstream, start_tap):
    tap = await start_tap()
    for capture in (COLD, WARM):
        upstream.reply("/v1/messages", Reply(body=capture))
        status, _, body = await tap.post(
            "/v1/messages", MESSAGE, headers={"X-Caller": "claude-agent"}
        )
        assert (status, body) == (200, capture)  # byte for byte
    cold, warm = tap.usage.events
    parts = usage_of(COLD)
    assert (
        cold.prompt_tokens
        == (
            parts["input_tokens"]
            + parts["cache_read_input_tokens"]
            + parts["cache_creation_input_tokens"]
        )
        == 446
    )
    assert (
        cold.caller,
        cold.model,
        cold.cached_tokens,
        cold.completion_tokens,
        cold.status,
        cold.max_tokens,
    ) == ("claude-agent", "tiny-llama", 0, 8, 200, 8)
    assert (warm.prompt_tokens, warm.cached_tokens) == (446, 416)
    # The body as the client sent it reached vLLM: nothing asked for, nothing changed.
    assert upstream.received[0].body == json.dumps(MESSAGE).encode()
    assert tap.usage.rejected == []


@pytest.mark.parametrize("size", [None, 1, 7, 64])
async def test_a_messages_stream_passes_untouched_with_its_final_usage(upstream, start_tap, size):
    chunks = (
        sse_events(STREAM)
        if size is None
        else [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    )
    upstream.reply("/v1/messages", Reply(content_type=SSE, chunks=chunks))
    tap = await start_tap()
    status, _, body = await tap.post(
        "/v1/messages", {**MESSAGE, "stream": True}, headers={"X-Caller": "claude-agent"}
    )
    assert (status, body) == (200, STREAM)
    event = await tap.usage.next_event()
    # message_start said 446 input tokens and no cache figure; message_delta's final usage
    # splits them: 30 computed + 416 read from the cache.
    assert (
        event.prompt_tokens,
        event.cached_tokens,
        event.completion_tokens,
        event.model,
        event.status,
    ) == (446, 416, 8, "tiny-llama", 200)
    assert event.ttft_seconds is not None  # the first content_block_delta with text
    assert upstream.received[0].body == json.dumps({**MESSAGE, "stream": True}).encode()


async def test_anthropic_callers_come_from_metadata_user_id_then_x_api_key(upstream, start_tap):
    upstream.reply("/v1/messages", Reply(body=WARM))
    tap = await start_tap()
    named = {**MESSAGE, "metadata": {"user_id": "end-user-9"}}

    async def caller(payload: dict[str, object], **headers: str) -> str:
        status, _, _ = await tap.post("/v1/messages", payload, headers=headers)
        assert status == 200
        return (await tap.usage.next_event()).caller

    assert await caller(named, **{"x-api-key": KEY, "X-Caller": "team"}) == "team"
    assert await caller(named, **{"x-api-key": KEY}) == "end-user-9"
    hashed = await caller(MESSAGE, **{"x-api-key": KEY})
    assert hashed == "key-" + hashlib.sha256(KEY.encode()).hexdigest()[:12]
    assert KEY not in hashed
    assert upstream.received[-1].headers["x-api-key"] == KEY  # forwarded, never shown
    # A bearer key wins over x-api-key, as for the other endpoints.
    bearer = await caller(MESSAGE, **{"x-api-key": KEY, "Authorization": "Bearer other"})
    assert bearer == "key-" + hashlib.sha256(b"other").hexdigest()[:12]
    assert await caller({**MESSAGE, "metadata": {"user_id": 7}}) == "anonymous"


async def test_a_refused_message_is_one_error_and_count_tokens_passes_through(upstream, start_tap):
    upstream.reply("/v1/messages", Reply(status=400, body=ERROR))
    counted = b'{"input_tokens":446}'
    upstream.reply("/v1/messages/count_tokens", Reply(body=counted))
    tap = await start_tap()
    status, _, body = await tap.post("/v1/messages", {"model": "tiny-llama"})
    assert (status, body) == (400, ERROR)
    event = await tap.usage.next_event()
    assert (event.status, event.prompt_tokens) == (400, 0)
    status, _, body = await tap.post("/v1/messages/count_tokens", MESSAGE)
    assert (status, body) == (200, counted)
    assert len(tap.usage.events) == 1 and tap.usage.rejected == []


async def test_a_message_without_usage_is_counted_as_malformed(upstream, start_tap):
    broken = json.loads(WARM)
    broken["usage"] = "none"
    upstream.reply("/v1/messages", Reply(body=json.dumps(broken).encode()))
    tap = await start_tap()
    status, _, _ = await tap.post("/v1/messages", MESSAGE)
    assert status == 200
    assert tap.usage.rejected == [("tap", "malformed_messages")]
    assert tap.usage.events == []


def test_a_stream_whose_usage_event_is_not_an_object_is_counted():
    bad = STREAM.replace(b'"usage":{"input_tokens":446,"output_tokens":0}', b'"usage":[]')
    reader = StreamReader(strip_usage_chunk=False, started=0.0)
    assert reader.feed(bad, 1.0) == bad
    assert reader.problems == ["malformed_messages"]
    assert reader.usage is not None and reader.usage.cached_tokens == 416  # the delta's


def test_anthropics_own_stream_shape_merges_the_start_and_the_delta():
    """Anthropic's API puts the input and cache figures in message_start and only the output
    count in message_delta; the delta's fields replace the start's, the rest stays."""
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "type": "message",
            "model": "claude",
            "usage": {
                "input_tokens": 12,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 2048,
                "output_tokens": 1,
            },
        },
    }
    delta = {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn"},
        "usage": {"output_tokens": 57},
    }
    text = b"".join(
        b"event: %s\ndata: %s\n\n" % (event["type"].encode(), json.dumps(event).encode())
        for event in (start, delta)
    )
    read = read_response(text.decode())
    assert read.usage is not None and read.model == "claude"
    assert (read.usage.prompt_tokens, read.usage.cached_tokens, read.usage.completion_tokens) == (
        2060,
        2048,
        57,
    )


def test_the_openai_format_reads_messages_whole_and_streamed():
    whole = read_response(json.loads(WARM))
    streamed = read_response(STREAM.decode())
    for read in (whole, streamed):
        assert read.usage is not None
        assert (
            read.usage.prompt_tokens,
            read.usage.cached_tokens,
            read.usage.completion_tokens,
            read.model,
        ) == (446, 416, 8, "tiny-llama")
