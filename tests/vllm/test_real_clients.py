"""The real client libraries agents use, through the tap, against a real vLLM 0.32 (CPU):
counted exactly, and answered exactly as vLLM answers them directly.

For every kind of call (the ``openai`` SDK sync and async, chat and completions whole and
streamed with and without ``include_usage``, completions with ``echo``, the Responses API
whole and streamed, tool calls ``required``, named and ``auto``; the ``anthropic`` SDK's
Messages whole and streamed), eight four-turn conversations (32 calls, at least 30 streams
of each streamed kind) run through the tap from the client's own process, as an agent runs.
Then, for that kind:

- the caller's prompt and cached totals on the exporter's /metrics equal the increase of
  vLLM's own ``vllm:prompt_tokens_total`` and ``vllm:prefix_cache_hits_total`` exactly;
- every call is recorded, none as an error (vLLM completed them all), nothing is rejected;
  the sync ``openai`` client closes a stream at ``[DONE]`` before the chunked terminator,
  which used to cost 10-13% of such a caller's tokens;
- the client's parsed output (``model_dump`` of the answer or of every stream event) equals
  what the same conversation gets from vLLM directly, ids, timestamps, generated text and
  the figures that depend on the cache's state (cached counts, timings) aside: a client
  that did not ask for usage gets no usage chunk and keeps ``system_fingerprint``.

vLLM runs with the flags the README recommends (``--enable-prefix-caching
--enable-prompt-tokens-details --enable-per-request-metrics``) and a tool-call parser (for
``auto``, and for ``required``/named tool choice, which vLLM refuses without one).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.clients.bootstrap import BootstrapError, ensure_clients
from tests.vllm.harness import (
    metric,
    start_exporter,
    vllm_counter,
    vllm_metrics,
    vllm_metrics_after,
)
from tests.vllm.server import MODEL_NAME, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

AGENT = Path(__file__).resolve().parents[1] / "clients" / "agent.py"
CONVERSATIONS = 8
TURNS = 4
# kind -> the end user the client names (OpenAI ``user``, Anthropic ``metadata.user_id``),
# or None: the caller is then the API key's short hash.
KINDS: dict[str, str | None] = {
    "chat_whole": None,
    "chat_stream": None,
    "chat_stream_usage": "agent-chat",
    "chat_stream_async": None,
    "chat_stream_usage_async": None,
    "completions_whole": None,
    "completions_echo": None,
    "completions_stream": None,
    "completions_stream_usage": None,
    "responses_whole": "agent-responses",
    "responses_stream": None,
    "tools_required": None,
    "tools_named": None,
    "tools_auto": None,
    "messages_whole": None,
    "messages_stream": "agent-messages",
}
# Counted on their own terms (test_several_sequences_...): vLLM counts their prompt n times.
OTHER_KINDS: dict[str, str | None] = {"chat_n2": None}
VLLM_FLAGS = (
    "--max-model-len",
    "4096",
    "--enable-prompt-tokens-details",
    "--enable-per-request-metrics",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
)
AGENT_TIMEOUT_SECONDS = 600
# Keys whose values differ from call to call whatever the proxy does: ids and times, the
# generated text, and what depends on the cache's state at that moment.
UNSTABLE = frozenset(
    {
        "id",
        "item_id",
        "created",
        "created_at",
        "completed_at",
        "obfuscation",
        "sequence_number",
        "text",
        "content",
        "delta",
        "arguments",
        "thinking",
        "partial_json",
        "output_text",
        "cached_tokens",
        "created_cache_tokens",
        "cache_write_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
        "metrics",
        "logprobs",
    }
)


@pytest.fixture(scope="session")
def clients_python(pytestconfig: pytest.Config) -> Path:
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")

    def announce(message: str) -> None:
        with capture.global_and_fixture_disabled():
            print(f"\n{message}", flush=True)

    try:
        return ensure_clients(announce=announce)
    except BootstrapError as err:
        pytest.fail(f"cannot prepare the client libraries: {err}", pytrace=False)


@pytest.fixture(scope="module")
def vllm(
    vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    server = VllmServer(
        vllm_python, tiny_model, tmp_path_factory.mktemp("vllm-clients"), "clients", VLLM_FLAGS
    )
    server.start()
    try:
        took = server.wait_ready()
        print(f"vLLM healthy after {took:.1f}s on {server.url}")
        yield server
    finally:
        server.stop()


def expected_caller(kind: str) -> str:
    named = {**KINDS, **OTHER_KINDS}[kind]
    return named or "key-" + hashlib.sha256(api_key(kind).encode()).hexdigest()[:12]


def api_key(kind: str) -> str:
    return f"sk-test-{kind}"


async def run_agent(python: Path, base_url: str, kind: str, seeds: list[int]) -> list[Any]:
    plan = {
        "base_url": base_url,
        "kind": kind,
        "api_key": api_key(kind),
        "seeds": seeds,
        "turns": TURNS,
        "user": {**KINDS, **OTHER_KINDS}[kind],
    }
    process = await asyncio.create_subprocess_exec(
        str(python),
        str(AGENT),
        json.dumps(plan),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), AGENT_TIMEOUT_SECONDS)
    assert process.returncode == 0, err.decode(errors="replace")[-3000:]
    return json.loads(out)["calls"]


def stable(value: Any) -> Any:
    """``value`` without what differs from call to call (see UNSTABLE). A run of stream
    events that differ only in their text counts once: how many pieces a text comes in is
    the text's (a random-weight model's near-even logits let a cached and an uncached
    prefill pick different tokens)."""
    if isinstance(value, dict):
        return {
            key: "*" if key in UNSTABLE and item is not None else stable(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        items: list[Any] = []
        for item in map(stable, value):
            if not items or item != items[-1] or not isinstance(item, dict):
                items.append(item)
        return items
    return value


def anthropic_prompt(usage: dict[str, Any]) -> int:
    return (
        usage["input_tokens"]
        + (usage.get("cache_read_input_tokens") or 0)
        + (usage.get("cache_creation_input_tokens") or 0)
    )


def client_prompt_tokens(usage: dict[str, Any]) -> int:
    if "cache_read_input_tokens" in usage:
        return anthropic_prompt(usage)
    return usage.get("prompt_tokens", usage.get("input_tokens"))


def without_input_split(value: Any) -> Any:
    """Anthropic's ``input_tokens`` is the prompt less what the cache held at that moment:
    compared as the whole prompt."""
    if isinstance(value, dict):
        if "cache_read_input_tokens" in value and "input_tokens" in value:
            value = {**value, "input_tokens": anthropic_prompt(value)}
        return {key: without_input_split(item) for key, item in value.items()}
    if isinstance(value, list):
        return [without_input_split(item) for item in value]
    return value


@pytest.mark.parametrize("kind", list(KINDS))
async def test_a_real_client_is_counted_exactly_and_answered_as_vllm_answers(
    kind: str, vllm: VllmServer, clients_python: Path
) -> None:
    exporter = await start_exporter(vllm.url)
    index = list(KINDS).index(kind)
    seeds = [1000 * (index + 1) + n for n in range(CONVERSATIONS)]
    caller = expected_caller(kind)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            before = await vllm_metrics(session, vllm.url)
            calls = await run_agent(clients_python, exporter.tap_url, kind, seeds)
            assert len(calls) == CONVERSATIONS * TURNS
            after = await vllm_metrics_after(session, vllm.url, before, len(calls))
            scrape = await exporter.scrape(session)

            # Counted exactly: the caller's totals are vLLM's own counts of the same calls.
            prompt = vllm_counter(after, "vllm:prompt_tokens_total") - vllm_counter(
                before, "vllm:prompt_tokens_total"
            )
            hits = vllm_counter(after, "vllm:prefix_cache_hits_total") - vllm_counter(
                before, "vllm:prefix_cache_hits_total"
            )
            labels = {"caller": caller, "model": MODEL_NAME}
            assert metric(scrape, "vllm_cache_prompt_tokens_total", **labels) == prompt > 0
            assert metric(scrape, "vllm_cache_cached_tokens_total", **labels) == hits > 0
            assert metric(scrape, "vllm_cache_unreported_prompt_tokens_total", **labels) == 0
            # Every call recorded once, none as an error, nothing refused.
            states = {event.status for event in exporter.recorded}
            assert len(exporter.recorded) == len(calls) and states == {200}, states
            assert metric(scrape, "vllm_cache_requests_total", state="error", **labels) == 0
            assert {event.caller for event in exporter.recorded} == {caller}
            assert vllm_counter(scrape, "vllm_cache_usage_events_rejected_total") == 0
            # Where the client saw the usage, the tap recorded the same figures.
            for call, event in zip(calls, exporter.recorded, strict=True):
                if call["usage"] is not None:
                    assert client_prompt_tokens(call["usage"]) == event.prompt_tokens

            # Answered as vLLM answers: the first conversation again, straight to vLLM.
            direct = await run_agent(clients_python, vllm.url, kind, seeds[:1])
        through_tap = [call for call in calls if call["seed"] == seeds[0]]
        for tapped, straight in zip(through_tap, direct, strict=True):
            assert stable(without_input_split(tapped["parsed"])) == stable(
                without_input_split(straight["parsed"])
            ), (kind, tapped["turn"])
            assert (tapped["usage"] is None) == (straight["usage"] is None)
    finally:
        await exporter.close()


async def test_several_sequences_of_one_prompt_are_not_read_as_a_warm_first_turn(
    vllm: VllmServer, clients_python: Path
) -> None:
    """``n=2``: vLLM runs the prompt twice; its counters count it twice, the usage once,
    and the usage's cached count is one sequence's, which found the blocks its sibling had
    just written (so even a first turn comes back almost wholly cached). The exporter counts
    the prompt once, as not reported, and classifies no such request: ``unknown``."""
    kind = "chat_n2"
    exporter = await start_exporter(vllm.url)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            before = await vllm_metrics(session, vllm.url)
            calls = await run_agent(clients_python, exporter.tap_url, kind, [9001, 9002])
            # vLLM finishes (and times) each of the two sequences as a request of its own.
            after = await vllm_metrics_after(session, vllm.url, before, 2 * len(calls))
            scrape = await exporter.scrape(session)
        first_turns = [call for call in calls if call["turn"] == 0]
        reported = [call["usage"]["prompt_tokens_details"]["cached_tokens"] for call in first_turns]
        assert all(cached > 0 for cached in reported), reported  # the siblings' blocks
        prompt = vllm_counter(after, "vllm:prompt_tokens_total") - vllm_counter(
            before, "vllm:prompt_tokens_total"
        )
        labels = {"caller": expected_caller(kind), "model": MODEL_NAME}
        counted = metric(scrape, "vllm_cache_unreported_prompt_tokens_total", **labels)
        assert counted == prompt / 2 == sum(call["usage"]["prompt_tokens"] for call in calls)
        # Out of the hit ratio: neither its numerator nor its denominator.
        assert metric(scrape, "vllm_cache_prompt_tokens_total", **labels) == 0
        assert metric(scrape, "vllm_cache_cached_tokens_total", **labels) == 0
        assert metric(scrape, "vllm_cache_requests_total", state="unknown", **labels) == len(calls)
        assert metric(scrape, "vllm_cache_requests_total", state="warm", **labels) == 0
    finally:
        await exporter.close()
