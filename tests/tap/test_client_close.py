"""A client that closes its connection once it has read what it needs.

The ``openai`` SDK's sync ``Stream`` stops reading at ``data: [DONE]`` and closes the socket
without reading the chunked terminator that follows; the tap, still waiting for vLLM's end
of stream, is then cancelled (the production runner cancels a handler whose client hung up).
The usage was already read by then: the call is a success and counted as one. A client that
leaves before the usage arrived is a 499, as before.

These tests use a raw socket client so that the order of events is the test's, not a
library's: the upstream holds its end of stream until the client has closed.
"""

from __future__ import annotations

import asyncio
import json

from .conftest import Reply, fixture_bytes, sse_events

SSE = "text/event-stream; charset=utf-8"
CHAT_SSE = fixture_bytes("03_chat_stream_warm.sse.txt")
COMPLETION_SSE = fixture_bytes("06_completion_stream.sse.txt")
CHAT_STREAM = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 8,
    "stream": True,
}


async def post_and_close_after(
    url: str, path: str, payload: dict[str, object], marker: bytes, headers: dict[str, str]
) -> bytes:
    """POST over a raw socket, read until ``marker`` has arrived, then close the socket at
    once without reading the chunked terminator: what the sync openai client does."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(payload).encode()
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    await writer.drain()
    received = b""
    try:
        while marker not in received:
            chunk = await asyncio.wait_for(reader.read(65536), 5)
            assert chunk, f"the tap closed before {marker!r}: {received[-300:]!r}"
            received += chunk
    finally:
        writer.close()
        await writer.wait_closed()
    return received


async def test_stream_closed_right_after_done_is_a_counted_success(upstream, start_tap):
    """The tap asked for usage and stripped its chunk; the client quits at [DONE]."""
    end = asyncio.Event()  # upstream's end of stream waits until the client is gone
    upstream.reply(
        "/v1/chat/completions", Reply(content_type=SSE, chunks=[*sse_events(CHAT_SSE), end])
    )
    tap = await start_tap()
    received = await post_and_close_after(
        tap.url, "/v1/chat/completions", CHAT_STREAM, b"data: [DONE]", {"X-Caller": "sync-openai"}
    )
    assert b"200 OK" in received.split(b"\r\n", 1)[0]
    event = await tap.usage.next_event()
    end.set()
    assert (
        event.caller,
        event.status,
        event.prompt_tokens,
        event.cached_tokens,
        event.completion_tokens,
    ) == ("sync-openai", 200, 1396, 1376, 8)
    assert event.ttft_seconds is not None
    assert tap.usage.rejected == []


async def test_stream_with_usage_closed_after_done_is_a_counted_success(upstream, start_tap):
    """The client asked for the usage chunk itself (nothing stripped)."""
    end = asyncio.Event()
    upstream.reply(
        "/v1/completions", Reply(content_type=SSE, chunks=[*sse_events(COMPLETION_SSE), end])
    )
    tap = await start_tap()
    payload = {
        "model": "tiny-llama",
        "prompt": "hi",
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    await post_and_close_after(
        tap.url, "/v1/completions", payload, b"data: [DONE]", {"X-Caller": "sync-openai"}
    )
    event = await tap.usage.next_event()
    end.set()
    assert (event.status, event.prompt_tokens, event.cached_tokens) == (200, 1373, 1344)


async def test_stream_left_before_its_usage_is_still_a_499(upstream, start_tap):
    events = sse_events(CHAT_SSE)
    rest = asyncio.Event()
    upstream.reply(
        "/v1/chat/completions",
        Reply(content_type=SSE, chunks=[events[0], events[1], rest, *events[2:]]),
    )
    tap = await start_tap()
    await post_and_close_after(
        tap.url, "/v1/chat/completions", CHAT_STREAM, events[1], {"X-Caller": "impatient"}
    )
    event = await tap.usage.next_event()
    rest.set()
    assert (event.caller, event.status, event.prompt_tokens) == ("impatient", 499, 0)
