"""End to end through a real LiteLLM proxy (1.108.7, from PyPI) configured as the README says:
what the exporter says per caller must be what the simulated vLLM did.

Simulator and exporter run in this process; LiteLLM runs from its own venv with the README's
``config.yaml`` (only its two URLs pointed here) and the README's environment, plus a
``custom_auth`` hook standing in for the key database (see ``keys_auth.py``). Four callers,
named each way the README documents (OpenAI ``user``, ``x-litellm-end-user-id`` header, a
key's alias, a key's team alias), each hold two conversations whose turns interleave, every
conversation named by session id (header, ``metadata.session_id`` or
``litellm_session_id``), answers whole and streamed. Callers run one after another so the
simulator's counters can be read between them.

Checked: each caller's cached and prompt tokens in the exporter equal the increase of the
simulator's ``vllm:prefix_cache_hits_total`` and ``vllm:prompt_tokens_total`` during that
caller's turns; first turns are cold and every later turn warm (judged against its own
conversation: without the session the second conversation's turns read as partial); each
streamed turn has a TTFT; a failed call is an error of its caller; nothing LiteLLM sent was
rejected. The simulator answers as vLLM with ``--enable-per-request-metrics``: each whole
answer's TTFT and queue wait are vLLM's own (``source="engine"``), equal to the metrics object
the client got, and each streamed turn's is LiteLLM's (``source="proxy"``): never one series.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import time
from pathlib import Path

import aiohttp
import pytest

from tests.litellm.harness import (
    Caller,
    Conversation,
    counter_sum,
    interleaved,
    metric,
    metrics_text,
    start_servers,
)
from tests.litellm.keys_auth import KEYS_ENV
from tests.litellm.proxy import LiteLLMProxy, proxy_config, readme_environment

pytestmark = [pytest.mark.litellm, pytest.mark.e2e]

HERE = Path(__file__).resolve().parent
# One call through LiteLLM to the simulator takes well under a second; a hung one fails here.
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=120)
# LiteLLM posts its batch every 5 s: a few flushes, on two busy cores.
EVENTS_DEADLINE_SECONDS = 60.0
STATES = ("warm", "partial", "cold", "short", "unknown", "error")
# Conversation A's system prompt is longer than B's, and each turn adds more than two granules
# (48 words, 3 template tokens, the answer), so a turn of B judged against A's previous turn
# rather than its own is partial: the test fails if the session is not read.
MODES_A = ["whole", "stream", "stream_usage"]
MODES_B = ["stream", "whole", "stream"]
STREAMED_TURNS = sum(mode != "whole" for mode in MODES_A + MODES_B)
WHOLE_TURNS = len(MODES_A + MODES_B) - STREAMED_TURNS
TIMED_STATES = ("warm", "partial", "cold", "short", "unknown")


def callers(master_key: str) -> tuple[list[Caller], dict[str, dict[str, str]]]:
    """The four callers and the custom-auth key records two of them use."""
    keys = {
        "sk-test-research-key": {
            "key_alias": "research-agent",
            "team_id": "team-1",
            "team_alias": "platform",
        },
        "sk-test-team-key": {"team_id": "team-2", "team_alias": "data-team"},
    }
    return [
        Caller("batch-summarizer", master_key, body={"user": "batch-summarizer"}),
        Caller("ide-assistant", master_key, headers={"x-litellm-end-user-id": "ide-assistant"}),
        Caller("research-agent", "sk-test-research-key"),  # the key's alias beats its team's
        Caller("data-team", "sk-test-team-key"),
    ], keys


def events_expected(all_callers: list[Caller]) -> int:
    """Every turn of every caller, and the one failed call."""
    return len(all_callers) * len(MODES_A + MODES_B) + 1


def conversations_of(caller: Caller, number: int) -> list[Conversation]:
    methods = ("header", "metadata", "body")
    return [
        Conversation(
            caller,
            f"{caller.name}-conv-a",
            methods[number % 3],
            MODES_A,
            system_words=300,
            seed=2 * number,
        ),
        Conversation(
            caller,
            f"{caller.name}-conv-b",
            methods[(number + 1) % 3],
            MODES_B,
            system_words=150,
            seed=2 * number + 1,
        ),
    ]


async def fail_once(
    session: aiohttp.ClientSession, proxy_url: str, model: str, caller: Caller
) -> None:
    """A call vLLM refuses (n=2 is not supported by the simulator): LiteLLM logs a failure."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "two answers please"}],
        "max_tokens": 4,
        "n": 2,
        **caller.body,
    }
    headers = {"Authorization": f"Bearer {caller.api_key}", **caller.headers}
    async with session.post(
        proxy_url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        assert response.status >= 400, await response.text()


async def wait_for_events(session: aiohttp.ClientSession, exporter_url: str, expected: int) -> str:
    """The exporter's /metrics once it has accepted ``expected`` events over HTTP."""
    deadline = time.monotonic() + EVENTS_DEADLINE_SECONDS
    while True:
        text = await metrics_text(session, exporter_url)
        accepted = metric(text, "vllm_cache_usage_events_total", reader="http")
        if accepted >= expected or time.monotonic() > deadline:
            return text
        await asyncio.sleep(0.5)


async def drive(
    proxy_url: str, simulator_url: str, exporter_url: str, model: str, all_callers: list[Caller]
) -> tuple[dict[str, tuple[float, float]], str, dict[str, list[dict]]]:
    """Each caller's conversations in turn, then one failed call. Returns the increase of
    the simulator's (prefix-cache hits, prompt tokens) during each caller's turns, the
    exporter's /metrics once it has every event, and the per-request metrics each caller's
    whole answers carried."""
    expected = {}
    whole_metrics: dict[str, list[dict]] = {}
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        for number, caller in enumerate(all_callers):
            before = await metrics_text(session, simulator_url)
            conversations = conversations_of(caller, number)
            await interleaved(session, proxy_url, model, conversations)
            whole_metrics[caller.name] = [
                metrics for conversation in conversations for metrics in conversation.whole_metrics
            ]
            after = await metrics_text(session, simulator_url)
            expected[caller.name] = (
                counter_sum(after, "vllm:prefix_cache_hits_total")
                - counter_sum(before, "vllm:prefix_cache_hits_total"),
                counter_sum(after, "vllm:prompt_tokens_total")
                - counter_sum(before, "vllm:prompt_tokens_total"),
            )
        await fail_once(session, proxy_url, model, all_callers[0])
        text = await wait_for_events(session, exporter_url, events_expected(all_callers))
    return expected, text, whole_metrics


async def test_per_caller_cache_signals_through_litellm_match_the_simulator(
    litellm_venv: Path, tmp_path: Path
):
    started = time.monotonic()
    usage_token, master_secret = secrets.token_hex(16), secrets.token_hex(16)
    environment = readme_environment(
        {"LITELLM_MASTER_KEY": master_secret, "GENERIC_LOGGER_HEADERS": usage_token}
    )
    all_callers, keys = callers(environment["LITELLM_MASTER_KEY"])
    environment[KEYS_ENV] = json.dumps(keys)
    readme_model = proxy_config("http://vllm:8000", "http://vllm-cache-exporter:10123")[
        "model_list"
    ][0]
    client_model = readme_model["model_name"]
    served_model = readme_model["litellm_params"]["model"].removeprefix("hosted_vllm/")

    servers = await start_servers(served_model, usage_token)
    config = proxy_config(servers.simulator_url, servers.exporter_url)
    config.setdefault("general_settings", {})["custom_auth"] = "keys_auth.user_api_key_auth"
    shutil.copy(HERE / "keys_auth.py", tmp_path / "keys_auth.py")
    proxy = LiteLLMProxy(litellm_venv, config, tmp_path, environment)
    try:
        proxy.start()
        boot_seconds = await asyncio.to_thread(proxy.wait_ready)
        expected, text, whole_metrics = await drive(
            proxy.url, servers.simulator_url, servers.exporter_url, client_model, all_callers
        )
    except BaseException:
        print(f"\n----- last lines of {proxy.log_path} -----\n{proxy.log_tail()}")
        raise
    finally:
        proxy.stop()
        await servers.close()
    print(f"LiteLLM live after {boot_seconds:.1f}s; test took {time.monotonic() - started:.1f}s")

    assert metric(text, "vllm_cache_usage_events_total", reader="http") == events_expected(
        all_callers
    )
    assert not [
        line
        for line in text.splitlines()
        if line.startswith("vllm_cache_usage_events_rejected_total{") and not line.endswith(" 0.0")
    ], "LiteLLM sent events the exporter rejected"
    for caller in all_callers:
        labels = {"caller": caller.name, "model": served_model}
        hits, prompt = expected[caller.name]
        assert hits > 0
        assert (
            metric(text, "vllm_cache_cached_tokens_total", **labels),
            metric(text, "vllm_cache_prompt_tokens_total", **labels),
        ) == (hits, prompt), caller.name
        states = {
            state: metric(text, "vllm_cache_requests_total", state=state, **labels)
            for state in STATES
        }
        errors = 1 if caller is all_callers[0] else 0
        assert states == {
            "warm": 4,
            "partial": 0,
            "cold": 2,
            "short": 0,
            "unknown": 0,
            "error": errors,
        }, caller.name

        def timed(
            stat: str,
            source: str,
            family: str = "vllm_cache_ttft_seconds",
            labels: dict[str, str] = labels,
        ) -> float:
            states = TIMED_STATES if family == "vllm_cache_ttft_seconds" else (None,)
            return sum(
                metric(
                    text,
                    f"{family}_{stat}",
                    source=source,
                    **labels,
                    **({"state": state} if state else {}),
                )
                for state in states
            )

        # Streamed turns: LiteLLM's own first-chunk time. Whole answers: vLLM's own TTFT and
        # queue wait, exactly those of the metrics object the client got through LiteLLM.
        assert timed("count", "proxy") == STREAMED_TURNS, caller.name
        seen = whole_metrics[caller.name]
        assert len(seen) == WHOLE_TURNS == timed("count", "engine"), caller.name
        assert timed("sum", "engine") == pytest.approx(
            sum(m["time_to_first_token_ms"] for m in seen) / 1000, abs=1e-9
        )
        assert timed("count", "engine", "vllm_cache_queue_wait_seconds") == WHOLE_TURNS
        assert timed("sum", "engine", "vllm_cache_queue_wait_seconds") == pytest.approx(
            sum(m["queue_time_ms"] for m in seen) / 1000, abs=1e-9
        )
        assert timed("count", "proxy", "vllm_cache_queue_wait_seconds") == 0
