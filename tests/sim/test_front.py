"""The HTTP front's contract: OpenAI routes, vLLM's error shape for bad input, streaming, and
a client that disconnects mid-stream costs nothing (its blocks go back to the pool)."""

from __future__ import annotations

import asyncio

import pytest

from exporter.sim.clock import SimClock
from exporter.sim.engine import EngineConfig
from exporter.sim.server import SPEED_HEADER, build_simulator, create_sim_app
from exporter.sim.tokenizer import words
from tests.helpers import value

CONFIG = EngineConfig(
    served_model_name="sim",
    block_size=16,
    kv_pool_tokens=65_536,
    max_model_len=8192,
    enable_prefix_caching=True,
    enable_prompt_tokens_details=True,
    prefill_rate=50_000.0,
    decode_rate=200.0,
)


@pytest.fixture
async def front(aiohttp_client):
    sim = build_simulator(CONFIG, SimClock(speed=20.0))
    client = await aiohttp_client(create_sim_app(sim))
    client.sim = sim
    return client


def chat(text: str, **extra) -> dict:
    return {"model": "sim", "messages": [{"role": "user", "content": text}], **extra}


@pytest.mark.parametrize(
    "path, body, status, fragment",
    [
        ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400, "content"),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400, "role"),
        (
            "/v1/chat/completions",
            b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}',
            404,
            "does not exist",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}',
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "n": 3}',
            400,
            "n=1",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], '
            b'"stream_options": {"include_usage": true}}',
            400,
            "stream",
        ),
        ("/v1/completions", b'{"prompt": ["a", "b"]}', 400, "batched"),
        ("/v1/completions", b'{"prompt": [1, -5]}', 400, "token ids"),
        ("/v1/completions", b'{"prompt": {"a": 1}}', 400, "prompt"),
        (
            "/v1/completions",
            b'{"prompt": "' + ("w " * 9000).encode() + b'"}',
            400,
            "maximum context length is 8192",
        ),
        ("/v1/completions", b'{"prompt": "x", "vllm_xargs": [1]}', 400, "vllm_xargs"),
        (
            "/v1/completions",
            b'{"prompt": "x", "vllm_xargs": {"answer_tokens": 0}}',
            400,
            "answer_tokens",
        ),
        # the declared max_tokens decides whether it fits the window, not the answer's length
        (
            "/v1/completions",
            b'{"prompt": "x", "max_tokens": 9000, "vllm_xargs": {"answer_tokens": 5}}',
            400,
            "maximum context length is 8192",
        ),
    ],
)
async def test_bad_requests_get_vllms_error_shape(front, path, body, status, fragment):
    response = await front.post(path, data=body, headers={"Content-Type": "application/json"})
    assert response.status == status
    error = (await response.json())["error"]
    assert fragment in error["message"] and error["code"] == status
    # and the simulator keeps serving
    ok = await front.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 2})
    assert ok.status == 200


async def test_models_health_version_and_landing(front):
    models = await (await front.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["sim"]
    assert models["data"][0]["max_model_len"] == 8192
    assert (await front.get("/health")).status == 200
    assert (await (await front.get("/version")).json())["version"] == "0.32.0"
    assert "prefix caching on" in await (await front.get("/")).text()


async def test_speed_header_lets_clients_convert_to_scenario_seconds(front):
    response = await front.post("/v1/chat/completions", json=chat("hi", max_tokens=1))
    assert response.headers[SPEED_HEADER] == "20"


async def test_stream_without_include_usage_has_no_usage_chunk(front):
    response = await front.post(
        "/v1/chat/completions", json=chat(words(40, "ab"), max_tokens=6, stream=True)
    )
    text = await response.text()
    assert response.headers["Content-Type"].startswith("text/event-stream")
    assert text.rstrip().endswith("data: [DONE]")
    assert '"usage"' not in text
    assert text.count('"finish_reason":"length"') == 1


async def test_details_off_usage_has_null_details(aiohttp_client):
    sim = build_simulator(EngineConfig(enable_prompt_tokens_details=False))
    client = await aiohttp_client(create_sim_app(sim))
    body = await (
        await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 2})
    ).json()
    assert body["usage"]["prompt_tokens_details"] is None
    stream = await client.post(
        "/v1/completions",
        json={
            "prompt": "a b c",
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    text = await stream.text()
    assert '"usage"' in text and "prompt_tokens_details" not in text


async def test_client_gone_mid_stream_frees_its_blocks(front):
    sim = front.sim
    response = await front.post(
        "/v1/chat/completions", json=chat(words(2000, "gone"), max_tokens=5000, stream=True)
    )
    first = await response.content.readline()
    assert first.startswith(b"data:")
    assert sim.engine.num_running == 1 and sim.engine.pool.pinned > 0
    response.close()  # the client hangs up with ~5,000 tokens still to come
    deadline = asyncio.get_running_loop().time() + 10
    while sim.engine.num_running and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)  # no event to await: the server notices on its next write
    assert sim.engine.num_running == 0 and sim.engine.pool.pinned == 0
    metrics = await (await front.get("/metrics")).text()
    assert value(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(metrics, "vllm:kv_cache_usage_perc") == 0


async def test_rejected_stream_is_a_plain_error(front):
    response = await front.post(
        "/v1/completions", json={"prompt": [17] * 8000, "max_tokens": 500, "stream": True}
    )
    assert response.status == 400
    assert "maximum context length" in (await response.json())["error"]["message"]


async def test_an_answer_can_end_before_the_declared_max_tokens(front):
    """A real model stops by itself; the simulated one where vllm_xargs.answer_tokens says:
    finish_reason "stop", completion_tokens the answer's length, max_tokens as declared."""
    response = await front.post(
        "/v1/completions",
        json={"prompt": "hello there", "max_tokens": 4000, "vllm_xargs": {"answer_tokens": 7}},
    )
    assert response.status == 200
    body = await response.json()
    assert body["usage"]["completion_tokens"] == 7
    assert body["choices"][0]["finish_reason"] == "stop"
    plain = await (
        await front.post("/v1/completions", json={"prompt": "hello again", "max_tokens": 7})
    ).json()
    assert plain["usage"]["completion_tokens"] == 7
    assert plain["choices"][0]["finish_reason"] == "length"
