"""Hostile bodies through the tap: whatever the client or vLLM sends, the call is forwarded
byte for byte, the client gets its answer, and what could not be read is counted once."""

from __future__ import annotations

import aiohttp
import pytest

from .conftest import Reply, fixture_bytes, sse_events

SSE = "text/event-stream; charset=utf-8"
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
NESTED = b'{"model": "tiny-llama", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


async def test_a_request_nested_too_deeply_is_still_forwarded(upstream, start_tap):
    error = fixture_bytes("11_chat_error_400.json")
    upstream.reply("/v1/chat/completions", Reply(status=400, body=error))
    tap = await start_tap()
    status, _, body = await tap.post("/v1/chat/completions", data=NESTED,
                                     headers={"X-Caller": "alice"})
    assert (status, body) == (400, error)  # vLLM's answer, not a 500 of ours
    assert upstream.received[0].body == NESTED
    event = await tap.usage.next_event()
    assert (event.caller, event.status) == ("alice", 400)


async def test_a_response_nested_too_deeply_reaches_the_client_and_is_counted(upstream,
                                                                            start_tap):
    upstream.reply("/v1/chat/completions", Reply(body=NESTED))
    tap = await start_tap()
    status, _, body = await tap.post("/v1/chat/completions", CHAT)
    assert (status, body) == (200, NESTED)
    assert tap.usage.rejected == [("tap", "malformed_response")]
    assert tap.usage.events == []


async def test_a_stream_event_nested_too_deeply_passes_and_the_usage_is_still_read(
        upstream, start_tap):
    events = sse_events(fixture_bytes("03_chat_stream_warm.sse.txt"))
    hostile = b"data: " + NESTED + b"\n\n"
    stream = [events[0], hostile, *events[1:]]
    upstream.reply("/v1/chat/completions", Reply(content_type=SSE, chunks=stream))
    tap = await start_tap()
    status, _, body = await tap.post("/v1/chat/completions",
                                     {**CHAT, "stream": True,
                                      "stream_options": {"include_usage": True}})
    assert status == 200 and body == b"".join(stream)
    event = await tap.usage.next_event()
    assert event.cached_tokens == 1376 and event.status == 200
    assert tap.usage.rejected == [("tap", "stream_event_not_json")]


async def test_a_stream_broken_mid_way_is_counted_once_as_the_error_it_was(upstream,
                                                                          start_tap):
    events = sse_events(fixture_bytes("03_chat_stream_warm.sse.txt"))
    upstream.reply("/v1/chat/completions", Reply(content_type=SSE, chunks=events[:2],
                                                 cut_after_chunks=True))
    tap = await start_tap()
    async with tap.session.post(tap.url + "/v1/chat/completions",
                                json={**CHAT, "stream": True}) as response:
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    event = await tap.usage.next_event()
    assert event.status == 502
    assert tap.usage.rejected == []  # not also a missing_usage rejection
    assert len(tap.usage.events) == 1
