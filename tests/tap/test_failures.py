"""Upstream errors, timeouts, disconnects and oversized bodies: passed through faithfully,
recorded with the status the client saw, counted, never retried, nothing else lost."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from exporter.values import status_is_error

from .conftest import Reply, fixture_bytes, sse_events

SSE = "text/event-stream; charset=utf-8"
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
CHAT_STREAM = {**CHAT, "stream": True}
CHAT_SSE = fixture_bytes("03_chat_stream_warm.sse.txt")


async def test_upstream_error_passes_through_with_status_headers_and_body(upstream, start_tap):
    error = fixture_bytes("11_chat_error_400.json")
    upstream.reply(
        "/v1/chat/completions",
        Reply(status=400, body=error, headers={"X-Vllm": "1", "vary": "Origin"}),
    )
    tap = await start_tap()
    status, headers, body = await tap.post(
        "/v1/chat/completions", CHAT, headers={"X-Caller": "alice"}
    )
    assert (status, body) == (400, error)
    assert headers["X-Vllm"] == "1" and headers["Vary"] == "Origin"
    event = await tap.usage.next_event()
    assert (event.caller, event.status, event.prompt_tokens) == ("alice", 400, 0)
    assert status_is_error(event.status)
    assert tap.usage.rejected == []


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_server_errors_are_never_retried(upstream, start_tap, status):
    upstream.reply("/v1/chat/completions", Reply(status=status, body=b'{"error":"busy"}'))
    tap = await start_tap()
    got, _, body = await tap.post("/v1/chat/completions", CHAT)
    assert (got, body) == (status, b'{"error":"busy"}')
    assert len(upstream.received) == 1
    assert (await tap.usage.next_event()).status == status


async def test_upstream_down_is_a_clear_502(start_tap, unused_tcp_port):
    tap = await start_tap(upstream_url=f"http://127.0.0.1:{unused_tcp_port}")
    status, headers, body = await tap.post("/v1/chat/completions", CHAT)
    assert status == 502
    error = json.loads(body)["error"]
    assert "cannot connect" in error["message"] and error["type"] == "upstream_error"
    assert (await tap.usage.next_event()).status == 502
    # Other paths too, without an event.
    async with tap.session.get(tap.url + "/v1/models") as response:
        assert response.status == 502
    assert len(tap.usage.events) == 1


class CloseAtOnce:
    """An upstream that reads the request head and hangs up without answering."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.calls += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.close()


async def test_upstream_closing_without_an_answer_is_502_and_not_retried(start_tap):
    hang_up = CloseAtOnce()
    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        tap = await start_tap(upstream_url=f"http://127.0.0.1:{port}")
        status, _, body = await tap.post("/v1/chat/completions", CHAT)
    finally:
        server.close()
    assert status == 502
    assert json.loads(body)["error"]["type"] == "upstream_error"
    assert hang_up.calls == 1
    assert (await tap.usage.next_event()).status == 502


async def test_upstream_timeout_is_504(upstream, start_tap):
    upstream.reply("/v1/chat/completions", Reply(hang=True))
    tap = await start_tap(tap_timeout=0.3)
    status, _, body = await tap.post("/v1/chat/completions", CHAT)
    assert status == 504
    assert json.loads(body)["error"]["type"] == "upstream_timeout"
    assert (await tap.usage.next_event()).status == 504
    await asyncio.wait_for(upstream.cancelled.wait(), 5)  # vLLM sees the call abandoned


async def test_upstream_timeout_mid_stream_cuts_the_client_off(upstream, start_tap):
    events = sse_events(CHAT_SSE)
    never = asyncio.Event()
    upstream.reply(
        "/v1/chat/completions", Reply(content_type=SSE, chunks=[events[0], events[1], never])
    )
    tap = await start_tap(tap_timeout=0.5)
    async with tap.session.post(tap.url + "/v1/chat/completions", json=CHAT_STREAM) as response:
        assert response.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    event = await tap.usage.next_event()
    assert event.status == 504
    assert event.ttft_seconds is not None  # it got as far as the first content


async def test_upstream_breaking_mid_stream_cuts_the_client_off(upstream, start_tap):
    events = sse_events(CHAT_SSE)
    upstream.reply(
        "/v1/chat/completions", Reply(content_type=SSE, chunks=events[:3], cut_after_chunks=True)
    )
    tap = await start_tap()
    async with tap.session.post(tap.url + "/v1/chat/completions", json=CHAT_STREAM) as response:
        received = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in response.content.iter_any():
                received += chunk
    assert received == b"".join(events[:3])  # everything upstream did send
    assert (await tap.usage.next_event()).status == 502


async def test_client_disconnect_mid_stream_cancels_upstream_and_is_recorded(upstream, start_tap):
    events = sse_events(CHAT_SSE)
    never = asyncio.Event()
    upstream.reply(
        "/v1/chat/completions", Reply(content_type=SSE, chunks=[events[0], events[1], never])
    )
    tap = await start_tap()
    session = aiohttp.ClientSession()
    try:
        response = await session.post(
            tap.url + "/v1/chat/completions", json=CHAT_STREAM, headers={"X-Caller": "quitter"}
        )
        await asyncio.wait_for(response.content.readany(), 5)
        response.close()  # hang up mid-stream
    finally:
        await session.close()
    await asyncio.wait_for(upstream.cancelled.wait(), 5)
    event = await tap.usage.next_event()
    assert (event.caller, event.status) == ("quitter", 499)


async def test_client_disconnect_while_waiting_for_a_whole_answer(upstream, start_tap):
    upstream.reply("/v1/chat/completions", Reply(hang=True))
    tap = await start_tap()
    session = aiohttp.ClientSession()
    request = asyncio.ensure_future(session.post(tap.url + "/v1/chat/completions", json=CHAT))
    try:
        while not upstream.received:
            await asyncio.sleep(0.01)  # no event for "the tap has forwarded it"
        request.cancel()
    finally:
        await asyncio.gather(request, return_exceptions=True)
        await session.close()
    await asyncio.wait_for(upstream.cancelled.wait(), 5)
    assert (await tap.usage.next_event()).status == 499


async def test_request_over_the_limit_is_413_and_never_forwarded(upstream, start_tap):
    tap = await start_tap(tap_max_request_bytes=1000)
    status, _, body = await tap.post("/v1/chat/completions", data=b"{" + b" " * 2000 + b"}")
    assert status == 413
    assert "tap.max-request-bytes" in json.loads(body)["error"]["message"]
    assert upstream.received == []
    assert tap.usage.rejected == [("tap", "request_too_large")]
    # Chunked (no Content-Length) is bounded too.

    async def chunks():
        for _ in range(20):
            yield b" " * 100

    async with tap.session.post(tap.url + "/v1/completions", data=chunks()) as response:
        assert response.status == 413
    assert upstream.received == []


async def test_response_over_the_limit_is_502_counted_and_recorded(upstream, start_tap):
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("01_chat_cold.json")))
    tap = await start_tap(tap_max_response_bytes=500)
    status, _, body = await tap.post("/v1/chat/completions", CHAT)
    assert status == 502
    assert json.loads(body)["error"]["type"] == "response_too_large"
    assert tap.usage.rejected == [("tap", "response_too_large")]
    assert (await tap.usage.next_event()).status == 502
    # The limit is for whole bodies the tap holds: streams are not held, so not limited.
    upstream.reply("/v1/chat/completions", Reply(content_type=SSE, chunks=[CHAT_SSE]))
    status, _, body = await tap.post("/v1/chat/completions", CHAT_STREAM)
    assert status == 200 and len(body) > 500


async def test_unusable_usage_is_counted_and_the_answer_still_delivered(upstream, start_tap):
    answer = json.loads(fixture_bytes("02_chat_warm.json"))
    answer["usage"]["prompt_tokens_details"]["cached_tokens"] = 99_999  # above prompt
    raw = json.dumps(answer).encode()
    upstream.reply("/v1/chat/completions", Reply(body=raw))
    upstream.reply("/v1/completions", Reply(body=b"<html>not json</html>"))
    tap = await start_tap()
    status, _, body = await tap.post("/v1/chat/completions", CHAT)
    assert (status, body) == (200, raw)
    status, _, body = await tap.post("/v1/completions", {"prompt": "x"})
    assert (status, body) == (200, b"<html>not json</html>")
    assert ("tap", "cached_exceeds_prompt") in tap.usage.rejected
    assert ("tap", "malformed_response") in tap.usage.rejected
    assert tap.usage.events == []


async def test_success_without_usage_is_counted_not_invented(upstream, start_tap):
    stream = b"".join(e for e in sse_events(CHAT_SSE) if b'"usage"' not in e)
    upstream.reply("/v1/chat/completions", Reply(content_type=SSE, chunks=[stream]))
    tap = await start_tap()
    status, _, body = await tap.post("/v1/chat/completions", CHAT_STREAM)
    assert (status, body) == (200, stream)
    assert tap.usage.rejected == [("tap", "missing_usage")]
    assert tap.usage.events == []


class DropsSecondRequest:
    """Answers the first request with keep-alive, then hangs up on the next one unanswered:
    what a restarting vLLM does to a pooled connection."""

    def __init__(self) -> None:
        self.requests = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                self.requests += 1
                if self.requests == 2:
                    break
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
async def test_idempotent_calls_are_not_retried_either(start_tap, method):
    upstream = DropsSecondRequest()
    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        tap = await start_tap(upstream_url=f"http://127.0.0.1:{port}")
        async with tap.session.request(method, tap.url + "/v1/models") as response:
            assert (response.status, await response.read()) == (200, b"ok")
        async with tap.session.request(method, tap.url + "/v1/models") as response:
            assert response.status == 502
    finally:
        server.close()
    assert upstream.requests == 2  # aiohttp alone would have sent the second one again
