"""Hostile bodies through the tap: whatever the client or vLLM sends, the call is forwarded
byte for byte, the client gets its answer, and what could not be read is counted once."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging

import aiohttp
import pytest

from exporter.usage import body as request_body

from .conftest import Reply, fixture_bytes, sse_events

SSE = "text/event-stream; charset=utf-8"
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
NESTED = b'{"model": "tiny-llama", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


async def test_a_request_nested_too_deeply_is_still_forwarded(upstream, start_tap):
    error = fixture_bytes("11_chat_error_400.json")
    upstream.reply("/v1/chat/completions", Reply(status=400, body=error))
    tap = await start_tap()
    status, _, body = await tap.post(
        "/v1/chat/completions", data=NESTED, headers={"X-Caller": "alice"}
    )
    assert (status, body) == (400, error)  # vLLM's answer, not a 500 of ours
    assert upstream.received[0].body == NESTED
    event = await tap.usage.next_event()
    assert (event.caller, event.status) == ("alice", 400)


async def test_a_response_nested_too_deeply_reaches_the_client_and_is_counted(upstream, start_tap):
    upstream.reply("/v1/chat/completions", Reply(body=NESTED))
    tap = await start_tap()
    status, _, body = await tap.post("/v1/chat/completions", CHAT)
    assert (status, body) == (200, NESTED)
    assert tap.usage.rejected == [("tap", "malformed_response")]
    assert tap.usage.events == []


async def test_a_stream_event_nested_too_deeply_passes_and_the_usage_is_still_read(
    upstream, start_tap
):
    events = sse_events(fixture_bytes("03_chat_stream_warm.sse.txt"))
    hostile = b"data: " + NESTED + b"\n\n"
    stream = [events[0], hostile, *events[1:]]
    upstream.reply("/v1/chat/completions", Reply(content_type=SSE, chunks=stream))
    tap = await start_tap()
    status, _, body = await tap.post(
        "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert status == 200 and body == b"".join(stream)
    event = await tap.usage.next_event()
    assert event.cached_tokens == 1376 and event.status == 200
    assert tap.usage.rejected == [("tap", "stream_event_not_json")]


async def test_a_stream_broken_mid_way_is_counted_once_as_the_error_it_was(upstream, start_tap):
    events = sse_events(fixture_bytes("03_chat_stream_warm.sse.txt"))
    upstream.reply(
        "/v1/chat/completions", Reply(content_type=SSE, chunks=events[:2], cut_after_chunks=True)
    )
    tap = await start_tap()
    async with tap.session.post(
        tap.url + "/v1/chat/completions", json={**CHAT, "stream": True}
    ) as response:
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    event = await tap.usage.next_event()
    assert event.status == 502
    assert tap.usage.rejected == []  # not also a missing_usage rejection
    assert len(tap.usage.events) == 1


# --- request targets, slow and encoded request bodies (issue 29) ---------------------------


async def raw_exchange(url: str, data: bytes, seconds: float = 10.0) -> bytes:
    """Send ``data`` on a new connection and read until the tap closes it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), seconds)
    finally:
        writer.close()


@pytest.mark.parametrize("target", [b"http://x/v1/models", b"https://127.0.0.1:1/v1/models?a=b"])
async def test_an_absolute_form_target_is_a_counted_400(upstream, start_tap, target):
    """The issue's case: ``GET http://x/v1/models`` was a 500 and a traceback."""
    upstream.reply("/v1/models", Reply(body=b'{"data": []}'))
    tap = await start_tap()
    answer = await raw_exchange(
        tap.url, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b'"type": "bad_target"' in answer
    assert tap.usage.rejected == [("tap", "bad_target")]
    assert upstream.received == []  # never forwarded
    status, _, body = await tap.post("/v1/models", data=b"")  # the path form still works
    assert (status, body) == (200, b'{"data": []}')


async def test_the_asterisk_form_is_not_found_and_never_forwarded(upstream, start_tap, caplog):
    tap = await start_tap()
    answer = await raw_exchange(
        tap.url, b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 404 ")  # aiohttp's router: no path, no route
    assert upstream.received == [] and not caplog.records


async def test_a_request_body_trickled_in_is_cut_off_and_counted(
    upstream, start_tap, monkeypatch, caplog
):
    monkeypatch.setattr(request_body, "BODY_SECONDS", 0.3)
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("01_chat_cold.json")))
    tap = await start_tap()
    url = tap.url
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
    )
    answer = await asyncio.wait_for(reader.read(), 10)  # answered and closed, unasked
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408 ") and b"request_too_slow" in answer
    assert tap.usage.rejected == [("tap", "request_too_slow")]
    assert upstream.received == []
    status, _, _ = await tap.post("/v1/chat/completions", CHAT, headers={"X-Caller": "bob"})
    assert status == 200
    event = await tap.usage.next_event()
    assert event.caller == "bob" and len(tap.usage.events) == 1
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


async def test_a_gzipped_request_is_read_and_forwarded_decoded(upstream, start_tap):
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("01_chat_cold.json")))
    tap = await start_tap()
    sent = json.dumps(CHAT).encode()
    status, _, _ = await tap.post(
        "/v1/chat/completions",
        data=gzip.compress(sent),
        headers={"Content-Encoding": "gzip", "X-Caller": "alice"},
    )
    assert status == 200
    forwarded = upstream.received[0]
    assert forwarded.body == sent and "Content-Encoding" not in forwarded.headers
    event = await tap.usage.next_event()
    assert (event.caller, event.model) == ("alice", "tiny-llama")
    assert tap.usage.rejected == []


async def test_a_request_that_does_not_decode_is_a_counted_400(upstream, start_tap):
    tap = await start_tap()
    status, _, body = await tap.post(
        "/v1/chat/completions", data=json.dumps(CHAT).encode(), headers={"Content-Encoding": "gzip"}
    )
    assert status == 400 and b"bad_content_encoding" in body
    assert tap.usage.rejected == [("tap", "bad_content_encoding")]
    assert upstream.received == [] and tap.usage.events == []


async def test_a_coding_the_tap_does_not_decode_is_forwarded_as_it_came(upstream, start_tap):
    error = fixture_bytes("11_chat_error_400.json")
    upstream.reply("/v1/chat/completions", Reply(status=400, body=error))
    tap = await start_tap()
    status, _, body = await tap.post(
        "/v1/chat/completions",
        data=b"\x8b\x01opaque",
        headers={"Content-Encoding": "br", "X-Caller": "alice"},
    )
    assert (status, body) == (400, error)  # vLLM's answer to it
    assert upstream.received[0].body == b"\x8b\x01opaque"
    assert upstream.received[0].headers["Content-Encoding"] == "br"
