"""Generated hostile input against every reader: POST /v1/usage in every format, the file
follower and the tap. Whatever arrives (deep nesting, numbers beyond any float, NaN and
Infinity, invalid UTF-8, wrong types, truncated bodies), nothing answers 5xx, nothing raises,
and every event is either counted or counted as rejected, exactly once."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.config import Config
from exporter.server import STATE_KEY, create_app
from exporter.usage.event import FIELDS, validate
from exporter.usage.tail import FileFollower
from exporter.wiring import signals_state, tap_app

HOSTILE_NUMBERS = st.sampled_from([2 ** 1024, -(2 ** 1024), 10 ** 400, float("nan"),
                                   float("inf"), -0.0, 1e308, 5e-324, -1, 0, 2 ** 63])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), HOSTILE_NUMBERS,
                    st.text(max_size=40), st.sampled_from(["", "   ", "sk-1234", "\x00",
                                                            "²", "NaN", "a@b.co"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
NATIVE = st.fixed_dictionaries({}, optional={key: VALUES for key in FIELDS})
LITELLM = st.fixed_dictionaries({}, optional={
    "end_user": VALUES, "model": VALUES, "prompt_tokens": VALUES, "completion_tokens": VALUES,
    "startTime": VALUES, "completionStartTime": VALUES, "endTime": VALUES, "stream": VALUES,
    "status": VALUES, "session_id": VALUES,
    "metadata": st.fixed_dictionaries({}, optional={"usage_object": VALUES,
                                                    "user_api_key_alias": VALUES}),
    "response": VALUES})
USAGE = st.fixed_dictionaries({}, optional={
    "prompt_tokens": VALUES, "completion_tokens": VALUES, "input_tokens": VALUES,
    "cache_read_input_tokens": VALUES,
    "prompt_tokens_details": st.one_of(VALUES, st.fixed_dictionaries(
        {}, optional={"cached_tokens": VALUES}))})
OPENAI = st.fixed_dictionaries({"caller": st.one_of(st.just("alice"), VALUES)}, optional={
    "status": VALUES, "ttft_seconds": VALUES,
    "response": st.one_of(VALUES, st.fixed_dictionaries({"usage": USAGE}, optional={
        "model": VALUES, "metrics": VALUES}))})
DEEP = st.integers(min_value=1, max_value=3000).map(lambda depth: "[" * depth + "]" * depth)


def encode(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def mangle(line: bytes, how: int) -> bytes:
    """Damage one encoded line: truncate it, put bytes that are not UTF-8 in, or a BOM."""
    if how == 1:
        return line[: len(line) // 2]
    if how == 2:
        return line[:3] + b"\xff\xfe" + line[3:]
    if how == 3:
        return b"\xef\xbb\xbf" + line
    return line


LINES = st.lists(st.tuples(st.one_of(NATIVE.map(encode), LITELLM.map(encode),
                                     OPENAI.map(encode), DEEP.map(str.encode)),
                           st.integers(min_value=0, max_value=4)),
                 min_size=1, max_size=12).map(
    lambda items: [mangle(line, how) for line, how in items])
SHAPE = st.sampled_from(["ndjson", "array", "truncated"])


def body_of(lines: list[bytes], shape: str) -> bytes:
    if shape == "array":
        return b"[" + b",".join(lines) + b"]"
    body = b"\n".join(lines)
    return body[: len(body) * 2 // 3] if shape == "truncated" else body


def counts(state) -> tuple[int, int, int]:
    usage = state.usage
    return (usage.events.get("http", 0), sum(usage.rejected.values()),
            sum(usage.ingest_requests_rejected.values()))


def run(coroutine) -> Any:
    return asyncio.run(coroutine)


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(lines=LINES, shape=SHAPE, fmt=st.sampled_from(["native", "litellm", "openai"]))
def test_post_v1_usage_never_fails_and_counts_every_event_once(lines, shape, fmt):
    async def scenario() -> None:
        config = Config()
        state = signals_state(config)
        client = TestClient(TestServer(create_app(config, state, initial_refresh=False)))
        await client.start_server()
        try:
            before = counts(state)
            response = await client.post(f"/v1/usage?format={fmt}", data=body_of(lines, shape))
            reply = await response.json()
            after = counts(client.app[STATE_KEY])
        finally:
            await client.close()
        assert response.status in (200, 400, 422), (response.status, reply)
        accepted, rejected, refused = (b - a for a, b in zip(before, after, strict=True))
        if response.status == 400:
            assert (accepted, rejected, refused) == (0, 0, 1)
            return
        assert (reply["accepted"], reply["rejected"]) == (accepted, rejected)
        assert refused == 0

    run(scenario())


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(lines=LINES)
def test_the_file_follower_reads_every_complete_line_once(lines, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "usage.jsonl"
    path.write_bytes(b"")
    events: list[Any] = []
    rejected: list[str] = []
    follower = FileFollower([str(path)], validate, events.extend, rejected.append)
    follower.poll()
    with path.open("ab") as handle:
        for line in lines:
            handle.write(line.replace(b"\n", b" ") + b"\n")
    while follower.poll():
        pass
    follower.close()
    written = [line for line in lines if line.replace(b"\xef\xbb\xbf", b"").strip()]
    assert len(events) + len(rejected) == len(written)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=st.one_of(LINES.map(lambda lines: lines[0]), OPENAI.map(encode)),
       answer=st.one_of(LINES.map(lambda lines: lines[0]), OPENAI.map(
           lambda record: encode(record.get("response")))),
       streamed=st.booleans(), status=st.sampled_from([200, 400, 500]))
def test_the_tap_relays_whatever_comes_and_records_each_call_once(request, answer, streamed,
                                                                   status):
    async def upstream_handler(_request: web.Request) -> web.Response:
        await _request.read()
        if streamed:
            return web.Response(status=status, body=b"data: " + answer + b"\n\ndata: [DONE]\n\n",
                                content_type="text/event-stream")
        return web.Response(status=status, body=answer, content_type="application/json")

    async def scenario() -> None:
        upstream_app = web.Application()
        upstream_app.router.add_route("*", "/{tail:.*}", upstream_handler)
        upstream = TestServer(upstream_app)
        await upstream.start_server()
        config = Config(tap_listen_address="127.0.0.1:0",
                        tap_upstream=str(upstream.make_url("")).rstrip("/"))
        state = signals_state(config)
        tap = TestClient(TestServer(tap_app(config, state.usage)))
        await tap.start_server()
        try:
            response = await tap.post("/v1/chat/completions", data=request,
                                      headers={"X-Caller": "alice"})
            relayed = await response.read()
            await asyncio.sleep(0)  # the record is written as the handler ends
            assert response.status == status  # upstream's, never one of the tap's own
            if not streamed:
                assert relayed == answer
            usage = state.usage
            recorded = usage.events.get("tap", 0)
            assert recorded <= 1
            assert recorded == 1 or sum(usage.rejected.values()) >= 1
        finally:
            await tap.close()
            await upstream.close()

    run(scenario())
