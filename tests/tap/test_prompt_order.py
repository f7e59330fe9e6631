"""Prompt order through the real tap in front of the simulator: the field report's fan-out
layouts (shared prefix first; per-agent part first; unrelated prompts) and a timestamp at the
top, as an OpenAI client sends them. The diagnosis names the two broken layouts, stays silent
on the good one and on unrelated prompts, and no prompt text reaches /metrics, the status
page or the logs."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from exporter.check import Report, describe_exporter, read_exporter
from exporter.config import Config
from exporter.server import create_app
from exporter.sim.scenario import parse_scenario
from exporter.sim.server import build_simulator, create_sim_app
from exporter.usage.tap import create_tap_app
from exporter.usage.tap.fingerprint import MAX_BLOCK_BYTES
from exporter.wiring import (
    signals_state,
    tap_record,
    tap_record_prompt,
    tap_reject,
    tap_settings,
)
from tests.helpers import value

from .conftest import FakeClock, RecordingUsage, Reply, fixture_bytes

KEY = bytes(range(16))
MODEL = "qwen3.8-27b"
ENGINE = {
    "name": "order",
    "report": "test",
    "reproduces": "prompt layouts",
    "engine": {
        "served_model_name": MODEL,
        "enable_prefix_caching": True,
        "enable_prompt_tokens_details": True,
        "kv_pool_tokens": 2_000_000,
        "block_size": 16,
        "max_model_len": 131072,
        "prefill_rate": 10_000_000.0,
        "decode_rate": 1_000_000.0,
    },
    "agents": [
        {"caller": "unused", "kind": "fanout", "rounds": 1, "shared_tokens": 16, "task_tokens": 16}
    ],
}
WORDS = (
    "the",
    "cache",
    "agent",
    "block",
    "prefix",
    "evidence",
    "report",
    "token",
    "pool",
    "model",
    "review",
    "summary",
    "finding",
    "source",
    "ledger",
    "query",
    "answer",
    "schema",
    "account",
    "invoice",
    "shipment",
    "warehouse",
    "customer",
    "contract",
)
WIDTH = 4
SHARED_CHARS = 9600  # ~2.4k tokens, as in the field report
TASK_CHARS = 1800  # ~457 tokens


def text(chars: int, seed: int) -> str:
    """Sentences and paragraphs of plain words, different for every seed."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < chars:
        sentence = " ".join(
            rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(rng.randint(6, 18))
        )
        sentence = sentence.capitalize() + (". " if rng.random() < 0.8 else ".\n")
        out.append(sentence)
        size += len(sentence)
    return "".join(out)


SHARED = text(SHARED_CHARS, 1)
TASKS = [f"You are agent {agent}. " + text(TASK_CHARS, 100 + agent) for agent in range(WIDTH)]
UNRELATED = [text(SHARED_CHARS + TASK_CHARS, 200 + agent) for agent in range(WIDTH)]
STAMPS = [
    f"Current time: 2026-11-30T14:{55 + agent:02d}:{agent * 7:02d}Z\n" for agent in range(WIDTH)
]


def chat(system: str, user: str, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }
    if stream:
        body["stream"] = True
    return body


# caller -> (path, the request body of each agent, the texts a leak would show)
LAYOUTS: dict[str, tuple[str, list[dict[str, Any]]]] = {
    "shared-first": ("/v1/chat/completions", [chat(SHARED, task) for task in TASKS]),
    "task-first": ("/v1/chat/completions", [chat(task, SHARED, stream=True) for task in TASKS]),
    "unrelated": ("/v1/chat/completions", [chat(other[:400], other[400:]) for other in UNRELATED]),
    "timestamp-top": (
        "/v1/chat/completions",
        [chat(stamp + SHARED, task) for stamp, task in zip(STAMPS, TASKS, strict=True)],
    ),
    "completions-id": (
        "/v1/completions",
        [
            {
                "model": MODEL,
                "max_tokens": 8,
                "prompt": f"request-id: {1000 + agent * 7919}\n" + SHARED + TASKS[agent],
            }
            for agent in range(WIDTH)
        ],
    ),
}
BROKEN = ("task-first", "timestamp-top", "completions-id")
SILENT = ("shared-first", "unrelated")
PROMPT_TEXTS = [SHARED, *TASKS, *UNRELATED]


def fragments(haystack: str, size: int = 16) -> set[str]:
    return {haystack[at : at + size] for at in range(len(haystack) - size + 1)}


def leaked(haystack: str) -> list[str]:
    """Fragments of 16 characters of any prompt sent that appear in ``haystack``."""
    seen = fragments(haystack)
    return [
        prompt[at : at + 16]
        for prompt in PROMPT_TEXTS
        for at in range(len(prompt) - 15)
        if prompt[at : at + 16] in seen
    ]


@pytest.fixture
async def stack(aiohttp_server: Callable[..., Awaitable[TestServer]]):
    """The simulator, the tap in front of it (a fixed digest key) and the exporter."""
    sim = build_simulator(parse_scenario(ENGINE, "test").engine_config())
    upstream = await aiohttp_server(create_sim_app(sim))
    config = Config(
        tap_listen_address="127.0.0.1:0", tap_upstream=str(upstream.make_url("")).rstrip("/")
    )
    clock = FakeClock(1_800_000_000.0)
    state = signals_state(config, clock=clock)
    settings = dataclasses.replace(tap_settings(config), fingerprint_key=KEY)
    tap = await aiohttp_server(
        create_tap_app(
            settings,
            tap_record(state.usage),
            tap_reject(state.usage),
            clock=clock,
            record_prompt=tap_record_prompt(state.usage),
        )
    )
    exporter = await aiohttp_server(create_app(config, state, initial_refresh=False))
    async with aiohttp.ClientSession() as session:
        yield session, str(tap.make_url("")).rstrip("/"), str(exporter.make_url("/")), clock


async def send(
    session: aiohttp.ClientSession, url: str, caller: str, path: str, body: dict[str, Any]
) -> None:
    async with session.post(
        url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Caller": caller},
    ) as response:
        assert response.status == 200, await response.text()
        await response.read()


async def fan_out(session: aiohttp.ClientSession, url: str, caller: str) -> None:
    path, bodies = LAYOUTS[caller]
    await asyncio.gather(*(send(session, url, caller, path, body) for body in bodies))


async def test_the_broken_layouts_are_named_and_no_prompt_text_shows(stack, caplog):
    caplog.set_level(logging.DEBUG)
    session, tap, exporter, _clock = stack
    for caller in LAYOUTS:
        await fan_out(session, tap, caller)
    async with session.get(exporter + "metrics") as response:
        metrics = await response.text()
    async with session.get(exporter) as response:
        page = await response.text()

    pair = {"model": MODEL}
    for caller in LAYOUTS:
        # every request after the first of its fan-out is compared with a recent one
        assert (
            value(metrics, "vllm_cache_prompt_order_compared_total", caller=caller, **pair)
            == WIDTH - 1
        ), caller
    for caller in SILENT:
        assert (
            value(metrics, "vllm_cache_prompt_order_variable_top_total", caller=caller, **pair) == 0
        ), caller
        assert caller not in " ".join(
            line for line in page.splitlines() if "variable sits at the top" in line
        )
    for caller in BROKEN:
        flagged = value(
            metrics, "vllm_cache_prompt_order_variable_top_total", caller=caller, **pair
        )
        assert flagged == WIDTH - 1, caller
        assert flagged is not None
        shared = (
            value(metrics, "vllm_cache_prompt_order_shared_bytes_total", caller=caller, **pair)
            / flagged
        )
        first = (
            value(
                metrics,
                "vllm_cache_prompt_order_first_difference_bytes_total",
                caller=caller,
                **pair,
            )
            / flagged
        )
        # ~N: most of the shared text, counted in whole blocks; M: within the varying part
        # and the block that holds its end
        assert 0.7 * SHARED_CHARS <= shared <= SHARED_CHARS + MAX_BLOCK_BYTES, caller
        varying = TASK_CHARS + 100 if caller == "task-first" else 60
        assert first <= varying + MAX_BLOCK_BYTES, caller
    # The same sentence on the status page and from check --exporter.url.
    report = Report("exporter")
    describe_exporter(read_exporter(metrics), report, 0)
    said = [note for note in report.notes if "variable sits at the top" in note]
    assert sorted(note.split(" on ")[0] for note in said) == sorted(BROKEN)
    for sentence in said:
        assert sentence.split(":")[0] in page
        assert sentence.split("characters")[0].split(" share ")[1] in page

    # No prompt text anywhere: not in /metrics, the page, or any log line at debug level.
    logs = "\n".join(
        record.getMessage()
        for record in caplog.records
        if not record.name.startswith("exporter.sim")
    )
    for where, haystack in (("/metrics", metrics), ("status page", page), ("logs", logs)):
        assert leaked(haystack) == [], where


async def test_requests_further_apart_than_the_window_are_not_compared(stack):
    session, tap, exporter, clock = stack
    path, bodies = LAYOUTS["task-first"]
    await send(session, tap, "task-first", path, bodies[0])
    clock.now += 301  # past the default window of 300 s
    await send(session, tap, "task-first", path, bodies[1])
    clock.now += 299
    await send(session, tap, "task-first", path, bodies[2])
    async with session.get(exporter + "metrics") as response:
        metrics = await response.text()
    labels = {"caller": "task-first", "model": MODEL}
    assert value(metrics, "vllm_cache_prompt_order_compared_total", **labels) == 1
    assert value(metrics, "vllm_cache_prompt_order_variable_top_total", **labels) == 1


async def test_a_failing_diagnosis_logs_no_prompt_and_costs_the_call_nothing(
    start_tap, upstream, caplog
):
    """Whatever goes wrong in the prompt-order step, the call is answered and recorded, and
    the log says what kind of failure it was, never the prompt (which an exception's message
    or a callback's arguments could carry)."""
    caplog.set_level(logging.DEBUG)
    upstream.reply("/v1/chat/completions", Reply(body=fixture_bytes("01_chat_cold.json")))
    failed = asyncio.Event()

    class Failing(RecordingUsage):
        def record_prompt(self, event: Any, prompt: Any) -> None:
            failed.set()
            raise ValueError(f"cannot keep {SHARED[:200]}")

    usage = Failing()
    harness = await start_tap(usage=usage)
    status, _headers, _body = await harness.post("/v1/chat/completions", chat(SHARED, TASKS[0]))
    assert status == 200
    assert (await usage.next_event()).prompt_tokens == 1395
    await asyncio.wait_for(failed.wait(), 5)
    logs = "\n".join(record.getMessage() for record in caplog.records)
    assert "tap: prompt order not recorded: ValueError" in logs
    assert leaked(logs) == []
