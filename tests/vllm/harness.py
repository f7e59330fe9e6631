"""The exporter in-process (its /metrics app and the tap, one shared state) in front of a real
vLLM, and a client that talks to vLLM through the tap as an agent would."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from exporter.config import Config
from exporter.server import create_app
from exporter.signals.state import SignalsState
from exporter.values import UsageEvent
from exporter.wiring import signals_state, tap_app
from tests.helpers import value
from tests.vllm.server import MODEL_NAME, free_port
from tests.words import WORDS


@dataclass
class Exporter:
    """Both apps on loopback ports; ``recorded`` keeps every event the tap handed over."""

    config: Config
    state: SignalsState
    runners: list[web.AppRunner] = field(default_factory=list)
    recorded: list[UsageEvent] = field(default_factory=list)

    @property
    def metrics_url(self) -> str:
        host, port = self.config.listen_host_port
        return f"http://{host}:{port}/metrics"

    @property
    def tap_url(self) -> str:
        return "http://" + self.config.tap_listen_address

    async def scrape(self, session: aiohttp.ClientSession) -> str:
        async with session.get(self.metrics_url) as response:
            assert response.status == 200
            return await response.text()

    async def close(self) -> None:
        for runner in reversed(self.runners):
            await runner.cleanup()


async def start_exporter(vllm_url: str, **overrides: Any) -> Exporter:
    """``overrides``: more Config fields (a module-scoped caller, outside the tests'
    autouse fixtures, sets ``usage_new_series_hold=0`` itself)."""
    config = Config(
        web_listen_address=f"127.0.0.1:{free_port()}",
        vllm_url=(vllm_url,),
        tap_listen_address=f"127.0.0.1:{free_port()}",
        tap_upstream=vllm_url,
        vllm_timeout=10.0,
        **overrides,
    )
    state = signals_state(config)
    exporter = Exporter(config, state)
    usage = state.usage
    assert usage is not None
    real_record = usage.record

    def spy(event: UsageEvent, reader: str) -> str:
        exporter.recorded.append(event)
        return real_record(event, reader=reader)

    usage.record = spy  # type: ignore[method-assign]
    apps = [
        (create_app(config, state), config.listen_host_port),
        (
            tap_app(config, state.usage),
            ("127.0.0.1", int(config.tap_listen_address.rpartition(":")[2])),
        ),
    ]
    for app, (host, port) in apps:
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        exporter.runners.append(runner)
    return exporter


def prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


@dataclass
class Turn:
    caller: str
    mode: str  # whole | stream | stream_usage
    prompt_tokens: int | None  # as the client saw them (None: the tap stripped the usage)
    cached_tokens: int | None
    saw_usage: bool
    # vLLM's per-request metrics as the client got them (--enable-per-request-metrics): on
    # the answer, or on the stream's usage chunk; None without the flag or without that chunk.
    metrics: dict[str, Any] | None = None


async def chat_turn(
    session: aiohttp.ClientSession,
    tap_url: str,
    caller: str,
    messages: list[dict[str, str]],
    mode: str,
) -> tuple[str, Turn]:
    """One chat call through the tap; returns the assistant's text and what the client saw."""
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0.0,
    }
    if mode != "whole":
        body["stream"] = True
    if mode == "stream_usage":
        body["stream_options"] = {"include_usage": True}
    async with session.post(
        tap_url + "/v1/chat/completions", json=body, headers={"X-Caller": caller}
    ) as response:
        raw = await response.read()
        assert response.status == 200, raw[:500]
    if mode == "whole":
        answer = json.loads(raw)
        usage = answer["usage"]
        details = usage.get("prompt_tokens_details") or {}
        return answer["choices"][0]["message"]["content"], Turn(
            caller,
            mode,
            usage["prompt_tokens"],
            details.get("cached_tokens"),
            True,
            answer["metrics"],
        )
    text, usage, metrics = "", None, None
    for event in raw.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        chunk = json.loads(event[len(b"data: ") :])
        if chunk.get("usage") and chunk.get("choices") == []:
            usage, metrics = chunk["usage"], chunk.get("metrics")
        for choice in chunk.get("choices") or []:
            text += choice.get("delta", {}).get("content") or ""
    assert raw.rstrip().endswith(b"data: [DONE]")
    if usage is None:
        return text, Turn(caller, mode, None, None, False)
    details = usage.get("prompt_tokens_details") or {}
    return text, Turn(
        caller, mode, usage["prompt_tokens"], details.get("cached_tokens"), True, metrics
    )


async def conversation(
    session: aiohttp.ClientSession, tap_url: str, caller: str, seed: int, modes: list[str]
) -> list[Turn]:
    """A multi-turn agent conversation: a long system prompt of its own, short user turns;
    each turn re-sends the whole history, so every later turn shares the earlier prefix."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": prose(rng, 250)}]
    turns = []
    for index, mode in enumerate(modes):
        messages.append({"role": "user", "content": f"step {index}: " + prose(rng, 4)})
        text, turn = await chat_turn(session, tap_url, caller, messages, mode)
        messages.append({"role": "assistant", "content": text})
        turns.append(turn)
    return turns


def vllm_counter(text: str, name: str) -> float:
    """A vLLM counter summed over its engines (from vLLM's own /metrics)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric(text: str, name: str, **labels: str) -> float | None:
    return value(text, name, **labels)


# vLLM records a finished request's stats on its next engine step: poll for them (no event
# crosses the process boundary), for at most this long.
STATS_DEADLINE_SECONDS = 30.0


async def vllm_metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as response:
        assert response.status == 200
        return await response.text()


async def vllm_metrics_after(
    session: aiohttp.ClientSession, url: str, before: str, requests: int
) -> str:
    """vLLM's /metrics once its per-request histograms have the ``requests`` finished since
    ``before``."""
    deadline = time.monotonic() + STATS_DEADLINE_SECONDS
    count = "vllm:request_prefill_time_seconds_count"
    while True:
        text = await vllm_metrics(session, url)
        if vllm_counter(text, count) - vllm_counter(before, count) >= requests:
            return text
        assert time.monotonic() < deadline, "vLLM did not record every request's stats"
        await asyncio.sleep(0.2)
