"""The engine cross-check of issue 35 against a real vLLM 0.32.0 (CPU build): per engine,
the prompt tokens no caller sent through the tap (bypassed) and the prefix-cache hits vLLM
counted more than once per request (recounted).

What vLLM 0.32 does, read in its source and held to here:

- ``vllm:prefix_cache_queries/hits`` are recorded in ``Scheduler.schedule()``
  (``v1/core/sched/scheduler.py``) through ``KVCacheManager.record_prefix_cache_stats``
  only *after* ``allocate_slots`` succeeded ("Record at admission so unscheduled lookups
  are not counted"): ``get_computed_blocks`` itself records nothing any more, so a
  request the scheduler retries after a KV-slot allocation failure (vllm#43736) is counted
  once, at the attempt that admitted it.
- A preempted request's re-admission is recorded with ``preempted=request.num_preemptions
  > 0``, which ``PrefixCacheStats.record`` (``v1/metrics/stats.py``) puts in
  ``preempted_queries/hits``; the Prometheus logger never exports those (vllm#25780,
  fixed by #25787).
- ``vllm:prompt_tokens_cached`` (and ``prompt_tokens``) are counted by the frontend at a
  request's first output from ``PrefillStats``, which the scheduler sets at every
  admission attempt of a never-preempted request, the successful one last, from the same
  ``num_new_local_computed_tokens`` it records as hits; the client's ``cached_tokens`` is
  that same ``PrefillStats.num_cached_tokens``.

So with every request finished and no KV connector, vLLM 0.32 recounts nothing: hits equal
prompt_tokens_cached to the token, and queries equal prompt tokens (a re-admission would
add its prompt *and* output tokens), however many preemptions and allocation retries the
run had. The test makes a pool of 48 blocks thrash (preemptions > 0 is its precondition,
and it samples vLLM's queue to show requests held back for room), sends conversations
through the tap from three callers and two conversations straight to vLLM beside it, and
asserts, from the exporter's /metrics, with no tolerance (both counters are complete once
everything finished):

- bypassed = engine prompt tokens - the callers' per-target prompt tokens = the direct
  requests' prompt tokens;
- recounted = engine hits - engine prompt_tokens_cached = 0, and engine hits = the callers'
  cached + the direct requests' cached;
- so the engine's hit ratio differs from the callers' only by the bypassed traffic: taken
  out, the two are equal.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import pytest

from tests.vllm.harness import start_exporter, vllm_counter, vllm_metrics, vllm_metrics_after
from tests.vllm.server import MODEL_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

POOL_BLOCKS = 48  # x 32 = 1,536 tokens; one request needs at most 19 blocks
BLOCK = 32
PREFIX_TOKENS = 256  # a caller's system prompt: 8 whole blocks its conversations share
CHUNK_TOKENS = 48  # each turn adds a user message of this many tokens to the history
TURNS = 3  # prompts of 304, 352 and 400 tokens
DECODE_TOKENS = 160  # with ignore_eos: every request holds its blocks while it decodes
CALLERS = ("agent-a", "agent-b", "agent-c")
CONVERSATIONS_PER_CALLER = 2
DIRECT_CONVERSATIONS = 2
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=240)


@dataclass(frozen=True)
class Answer:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def token_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, 4096) for _ in range(count)]


async def complete(
    session: aiohttp.ClientSession, url: str, prompt: list[int], caller: str | None
) -> Answer:
    headers = {"X-Caller": caller} if caller else {}
    async with session.post(
        url + "/v1/completions",
        json={
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": DECODE_TOKENS,
            "ignore_eos": True,
            "temperature": 0.0,
        },
        headers=headers,
    ) as response:
        answer = await response.json()
        assert response.status == 200, answer
    usage = answer["usage"]
    return Answer(
        usage["prompt_tokens"],
        (usage.get("prompt_tokens_details") or {})["cached_tokens"],
        usage["completion_tokens"],
    )


async def conversation(
    send: Callable[[list[int]], Awaitable[Answer]], prefix: list[int], rng: random.Random
) -> list[Answer]:
    """TURNS turns, each resending the whole history (prefix + every user chunk so far), so
    a turn can reuse the blocks of the one before if the thrashing pool kept them."""
    history = list(prefix)
    answers = []
    for _ in range(TURNS):
        history += token_ids(rng, CHUNK_TOKENS)
        answer = await send(list(history))
        assert answer.prompt_tokens == len(history)
        answers.append(answer)
    return answers


def total(text: str, name: str, **labels: str) -> float:
    """The sum of every sample of ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


@dataclass
class QueueSamples:
    """vLLM's scheduler gauges sampled while the traffic runs: requests waiting while others
    run are requests the scheduler tried to admit and could not find KV room for (the
    allocation retries), or preempted ones waiting to come back."""

    samples: int = 0
    held_back: int = 0  # samples with requests waiting while others ran
    max_waiting: float = 0.0
    max_usage: float = 0.0


async def sample_queue(session: aiohttp.ClientSession, url: str, into: QueueSamples) -> None:
    while True:
        text = await vllm_metrics(session, url)
        waiting = vllm_counter(text, "vllm:num_requests_waiting")
        running = vllm_counter(text, "vllm:num_requests_running")
        into.samples += 1
        into.held_back += waiting > 0 and running > 0
        into.max_waiting = max(into.max_waiting, waiting)
        into.max_usage = max(into.max_usage, vllm_counter(text, "vllm:kv_cache_usage_perc"))
        await asyncio.sleep(0.25)


async def test_bypassed_and_recounted_tokens_with_a_thrashing_pool(start_vllm):
    vllm = start_vllm(
        "cross-check",
        "--max-model-len",
        "1024",
        "--num-gpu-blocks-override",
        str(POOL_BLOCKS),
        "--enable-prompt-tokens-details",
    )
    exporter = await start_exporter(vllm.url)
    target = vllm.url + "/metrics"
    engine = {"target": target, "model_name": MODEL_NAME}
    rng = random.Random(35)
    prefixes = {caller: token_ids(rng, PREFIX_TOKENS) for caller in CALLERS}
    # One direct conversation starts from agent-a's system prompt (it may reuse agent-a's
    # blocks: a hit is the request's that found it, not the one that wrote it), one from
    # its own.
    direct_prefixes = [prefixes[CALLERS[0]], token_ids(rng, PREFIX_TOKENS)]
    queue = QueueSamples()
    try:
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            vllm_before = await vllm_metrics(session, vllm.url)
            before = await exporter.scrape(session)

            def through_tap(caller: str) -> Callable[[list[int]], Awaitable[Answer]]:
                return lambda prompt: complete(session, exporter.tap_url, prompt, caller)

            def direct(prompt: list[int]) -> Awaitable[Answer]:
                return complete(session, vllm.url, prompt, None)

            tapped = [
                conversation(through_tap(caller), prefixes[caller], random.Random(f"{caller}{i}"))
                for caller in CALLERS
                for i in range(CONVERSATIONS_PER_CALLER)
            ]
            bypassing = [
                conversation(direct, prefix, random.Random(f"direct{i}"))
                for i, prefix in enumerate(direct_prefixes)
            ]
            sampler = asyncio.ensure_future(sample_queue(session, vllm.url, queue))
            started = time.monotonic()
            try:
                results = await asyncio.gather(*tapped, *bypassing)
            finally:
                sampler.cancel()
            took = time.monotonic() - started
            requests = sum(len(answers) for answers in results)
            vllm_after = await vllm_metrics_after(session, vllm.url, vllm_before, requests)
            text = await exporter.scrape(session)
    finally:
        await exporter.close()

    tap_answers = [a for answers in results[: len(tapped)] for a in answers]
    direct_answers = [a for answers in results[len(tapped) :] for a in answers]
    assert all(a.completion_tokens == DECODE_TOKENS for a in tap_answers + direct_answers)

    def delta(name: str, **labels: str) -> float:
        return total(text, name, **labels) - total(before, name, **labels)

    preemptions = delta("vllm_cache_engine_preemptions_total", **engine)
    callers_prompt = delta("vllm_cache_target_prompt_tokens_total", target=target)
    callers_cached = delta("vllm_cache_target_cached_tokens_total", target=target)
    direct_prompt = sum(a.prompt_tokens for a in direct_answers)
    direct_cached = sum(a.cached_tokens for a in direct_answers)
    engine_prompt = delta("vllm_cache_engine_prompt_tokens_total", **engine)
    engine_cached = delta("vllm_cache_engine_prompt_tokens_cached_total", **engine)
    engine_queries = delta("vllm_cache_engine_prefix_cache_queries_tokens_total", **engine)
    engine_hits = delta("vllm_cache_engine_prefix_cache_hits_tokens_total", **engine)
    # The recording rules' two series, over the run.
    bypassed = max(engine_prompt - callers_prompt, 0)
    recounted = max(engine_hits - engine_cached, 0)
    engine_ratio = engine_hits / engine_queries
    callers_ratio = callers_cached / callers_prompt
    print(
        f"\ncross-check: {requests} requests in {took:.1f}s, preemptions {preemptions:.0f}, "
        f"queue sampled {queue.samples}x: waiting while others ran in {queue.held_back}, "
        f"max waiting {queue.max_waiting:.0f}, max KV usage {queue.max_usage:.3f}\n"
        f"engine: prompt {engine_prompt:.0f} queries {engine_queries:.0f} "
        f"hits {engine_hits:.0f} prompt_tokens_cached {engine_cached:.0f}\n"
        f"callers: prompt {callers_prompt:.0f} cached {callers_cached:.0f}; "
        f"direct: prompt {direct_prompt} cached {direct_cached}\n"
        f"bypassed {bypassed:.0f} recounted {recounted:.0f}; "
        f"ratios engine {engine_ratio:.4f} callers {callers_ratio:.4f} "
        f"direct {direct_cached / direct_prompt:.4f}"
    )

    # Precondition: the pool thrashed. Every preemption is a re-admission whose lookup
    # vLLM files under preempted_hits and does not export; requests waiting while others
    # run are admissions that found no room and are retried.
    vllm_preemptions = vllm_counter(vllm_after, "vllm:num_preemptions_total") - vllm_counter(
        vllm_before, "vllm:num_preemptions_total"
    )
    assert preemptions == vllm_preemptions > 0
    assert queue.held_back > 0

    # What the tap saw is what the callers' clients got, per caller and for this target.
    assert len(exporter.recorded) == len(tap_answers)
    assert sorted(e.caller for e in exporter.recorded) == sorted(
        caller for caller in CALLERS for _ in range(CONVERSATIONS_PER_CALLER * TURNS)
    )
    assert callers_prompt == sum(a.prompt_tokens for a in tap_answers)
    assert callers_cached == sum(a.cached_tokens for a in tap_answers)
    assert callers_prompt == sum(e.prompt_tokens for e in exporter.recorded)

    # (a) Traffic beside the tap shows up as bypassed, to the token.
    assert engine_prompt - callers_prompt == bypassed == direct_prompt > 0
    # (b) vLLM 0.32 recounts nothing, preemptions and allocation retries notwithstanding:
    # each request's hits are counted once, as the cached tokens its client was told.
    assert engine_hits == engine_cached
    assert recounted == 0
    assert engine_hits == callers_cached + direct_cached
    assert engine_queries == engine_prompt  # no re-admission added its tokens to queries
    assert callers_cached > 0  # later turns and sibling conversations found blocks
    # The engine's ratio is the callers' and the bypassed traffic's, mixed by their prompt
    # tokens; without the bypassed part (and the recounted part, 0 here) it is the callers'.
    assert (engine_hits - direct_cached - recounted) / (engine_prompt - bypassed) == callers_ratio
    assert engine_ratio == (callers_cached + direct_cached) / (callers_prompt + direct_prompt)

    # The exporter's engine counters are vLLM's own.
    for name, family in (
        ("vllm:prompt_tokens_total", engine_prompt),
        ("vllm:prompt_tokens_cached_total", engine_cached),
        ("vllm:prefix_cache_queries_total", engine_queries),
        ("vllm:prefix_cache_hits_total", engine_hits),
    ):
        assert vllm_counter(vllm_after, name) - vllm_counter(vllm_before, name) == family, name
