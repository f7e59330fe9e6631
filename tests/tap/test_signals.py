"""The tap's calls reach the per-caller series on the exporter's /metrics, and the API key
never does; run_tap serves on its address and stops when cancelled."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest

from exporter.config import Config
from exporter.runtime import serve
from exporter.server import create_app
from exporter.usage.tap import run_tap
from exporter.wiring import signals_state, tap_app, tap_record, tap_reject, tap_settings
from tests.helpers import value

from .conftest import Reply, fixture_bytes

KEY = "sk-proj-VERY-SECRET-KEY-42"
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
SSE = "text/event-stream; charset=utf-8"


async def test_tap_calls_reach_the_per_caller_counters(upstream, aiohttp_client):
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("01_chat_cold.json")))
    upstream.reply(
        "/v1/completions",
        Reply(content_type=SSE, chunks=[fixture_bytes("06_completion_stream.sse.txt")]),
    )
    upstream.reply("/v1/responses", Reply(status=500, body=b'{"error":"boom"}'))
    config = Config(tap_listen_address="127.0.0.1:0", tap_upstream=upstream.url)
    state = signals_state(config)
    assert state.usage is not None
    tap = await aiohttp_client(tap_app(config, state.usage))
    exporter = await aiohttp_client(create_app(config, state, initial_refresh=False))

    headers = {"Authorization": f"Bearer {KEY}", "X-Caller": "alice"}
    assert (await tap.post("/v1/chat/completions", json=CHAT, headers=headers)).status == 200
    response = await tap.post(
        "/v1/completions",
        json={"prompt": "x", "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert b'"usage"' not in await response.read()
    response = await tap.post(
        "/v1/responses", json={"model": "tiny-llama", "input": "x"}, headers=headers
    )
    assert response.status == 500
    await response.read()

    text = await (await exporter.get("/metrics")).text()
    assert KEY not in text and "SECRET" not in text
    hashed = [line for line in text.splitlines() if 'caller="key-' in line]
    assert hashed, "the keyed caller is named by a hash"
    alice = {"caller": "alice", "model": "tiny-llama"}
    assert value(text, "vllm_cache_requests_total", state="cold", **alice) == 1
    assert value(text, "vllm_cache_requests_total", state="error", **alice) == 1
    assert value(text, "vllm_cache_prompt_tokens_total", **alice) == 1395
    assert value(text, "vllm_cache_cached_tokens_total", **alice) == 0
    keyed = {"model": "tiny-llama", "caller": hashed[0].split('caller="')[1].split('"')[0]}
    assert value(text, "vllm_cache_prompt_tokens_total", **keyed) == 1373
    assert value(text, "vllm_cache_cached_tokens_total", **keyed) == 1344
    assert value(text, "vllm_cache_usage_events_total", reader="tap") == 3


async def test_rejections_are_exported_by_reason(upstream, aiohttp_client):
    upstream.reply("/v1/chat/completions", Reply(body=b"not json", content_type="text/plain"))
    config = Config(
        tap_listen_address="127.0.0.1:0", tap_upstream=upstream.url, tap_max_request_bytes=100
    )
    state = signals_state(config)
    tap = await aiohttp_client(tap_app(config, state.usage))
    exporter = await aiohttp_client(create_app(config, state, initial_refresh=False))
    assert (await tap.post("/v1/chat/completions", json=CHAT)).status == 200
    assert (await tap.post("/v1/chat/completions", data=b"x" * 200)).status == 413
    text = await (await exporter.get("/metrics")).text()
    assert (
        value(
            text,
            "vllm_cache_usage_events_rejected_total",
            reader="tap",
            reason="malformed_response",
        )
        == 1
    )
    assert (
        value(
            text, "vllm_cache_usage_events_rejected_total", reader="tap", reason="request_too_large"
        )
        == 1
    )


async def test_run_tap_serves_and_stops_when_cancelled(upstream, unused_tcp_port_factory):
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("02_chat_warm.json")))
    port = unused_tcp_port_factory()
    config = Config(tap_listen_address=f"127.0.0.1:{port}", tap_upstream=upstream.url)
    state = signals_state(config)
    task = asyncio.ensure_future(
        run_tap(tap_settings(config), tap_record(state.usage), tap_reject(state.usage))
    )
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        for _ in range(200):  # no event says "listening": poll with a deadline
            try:
                async with session.post(url, json=CHAT) as response:
                    assert await response.read() == fixture_bytes("02_chat_warm.json")
                    break
            except aiohttp.ClientConnectorError:
                await asyncio.sleep(0.02)
        else:
            pytest.fail("the tap never listened")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
    assert state.usage.events.get("tap") == 1


async def test_serve_starts_the_tap_from_the_config(upstream, unused_tcp_port_factory):
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("02_chat_warm.json")))
    web_port, tap_port = unused_tcp_port_factory(), unused_tcp_port_factory()
    config = dataclasses.replace(
        Config(),
        web_listen_address=f"127.0.0.1:{web_port}",
        tap_listen_address=f"127.0.0.1:{tap_port}",
        tap_upstream=upstream.url,
    )
    stop, started = asyncio.Event(), asyncio.Event()
    server = asyncio.ensure_future(serve(config, stop, started))
    await asyncio.wait_for(started.wait(), 10)
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(200):
                try:
                    async with session.post(
                        f"http://127.0.0.1:{tap_port}/v1/chat/completions",
                        json=CHAT,
                        headers={"X-Caller": "carol"},
                    ) as r:
                        assert r.status == 200
                        await r.read()
                        break
                except aiohttp.ClientConnectorError:
                    await asyncio.sleep(0.02)
            async with session.get(f"http://127.0.0.1:{web_port}/metrics") as response:
                text = await response.text()
        assert value(text, "vllm_cache_cached_tokens_total", caller="carol") == 1376
    finally:
        stop.set()
        await asyncio.wait_for(server, 10)


async def test_session_header_names_the_conversation(upstream, aiohttp_client):
    """Turns are judged against the previous turn of the same conversation, not the caller's."""
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("02_chat_warm.json")))
    config = Config(tap_listen_address="127.0.0.1:0", tap_upstream=upstream.url)
    state = signals_state(config)
    seen = []
    record = state.usage.record
    state.usage.record = lambda event, reader: seen.append(event) or record(event, reader)
    tap = await aiohttp_client(tap_app(config, state.usage))
    for headers in ({"X-Caller": "alice", "X-Session-Id": "conv-1"}, {"X-Caller": "alice"}):
        response = await tap.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert response.status == 200
        await response.read()
    assert [event.session for event in seen] == ["conv-1", None]
    # The header is the tap's to read; vLLM still receives it untouched.
    assert upstream.received[0].headers.get("X-Session-Id") == "conv-1"


async def test_declared_completion_budget_reaches_the_foresight_series(upstream, aiohttp_client):
    """The request's max_completion_tokens / max_tokens / max_output_tokens is the budget
    the declared-vs-used series compare against, for a whole and a streamed answer alike;
    a request without one (or with one no record can carry) adds nothing to them."""
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("01_chat_cold.json")))
    upstream.reply(
        "/v1/completions",
        Reply(content_type=SSE, chunks=[fixture_bytes("06_completion_stream.sse.txt")]),
    )
    config = Config(tap_listen_address="127.0.0.1:0", tap_upstream=upstream.url)
    state = signals_state(config)
    tap = await aiohttp_client(tap_app(config, state.usage))
    exporter = await aiohttp_client(create_app(config, state, initial_refresh=False))
    alice = {"X-Caller": "alice"}
    for payload in (
        {**CHAT, "max_completion_tokens": 4096, "max_tokens": 1},
        {**CHAT, "max_tokens": 65536},
        CHAT,
        {**CHAT, "max_tokens": -1},
    ):
        response = await tap.post("/v1/chat/completions", json=payload, headers=alice)
        assert response.status == 200
        await response.read()
    response = await tap.post(
        "/v1/completions",
        headers={"X-Caller": "bob"},
        json={"model": "tiny-llama", "prompt": "x", "stream": True, "max_tokens": 1000},
    )
    assert b'"usage"' not in await response.read()

    text = await (await exporter.get("/metrics")).text()
    chat = {"caller": "alice", "model": "tiny-llama"}
    assert value(text, "vllm_cache_completion_declared_tokens_total", **chat) == 4096 + 65536
    assert value(text, "vllm_cache_completion_used_tokens_count", **chat) == 2
    assert value(text, "vllm_cache_completion_used_tokens_sum", **chat) == 16
    assert value(text, "vllm_cache_requests_total", state="cold", **chat) == 4
    streamed = {"caller": "bob", "model": "tiny-llama"}
    assert value(text, "vllm_cache_completion_declared_tokens_total", **streamed) == 1000
    assert value(text, "vllm_cache_completion_used_tokens_count", **streamed) == 1
    assert value(text, "vllm_cache_completion_used_tokens_sum", **streamed) == 8
