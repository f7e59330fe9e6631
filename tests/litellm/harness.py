"""The simulator and the exporter in-process on loopback ports, and agents that talk to them
through a LiteLLM proxy: callers named each way the README documents, conversations named
each way LiteLLM takes a session id, answers whole and streamed."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from exporter.config import Config
from exporter.server import create_app
from exporter.sim.engine import EngineConfig
from exporter.sim.server import build_simulator, create_sim_app, start_site
from tests.helpers import value
from tests.litellm.proxy import free_port
from tests.words import WORDS

# A simulator token is a word of up to 8 characters; every word of tests/words.py is one.
USER_TURN_WORDS = 48
# The simulator's block size, given to the exporter as G: no learning, no provisional G.
BLOCK_SIZE = 16


@dataclass
class Servers:
    """The simulator and the exporter, each an aiohttp app on its own loopback port."""

    simulator_url: str
    exporter_url: str
    runners: list[web.AppRunner] = field(default_factory=list)

    async def close(self) -> None:
        for runner in reversed(self.runners):
            await runner.cleanup()


async def start_servers(served_model_name: str, usage_token: str) -> Servers:
    sim = build_simulator(
        EngineConfig(
            served_model_name=served_model_name,
            block_size=BLOCK_SIZE,
            enable_prompt_tokens_details=True,
            enable_per_request_metrics=True,
        )
    )
    sim_runner, sim_port = await start_site(create_sim_app(sim), "127.0.0.1", 0)
    simulator_url = f"http://127.0.0.1:{sim_port}"
    exporter_port = free_port()
    config = Config(
        web_listen_address=f"127.0.0.1:{exporter_port}",
        vllm_url=(simulator_url,),
        usage_ingest_token=usage_token,
        signals_granularity=BLOCK_SIZE,
    )
    exporter_runner = web.AppRunner(create_app(config), access_log=None)
    await exporter_runner.setup()
    await web.TCPSite(exporter_runner, "127.0.0.1", exporter_port).start()
    return Servers(
        simulator_url, f"http://127.0.0.1:{exporter_port}", [sim_runner, exporter_runner]
    )


async def metrics_text(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(base_url + "/metrics") as response:
        assert response.status == 200
        return await response.text()


def counter_sum(text: str, name: str) -> float:
    """A counter summed over all its series (vLLM's counters, one series per engine)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric(text: str, name: str, **labels: str) -> float:
    found = value(text, name, **labels)
    return 0.0 if found is None else found


@dataclass(frozen=True)
class Caller:
    """One agent and how LiteLLM learns its name: API key, body fields, headers."""

    name: str  # the caller label the exporter must show
    api_key: str
    body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


def session_fields(method: str, session_id: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Body fields and headers that name the conversation, the three ways LiteLLM takes."""
    if method == "header":
        return {}, {"x-litellm-session-id": session_id}
    if method == "metadata":
        return {"metadata": {"session_id": session_id}}, {}
    if method == "body":
        return {"litellm_session_id": session_id}, {}
    raise ValueError(method)


@dataclass
class Conversation:
    """A multi-turn agent conversation: its own system prompt, the whole history re-sent each
    turn (so each turn extends the previous one's prompt), one answer mode per turn."""

    caller: Caller
    session_id: str
    session_method: str
    modes: list[str]  # whole | stream | stream_usage
    system_words: int
    seed: int
    messages: list[dict[str, str]] = field(default_factory=list)
    # vLLM's per-request metrics of the whole answers, as the client got them through LiteLLM
    whole_metrics: list[dict[str, Any]] = field(default_factory=list)
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.messages = [{"role": "system", "content": self.prose(self.system_words)}]

    def prose(self, words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(words)) + "."

    async def turn(
        self, session: aiohttp.ClientSession, proxy_url: str, model: str, index: int
    ) -> None:
        self.messages.append(
            {"role": "user", "content": f"step {index}: " + self.prose(USER_TURN_WORDS)}
        )
        answer, metrics = await chat(session, proxy_url, model, self, self.modes[index])
        if metrics is not None:
            self.whole_metrics.append(metrics)
        self.messages.append({"role": "assistant", "content": answer})


async def chat(
    session: aiohttp.ClientSession,
    proxy_url: str,
    model: str,
    conversation: Conversation,
    mode: str,
) -> tuple[str, dict[str, Any] | None]:
    """One call through LiteLLM; the assistant's text, and vLLM's per-request metrics when
    the client got them (a whole answer)."""
    caller = conversation.caller
    extra_body, session_headers = session_fields(
        conversation.session_method, conversation.session_id
    )
    body: dict[str, Any] = {
        "model": model,
        "messages": conversation.messages,
        "max_tokens": 4,
        **caller.body,
        **extra_body,
    }
    if mode != "whole":
        body["stream"] = True
    if mode == "stream_usage":
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {caller.api_key}", **caller.headers, **session_headers}
    async with session.post(
        proxy_url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        raw = await response.read()
        assert response.status == 200, raw[:500]
    if mode == "whole":
        answer = json.loads(raw)
        return answer["choices"][0]["message"]["content"], answer.get("metrics")
    text = ""
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for choice in json.loads(event[len(b"data: ") :]).get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
    assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
    return text, None


async def interleaved(
    session: aiohttp.ClientSession, proxy_url: str, model: str, conversations: list[Conversation]
) -> None:
    """Turn 1 of each conversation, then turn 2 of each, ...: one caller's conversations
    take turns, so a caller's previous call is always another conversation's."""
    for index in range(len(conversations[0].modes)):
        for conversation in conversations:
            await conversation.turn(session, proxy_url, model, index)
