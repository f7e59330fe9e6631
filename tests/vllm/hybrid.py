"""Real hybrid models on vLLM 0.32 (CPU), played once per model for the tests of
``test_hybrid.py``: the server, the exporter (its tap in front of vLLM, and a second one fed
the same usage through ``POST /v1/usage``), three agent conversations, and the moments while
all of them run a turn at once.

Everything that needs a live process happens here, in one ``asyncio.run`` per model; the
tests then assert over what was seen (``Played``). The conversations are sized in granules of
the model, so that every turn's prompt crosses at least one granule boundary past the last:

- alice and bob: a system prompt of 3 G tokens of their own, then six turns of 1.2 G each
  (1 cold, 5 warm);
- carol: the same for four turns, then a fifth that rewrites her second message: vLLM can
  only resume at her first turn's last granule (a true partial hit);
- then all three at once ask one more short turn that decodes ``PROBE_TOKENS`` tokens: while
  they all decode, the exporter's demand for them is set against vLLM's own used KV tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from exporter.check import Report, describe
from exporter.engine.parse import parse
from exporter.values import UsageEvent
from tests.helpers import value
from tests.vllm.harness import WORDS, Exporter, start_exporter, vllm_counter

# The granule each tiny hybrid gets on vLLM 0.32 (CPU), and the batching it must keep to:
# the CPU Mamba2 kernel ends the engine when one step prefills more than one granule of a
# request (vLLM then exports a mid-chunk state checkpoint, which the CPU scan cannot:
# IndexError in mamba_mixer2). --max-num-batched-tokens at the granule is enough, however
# many requests share a step: the scheduler ends every chunk but a prompt's last on a
# granule boundary and holds a request back rather than start it off one
# (Scheduler._mamba_block_aligned_split).
ARCHITECTURES = {"granite-2048": 2048, "nemotron-h-384": 384}
MAX_MODEL_LEN = 32_768
# The granule is sized to hold one recurrent state page, so it follows the state's dtype,
# and vLLM's CPU build picks that by host: float32 where the CPU has AVX-512 BF16
# (platforms/cpu.py resets it for the Mamba2 kernel), else the model's bfloat16, which
# halves Granite's granule to 1,024 (NemotronH defaults to float32 everywhere). Pinned to
# float32, every host gets the granules above, and the batching that goes with them.
BASE_ARGS = (
    "--enforce-eager",
    "--enable-prefix-caching",
    "--seed",
    "0",
    "--mamba-ssm-cache-dtype",
    "float32",
)
SYSTEM_GRANULES = 3.0
TURN_GRANULES = 1.2
TURNS = 6
EDIT_AFTER = 4  # carol's fifth turn rewrites her second message
PROBE_TOKENS = 192
# Tokens per word of harness.WORDS with the tokenizer build_model.py trains (measured: 1.0).
TOKENS_PER_WORD = 1.0
CALLERS = ("alice", "bob", "carol")
# No call to a tiny model takes more than a minute, even on two busy cores.
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=300)
# vLLM counts a finished request on its next engine step, and its /metrics can lag the
# answers by seconds on a busy machine: counters are polled for, at most this long.
STATS_DEADLINE_SECONDS = 60.0


def server_args(granule: int) -> tuple[str, ...]:
    return (
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enable-prompt-tokens-details",
        "--max-num-batched-tokens",
        str(granule),
    )


def prose(rng: random.Random, tokens: float) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(int(tokens / TOKENS_PER_WORD))) + "."


@dataclass
class Turn:
    caller: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class Moment:
    """One exporter scrape while every conversation's probe turn was decoding."""

    demand_tokens: float
    used_tokens: float
    running: float
    conversations: float


@dataclass
class Played:
    architecture: str
    granule: int
    model: str
    target: str  # as the exporter labels it
    boot_seconds: float
    cache_config: dict[str, str]
    turns: dict[str, list[Turn]] = field(default_factory=dict)
    tap_events: list[UsageEvent] = field(default_factory=list)
    tap_text: str = ""  # the tap exporter's /metrics after the conversations
    ingest_text: str = ""  # the other one's, after the same usage via POST /v1/usage
    vllm_before: str = ""
    vllm_after: str = ""
    moments: list[Moment] = field(default_factory=list)
    usage_after: float | None = None  # vLLM's kv_cache_usage_perc once the probes finished
    check: Report | None = None


class Chat:
    """One conversation through the tap."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        tap_url: str,
        model: str,
        caller: str,
        granule: int,
        seed: int,
    ) -> None:
        self.session = session
        self.url = tap_url + "/v1/chat/completions"
        self.model = model
        self.caller = caller
        self.granule = granule
        self.rng = random.Random(seed)
        self.messages = [{"role": "system", "content": prose(self.rng, SYSTEM_GRANULES * granule)}]
        self.turns: list[Turn] = []

    def user_text(self, index: int) -> str:
        return f"step {index}: " + prose(self.rng, TURN_GRANULES * self.granule)

    async def turn(self, text: str, max_tokens: int = 8, record: bool = True) -> Turn:
        self.messages.append({"role": "user", "content": text})
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        if max_tokens > 8:
            body["ignore_eos"] = True  # vLLM's: decode exactly max_tokens
        async with self.session.post(
            self.url, json=body, headers={"X-Caller": self.caller}
        ) as response:
            raw = await response.read()
            assert response.status == 200, raw[:500]
        answer = json.loads(raw)
        usage = answer["usage"]
        self.messages.append(
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
        )
        turn = Turn(
            self.caller,
            usage["prompt_tokens"],
            (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            usage["completion_tokens"],
        )
        if record:
            self.turns.append(turn)
        return turn


async def _vllm_metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as response:
        assert response.status == 200
        return await response.text()


async def _until(session: aiohttp.ClientSession, url: str, ready: Any) -> str:
    """vLLM's /metrics once ``ready(text)`` holds (polled: no event crosses the process)."""
    deadline = time.monotonic() + STATS_DEADLINE_SECONDS
    while True:
        text = await _vllm_metrics(session, url)
        if ready(text):
            return text
        assert time.monotonic() < deadline, "vLLM's /metrics never showed it"
        await asyncio.sleep(0.05)


def _usage_record(event: UsageEvent) -> dict[str, Any]:
    """A tap event as the native format of POST /v1/usage carries it."""
    record = {
        "caller": event.caller,
        "model": event.model,
        "prompt_tokens": event.prompt_tokens,
        "cached_tokens": event.cached_tokens,
        "completion_tokens": event.completion_tokens,
        "session": event.session,
        "time": event.time,
        "status": event.status,
        "max_tokens": event.max_tokens,
    }
    return {key: item for key, item in record.items() if item is not None}


async def _post_usage(
    session: aiohttp.ClientSession, exporter: Exporter, events: list[UsageEvent]
) -> None:
    host, port = exporter.config.listen_host_port
    async with session.post(
        f"http://{host}:{port}/v1/usage", json=[_usage_record(event) for event in events]
    ) as response:
        reply = await response.json()
        assert response.status == 200 and reply["accepted"] == len(events), reply


async def play(played: Played, vllm_url: str) -> None:
    """The conversations, the probe and the reads, against the vLLM at ``vllm_url``."""
    # Module-scoped: the tests' autouse fixture that turns the new-series hold off is not
    # active here, so the configuration does it (run's defaults otherwise: no state flag).
    tap = await start_exporter(vllm_url, usage_new_series_hold=0.0)
    ingest = await start_exporter(vllm_url, usage_new_series_hold=0.0)
    try:
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            played.vllm_before = await _vllm_metrics(session, vllm_url)
            granules = {
                int(config.fields["block_size"])
                for config in parse(played.vllm_before).cache_configs.values()
            }
            assert granules == {played.granule}, (
                f"vLLM sized the granule to {granules} tokens, not the {played.granule:,} "
                "the conversations are sized and the steps batched for (a step of more "
                "than one granule ends the engine: the CPU Mamba2 kernel)"
            )
            chats = [
                Chat(session, tap.tap_url, played.model, caller, played.granule, seed)
                for seed, caller in enumerate(CALLERS, start=11)
            ]

            async def converse(chat: Chat) -> None:
                for index in range(TURNS if chat.caller != "carol" else EDIT_AFTER):
                    await chat.turn(chat.user_text(index))
                if chat.caller == "carol":  # rewrite her second message, then go on
                    chat.messages = (
                        chat.messages[:3]
                        + [{"role": "user", "content": chat.user_text(1)}]
                        + chat.messages[4:]
                    )
                    await chat.turn(chat.user_text(EDIT_AFTER))

            await asyncio.gather(*(converse(chat) for chat in chats))
            played.turns = {chat.caller: chat.turns for chat in chats}
            played.tap_events = list(tap.recorded)
            prompts = sum(turn.prompt_tokens for chat in chats for turn in chat.turns)
            queries = "vllm:prefix_cache_queries_total"
            before = vllm_counter(played.vllm_before, queries)
            played.vllm_after = await _until(
                session, vllm_url, lambda text: vllm_counter(text, queries) - before >= prompts
            )
            played.tap_text = await tap.scrape(session)
            await _post_usage(session, ingest, played.tap_events)
            played.ingest_text = await ingest.scrape(session)
            report = Report(vllm_url + "/metrics")
            describe(parse(played.vllm_after), report, headroom=4096)
            played.check = report
            await _probe(played, session, tap, chats, vllm_url)
    finally:
        await tap.close()
        await ingest.close()


async def _probe(
    played: Played, session: aiohttp.ClientSession, tap: Exporter, chats: list[Chat], vllm_url: str
) -> None:
    """Every conversation runs one more short turn at once, decoding PROBE_TOKENS tokens;
    while all of them decode, the tap exporter's scrape (which reads vLLM then) gives both
    its demand for them and vLLM's used KV tokens."""
    first_tokens = "vllm:time_to_first_token_seconds_count"
    start = vllm_counter(await _vllm_metrics(session, vllm_url), first_tokens)
    probes = [
        asyncio.ensure_future(chat.turn("go on.", PROBE_TOKENS, record=False)) for chat in chats
    ]
    labels = {"target": played.target, "model_name": played.model}
    deadline = time.monotonic() + STATS_DEADLINE_SECONDS
    while len(played.moments) < 3 and not all(probe.done() for probe in probes):
        assert time.monotonic() < deadline, "the probe turns never ran together"
        # All of them past their prefill (each has its first token) and still decoding.
        text = await _vllm_metrics(session, vllm_url)
        if value(text, "vllm:num_requests_running") != len(chats) or vllm_counter(
            text, first_tokens
        ) - start < len(chats):
            await asyncio.sleep(0.02)
            continue
        scraped = await tap.scrape(session)
        running = value(scraped, "vllm_cache_engine_requests_running", **labels)
        if running != len(chats):
            continue
        played.moments.append(
            Moment(
                value(scraped, "vllm_cache_engine_conversations_demand_tokens", **labels) or 0.0,
                value(scraped, "vllm_cache_engine_kv_used_tokens", **labels) or 0.0,
                running,
                value(scraped, "vllm_cache_engine_conversations_active", **labels) or 0.0,
            )
        )
    await asyncio.gather(*probes)
    after = await _until(
        session, vllm_url, lambda text: value(text, "vllm:num_requests_running") == 0
    )
    played.usage_after = value(after, "vllm:kv_cache_usage_perc")
