"""Streams: chunks reach the client as they arrive, the injected usage chunk is removed and
nothing else changes, TTFT is taken at the first chunk that carries content."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from .conftest import Reply, fixture_bytes, sse_events, without_usage_chunk

SSE = "text/event-stream; charset=utf-8"
CHAT_STREAM = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 8,
    "stream": True,
}
CHAT_SSE = fixture_bytes("03_chat_stream_warm.sse.txt")
COMPLETION_SSE = fixture_bytes("06_completion_stream.sse.txt")
RESPONSES_SSE = fixture_bytes("09_responses_stream_warm.sse.txt")


def split_every(raw: bytes, size: int) -> list[bytes]:
    return [raw[i : i + size] for i in range(0, len(raw), size)]


async def test_client_gets_first_chunk_before_upstream_sends_the_last(upstream, start_tap):
    events = sse_events(CHAT_SSE)
    more = asyncio.Event()
    upstream.reply(
        "/v1/chat/completions",
        Reply(content_type=SSE, chunks=[events[0], events[1], more, *events[2:]]),
    )
    tap = await start_tap()
    async with tap.session.post(tap.url + "/v1/chat/completions", json=CHAT_STREAM) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == SSE
        first = b""
        # Upstream is blocked on `more` until the client has the first two events; a tap
        # that buffered the stream would never deliver them.
        while len(first) < len(events[0]) + len(events[1]):
            first += await asyncio.wait_for(response.content.readany(), 5)
        assert first == events[0] + events[1]
        more.set()
        rest = await response.read()
    assert first + rest == without_usage_chunk(CHAT_SSE)


async def test_usage_is_injected_upstream_and_its_chunk_stripped(upstream, start_tap):
    upstream.reply("/v1/chat/completions", Reply(content_type=SSE, chunks=[CHAT_SSE]))
    tap = await start_tap()
    request = json.dumps(CHAT_STREAM).encode()
    status, _, body = await tap.post(
        "/v1/chat/completions", data=request, headers={"X-Caller": "bob"}
    )
    assert status == 200
    assert body == without_usage_chunk(CHAT_SSE)
    assert b'"usage"' not in body and body.endswith(b"data: [DONE]\n\n")
    # Upstream was asked for usage; every other byte of the request is as the client sent it.
    assert upstream.received[0].body == (b'{"stream_options":{"include_usage":true},' + request[1:])
    event = await tap.usage.next_event()
    assert (
        event.caller,
        event.model,
        event.prompt_tokens,
        event.cached_tokens,
        event.completion_tokens,
        event.status,
    ) == ("bob", "tiny-llama", 1396, 1376, 8, 200)


async def test_client_that_asked_for_usage_gets_it_unchanged(upstream, start_tap):
    upstream.reply("/v1/chat/completions", Reply(content_type=SSE, chunks=[CHAT_SSE]))
    tap = await start_tap()
    request = json.dumps({**CHAT_STREAM, "stream_options": {"include_usage": True}}).encode()
    status, _, body = await tap.post("/v1/chat/completions", data=request)
    assert (status, body) == (200, CHAT_SSE)
    assert upstream.received[0].body == request
    assert (await tap.usage.next_event()).cached_tokens == 1376


async def test_existing_stream_options_are_kept_and_continuous_usage_dropped(upstream, start_tap):
    upstream.reply("/v1/chat/completions", Reply(content_type=SSE, chunks=[CHAT_SSE]))
    tap = await start_tap()
    await tap.post(
        "/v1/chat/completions",
        {
            **CHAT_STREAM,
            "stream_options": {"include_usage": False, "continuous_usage_stats": True, "other": 1},
        },
    )
    sent = json.loads(upstream.received[0].body)
    assert sent["stream_options"] == {"include_usage": True, "other": 1}
    assert {k: v for k, v in sent.items() if k != "stream_options"} == CHAT_STREAM


@pytest.mark.parametrize("size", [1, 7, 64, 333, 100_000])
async def test_any_chunking_gives_the_same_bytes_and_usage(upstream, start_tap, size):
    upstream.reply(
        "/v1/completions", Reply(content_type=SSE, chunks=split_every(COMPLETION_SSE, size))
    )
    tap = await start_tap()
    status, _, body = await tap.post(
        "/v1/completions", {"model": "tiny-llama", "prompt": "x", "stream": True}
    )
    assert status == 200
    assert body == without_usage_chunk(COMPLETION_SSE)
    event = await tap.usage.next_event()
    assert (event.prompt_tokens, event.cached_tokens, event.completion_tokens) == (1373, 1344, 8)
    assert tap.usage.rejected == []


async def test_ttft_is_taken_at_the_first_chunk_with_content(upstream, start_tap):
    events = sse_events(CHAT_SSE)
    tap = await start_tap()
    # events[0] is the role chunk with empty content; events[1] carries " information".
    upstream.reply(
        "/v1/chat/completions",
        Reply(
            content_type=SSE,
            chunks=[
                tap.clock.advance(0.5),
                events[0],
                tap.clock.advance(1.25),
                events[1],
                *events[2:],
            ],
        ),
    )
    await tap.post("/v1/chat/completions", CHAT_STREAM)
    event = await tap.usage.next_event()
    assert event.ttft_seconds == pytest.approx(1.75)


async def test_responses_stream_passes_untouched_with_usage_read(upstream, start_tap):
    upstream.reply("/v1/responses", Reply(content_type=SSE, chunks=split_every(RESPONSES_SSE, 100)))
    tap = await start_tap()
    request = json.dumps({"model": "tiny-llama", "input": "x", "stream": True}).encode()
    status, _, body = await tap.post("/v1/responses", data=request)
    assert (status, body) == (200, RESPONSES_SSE)
    assert upstream.received[0].body == request  # usage is always in response.completed
    event = await tap.usage.next_event()
    assert (event.prompt_tokens, event.cached_tokens, event.completion_tokens) == (268, 256, 4)
    assert event.ttft_seconds is not None


async def test_continuous_usage_takes_the_final_usage_chunk(upstream, start_tap):
    """continuous_usage_stats puts usage without details on every chunk."""
    events = sse_events(CHAT_SSE)
    partial = {"prompt_tokens": 1396, "completion_tokens": 1, "total_tokens": 1397}
    rewritten = []
    for event in events[:-2]:
        obj = json.loads(event[len(b"data: ") :])
        obj["usage"] = partial
        rewritten.append(b"data: " + json.dumps(obj).encode() + b"\n\n")
    stream = b"".join(rewritten) + events[-2] + events[-1]
    upstream.reply("/v1/chat/completions", Reply(content_type=SSE, chunks=[stream]))
    tap = await start_tap()
    status, _, body = await tap.post(
        "/v1/chat/completions",
        {**CHAT_STREAM, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    assert body == stream
    event = await tap.usage.next_event()
    assert (event.cached_tokens, event.completion_tokens) == (1376, 8)


async def test_error_event_inside_a_stream_is_recorded_with_its_code(upstream, start_tap):
    events = sse_events(CHAT_SSE)
    error = (
        b'data: {"error": {"message": "engine died", "type": "InternalServerError", '
        b'"code": 503}}\n\n'
    )
    stream = events[0] + events[1] + error + b"data: [DONE]\n\n"
    upstream.reply("/v1/chat/completions", Reply(content_type=SSE, chunks=[stream]))
    tap = await start_tap()
    status, _, body = await tap.post("/v1/chat/completions", CHAT_STREAM)
    assert (status, body) == (200, stream)
    event = await tap.usage.next_event()
    assert event.status == 503 and event.prompt_tokens == 0


async def test_json_error_for_a_stream_request_passes_through(upstream, start_tap):
    error = fixture_bytes("11_chat_error_400.json")
    upstream.reply("/v1/chat/completions", Reply(status=400, body=error))
    tap = await start_tap()
    status, headers, body = await tap.post("/v1/chat/completions", CHAT_STREAM)
    assert (status, body) == (400, error)
    assert headers["Content-Type"] == "application/json"
    event = await tap.usage.next_event()
    assert (event.status, event.prompt_tokens, event.cached_tokens) == (400, 0, None)


async def test_include_usage_is_spliced_into_the_clients_own_bytes(upstream, start_tap):
    """Only the last stream_options value changes: whitespace, escapes, key order and a
    repeated stream_options (which vLLM's json reads as its last) stay as the client sent."""
    upstream.reply("/v1/chat/completions", Reply(content_type=SSE, chunks=[CHAT_SSE]))
    tap = await start_tap()
    head = (
        b'{ "model" : "tiny-llama",\n "stream_options": {"include_usage": true},\n'
        b'  "messages": [{"role": "user", "content": "caf\\u00e9 \xc3\xa9 {\\"stream\\": 1}"}],'
        b'\n  "stream_options" :  '
    )
    tail = b' , "stream": true , "max_tokens": 8 }'
    request = head + b'{"continuous_usage_stats": true, "x": [1, 2]}' + tail
    status, _, body = await tap.post("/v1/chat/completions", data=request)
    assert (status, body) == (200, without_usage_chunk(CHAT_SSE))
    assert upstream.received[0].body == head + b'{"x":[1,2],"include_usage":true}' + tail
    assert (await tap.usage.next_event()).cached_tokens == 1376


async def test_a_large_prompt_dense_with_small_messages_is_read(upstream, start_tap):
    """Over the inline limit and too dense for the walk, the request is read off the loop;
    the facts are the same."""
    upstream.reply("/v1/chat/completions", Reply(content_type=SSE, chunks=[CHAT_SSE]))
    tap = await start_tap()
    messages = [{"role": "user", "content": f"turn {i}"} for i in range(20_000)]
    request = json.dumps(
        {"messages": messages, "model": "tiny-llama", "stream": True, "user": "carol"}
    ).encode()
    assert len(request) > 256 * 1024
    status, _, body = await tap.post("/v1/chat/completions", data=request)
    assert (status, body) == (200, without_usage_chunk(CHAT_SSE))
    assert upstream.received[0].body == (b'{"stream_options":{"include_usage":true},' + request[1:])
    event = await tap.usage.next_event()
    assert (event.caller, event.model, event.cached_tokens) == ("carol", "tiny-llama", 1376)


async def test_nested_stream_flag_is_not_the_requests(upstream, start_tap):
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("02_chat_warm.json")))
    tap = await start_tap()
    request = (
        b'{"model":"tiny-llama","messages":[{"role":"user","content":"x",'
        b'"stream":true,"stream_options":{}}],"user":"dave"}'
    )
    status, _, body = await tap.post("/v1/chat/completions", data=request)
    assert (status, body) == (200, fixture_bytes("02_chat_warm.json"))
    assert upstream.received[0].body == request
    event = await tap.usage.next_event()
    assert (event.caller, event.cached_tokens) == ("dave", 1376)


def normalised(raw: bytes) -> bytes:
    """A stream without what differs from call to call: ids and timestamps."""
    return re.sub(
        rb'"created":\d+', b'"created":0', re.sub(rb'"id":"chatcmpl-[0-9a-f]+"', b'"id":"x"', raw)
    )


@pytest.mark.parametrize("size", [None, 1, 50, 400])
async def test_a_client_that_did_not_ask_for_usage_gets_what_vllm_would_send_it(
    upstream, start_tap, size
):
    """Asked for usage, vLLM moves ``system_fingerprint`` from the terminal chunk to the
    usage chunk, which the tap removes: the client gets it back where vLLM puts it when not
    asked. Both captures are the same call to the same vLLM 0.32, without and with
    ``include_usage``."""
    with_usage = fixture_bytes("24_chat_stream_usage.sse.txt")
    direct = fixture_bytes("23_chat_stream_no_usage.sse.txt")
    chunks = sse_events(with_usage) if size is None else split_every(with_usage, size)
    upstream.reply("/v1/chat/completions", Reply(content_type=SSE, chunks=chunks))
    tap = await start_tap()
    status, _, body = await tap.post("/v1/chat/completions", CHAT_STREAM)
    assert status == 200
    assert normalised(body) == normalised(direct)
    assert b'"system_fingerprint":"vllm-0.32.0-2890b983"}' in body
    event = await tap.usage.next_event()
    assert (event.prompt_tokens, event.cached_tokens) == (346, 320)


async def test_terminal_chunks_held_for_a_usage_chunk_that_never_comes_are_delivered(
    upstream, start_tap
):
    with_usage = fixture_bytes("24_chat_stream_usage.sse.txt")
    events = [event for event in sse_events(with_usage) if b'"choices":[]' not in event]
    upstream.reply("/v1/chat/completions", Reply(content_type=SSE, chunks=events))
    tap = await start_tap()
    status, _, body = await tap.post("/v1/chat/completions", CHAT_STREAM)
    assert (status, body) == (200, b"".join(events))  # nothing to add, nothing lost
    assert tap.usage.rejected == [("tap", "missing_usage")]
