"""End to end against a real vLLM 0.32.0 (CPU build): what the exporter says about the prefix
cache must be what vLLM did.

Three boots of the tiny model, each with the exporter reading vLLM's /metrics and the tap in
front of vLLM's API:

1. ``--enable-prompt-tokens-details --enable-per-request-metrics``: two callers hold
   eight-turn conversations (whole answers, streams without and with usage). The tap's
   cached tokens per request are the ones vLLM returned, their sum is the increase of
   ``vllm:prefix_cache_hits_total``, first turns are cold and later ones warm, the
   granularity learned is 32, the engine signals (1 GiB pool = 1,048,576 tokens, prefix
   caching on) are right. Every call's TTFT and queue wait are vLLM's own: equal to the
   millisecond to the ``metrics`` object the client got (whole answers, streams that asked
   for usage), counted per caller under ``source="engine"``, and in sum equal to vLLM's
   ``vllm:request_prefill_time_seconds`` and ``vllm:request_queue_time_seconds``, streams the
   tap stripped of their usage chunk included.
2. Without the flags: vLLM still hits its cache but says nothing per request, so the
   requests are ``unknown`` and the tokens land in the not-reported counter, not in a 0% hit
   ratio; the TTFT series say ``source="proxy"`` (the tap's own, streams only), there is no
   queue wait, and the tap says once in its log that vLLM sent no per-request metrics.
3. A pool of 48 blocks and four concurrent 600-token prompts that decode past it: vLLM
   preempts, and the exporter counts it. With ``--kv-cache-metrics`` (every block sampled)
   vLLM also reports the blocks it evicts, and the exporter serves exactly its histograms;
   the boots without the flag have none, and the exporter says they are absent.
"""

from __future__ import annotations

import asyncio
import logging
import random

import aiohttp
import pytest

from tests.vllm.harness import (
    conversation,
    metric,
    start_exporter,
    vllm_counter,
    vllm_metrics,
    vllm_metrics_after,
)
from tests.vllm.server import MODEL_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

# Eight turns each: the granularity learner adopts the gcd of the cached counts once it has
# held for 8 non-zero samples, and two counts can share a factor above 32 by chance.
ALICE_MODES = [
    "whole",
    "stream",
    "stream_usage",
    "whole",
    "stream",
    "stream_usage",
    "whole",
    "stream",
]
BOB_MODES = [
    "stream",
    "whole",
    "stream_usage",
    "stream",
    "whole",
    "stream_usage",
    "stream",
    "whole",
]
# No call to the tiny model takes more than seconds; a hung one fails the test, not CI.
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=120)
TIMED_STATES = ("warm", "partial", "cold", "short", "unknown")


async def test_per_caller_cache_signals_match_vllm(start_vllm):
    vllm = start_vllm(
        "details",
        "--max-model-len",
        "4096",
        "--enable-prompt-tokens-details",
        "--enable-per-request-metrics",
    )
    exporter = await start_exporter(vllm.url)
    try:
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            vllm_before = await vllm_metrics(session, vllm.url)
            hits_before = vllm_counter(vllm_before, "vllm:prefix_cache_hits_total")
            before = await exporter.scrape(session)
            alice, bob = await asyncio.gather(
                conversation(session, exporter.tap_url, "alice", 1, ALICE_MODES),
                conversation(session, exporter.tap_url, "bob", 2, BOB_MODES),
            )
            vllm_after = await vllm_metrics_after(
                session, vllm.url, vllm_before, len(ALICE_MODES) + len(BOB_MODES)
            )
            hits_after = vllm_counter(vllm_after, "vllm:prefix_cache_hits_total")
            text = await exporter.scrape(session)
    finally:
        await exporter.close()

    recorded = {
        caller: [e for e in exporter.recorded if e.caller == caller] for caller in ("alice", "bob")
    }
    for caller, turns in (("alice", alice), ("bob", bob)):
        events = recorded[caller]
        assert len(events) == len(turns) == len(ALICE_MODES)
        # Concurrent callers, but each caller's turns are sequential: events in turn order.
        for turn, event in zip(turns, events, strict=True):
            assert event.status == 200 and event.model == MODEL_NAME
            assert event.cached_tokens is not None
            if turn.saw_usage:
                assert (event.prompt_tokens, event.cached_tokens) == (
                    turn.prompt_tokens,
                    turn.cached_tokens,
                )
            else:
                assert turn.mode == "stream"  # the tap asked for usage and kept it
            if turn.mode != "whole":
                assert event.ttft_seconds is not None and event.ttft_seconds > 0
            # vLLM's own timings, for every call: the ones the client got, to the ms.
            assert event.engine_ttft_seconds is not None
            assert event.engine_queue_seconds is not None
            if turn.mode == "stream":
                assert turn.metrics is None  # the tap read them off the chunk it removed
            else:
                assert turn.metrics is not None, turn
                assert event.engine_ttft_seconds * 1000 == pytest.approx(
                    turn.metrics["time_to_first_token_ms"], abs=1e-6
                )
                assert event.engine_queue_seconds * 1000 == pytest.approx(
                    turn.metrics["queue_time_ms"], abs=1e-6
                )
        assert events[0].cached_tokens == 0
        assert all(event.cached_tokens > 0 for event in events[1:])

    # All of them, streams the tap stripped included, add up to vLLM's own histograms of the
    # same intervals (prefill: scheduled to first token; queue: queued to scheduled).
    for family, field in (
        ("vllm:request_prefill_time_seconds_sum", "engine_ttft_seconds"),
        ("vllm:request_queue_time_seconds_sum", "engine_queue_seconds"),
    ):
        engine_total = vllm_counter(vllm_after, family) - vllm_counter(vllm_before, family)
        assert sum(getattr(e, field) for e in exporter.recorded) == pytest.approx(
            engine_total, abs=1e-3
        ), family

    tap_cached = sum(e.cached_tokens or 0 for e in exporter.recorded)
    assert tap_cached == hits_after - hits_before > 0

    for caller in ("alice", "bob"):
        labels = {"caller": caller, "model": MODEL_NAME}
        assert metric(text, "vllm_cache_requests_total", state="cold", **labels) == 1
        assert (
            metric(text, "vllm_cache_requests_total", state="warm", **labels)
            == len(ALICE_MODES) - 1
        )
        for state in ("partial", "unknown", "error", "short"):
            assert metric(text, "vllm_cache_requests_total", state=state, **labels) == 0
        assert metric(text, "vllm_cache_cached_tokens_total", **labels) == sum(
            e.cached_tokens or 0 for e in recorded[caller]
        )
        assert metric(text, "vllm_cache_prompt_tokens_total", **labels) == sum(
            e.prompt_tokens for e in recorded[caller]
        )
        # Per caller: one TTFT per call, every one vLLM's (source="engine"), none the tap's.
        engine = {**labels, "source": "engine"}
        counts = [
            metric(text, "vllm_cache_ttft_seconds_count", state=state, **engine) or 0
            for state in TIMED_STATES
        ]
        sums = [
            metric(text, "vllm_cache_ttft_seconds_sum", state=state, **engine) or 0
            for state in TIMED_STATES
        ]
        assert sum(counts) == len(ALICE_MODES)
        assert (
            metric(text, "vllm_cache_ttft_seconds_count", state="warm", **engine)
            == len(ALICE_MODES) - 1
        )
        assert sum(sums) == pytest.approx(
            sum(e.engine_ttft_seconds for e in recorded[caller]), abs=1e-9
        )
        assert metric(text, "vllm_cache_queue_wait_seconds_count", **engine) == len(ALICE_MODES)
        assert metric(text, "vllm_cache_queue_wait_seconds_sum", **engine) == pytest.approx(
            sum(e.engine_queue_seconds for e in recorded[caller]), abs=1e-9
        )
        assert 'source="proxy"' not in "\n".join(
            line
            for line in text.splitlines()
            if line.startswith(("vllm_cache_ttft_seconds", "vllm_cache_queue_wait_seconds"))
            and f'caller="{caller}"' in line
        )
    engine_hits = "vllm_cache_engine_prefix_cache_hits_tokens_total"
    assert (
        metric(text, engine_hits, model_name=MODEL_NAME)
        - metric(before, engine_hits, model_name=MODEL_NAME)
    ) == tap_cached
    assert metric(text, "vllm_cache_granularity_tokens", model=MODEL_NAME, source="learned") == 32
    assert metric(text, "vllm_cache_engine_kv_pool_tokens", model_name=MODEL_NAME) == 1_048_576
    assert metric(text, "vllm_cache_engine_prefix_caching_enabled", model_name=MODEL_NAME) == 1
    assert metric(text, "vllm_cache_engine_up", target=vllm.url + "/metrics") == 1
    # Where the prompt tokens came from, as vLLM split them; no connector, no residency flag.
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        assert metric(
            text,
            "vllm_cache_engine_prompt_tokens_by_source_total",
            model_name=MODEL_NAME,
            source=source,
        ) == metric(vllm_after, "vllm:prompt_tokens_by_source_total", source=source)
    assert (
        metric(
            text,
            "vllm_cache_engine_prompt_tokens_by_source_total",
            model_name=MODEL_NAME,
            source="local_cache_hit",
        )
        == hits_after
    )
    assert (
        metric(
            text, "vllm_cache_engine_external_prefix_cache_hits_tokens_total", model_name=MODEL_NAME
        )
        == 0
    )
    for signal in ("kv_block_lifetime", "kv_block_idle_before_evict", "kv_block_reuse_gap"):
        assert metric(text, "vllm_cache_engine_metric_present", signal=signal) == 0
    assert "vllm_cache_engine_kv_block_" not in "".join(
        line for line in text.splitlines() if not line.startswith("#")
    )


async def test_without_prompt_tokens_details_cached_is_not_reported(start_vllm, caplog):
    caplog.set_level(logging.WARNING, logger="exporter.usage.tap.proxy")
    vllm = start_vllm("no-details", "--max-model-len", "4096")
    exporter = await start_exporter(vllm.url)
    try:
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            hits_before = vllm_counter(
                await vllm_metrics(session, vllm.url), "vllm:prefix_cache_hits_total"
            )
            await asyncio.gather(
                conversation(
                    session, exporter.tap_url, "alice", 3, ["whole", "stream", "stream_usage"]
                ),
                conversation(session, exporter.tap_url, "bob", 4, ["stream", "whole"]),
            )
            vllm_after = await vllm_metrics(session, vllm.url)
            hits_after = vllm_counter(vllm_after, "vllm:prefix_cache_hits_total")
            text = await exporter.scrape(session)
    finally:
        await exporter.close()

    assert hits_after > hits_before  # vLLM did reuse its cache...
    assert all(e.cached_tokens is None for e in exporter.recorded)  # ...and did not say so
    for caller, requests in (("alice", 3), ("bob", 2)):
        labels = {"caller": caller, "model": MODEL_NAME}
        assert metric(text, "vllm_cache_requests_total", state="unknown", **labels) == requests
        for state in ("warm", "partial", "cold"):
            assert metric(text, "vllm_cache_requests_total", state=state, **labels) == 0
        assert (
            metric(text, "vllm_cache_unreported_prompt_tokens_total", **labels)
            == sum(e.prompt_tokens for e in exporter.recorded if e.caller == caller)
            > 0
        )
        assert metric(text, "vllm_cache_cached_tokens_total", **labels) == 0
        assert metric(text, "vllm_cache_prompt_tokens_total", **labels) == 0
    # No per-request metrics either: the TTFT is the tap's (streams only), and says so.
    assert all(
        e.engine_ttft_seconds is None and e.engine_queue_seconds is None for e in exporter.recorded
    )
    for caller, streams in (("alice", 2), ("bob", 1)):
        labels = {"caller": caller, "model": MODEL_NAME}
        assert (
            metric(text, "vllm_cache_ttft_seconds_count", state="unknown", source="proxy", **labels)
            == streams
        )
        assert metric(text, "vllm_cache_ttft_seconds_count", source="engine", **labels) is None
        assert metric(text, "vllm_cache_queue_wait_seconds_count", **labels) is None
    # Said once; the rate limiter's own summary ("N more message(s) like ...") when its
    # window turns is not a second notice.
    notices = [
        r
        for r in caplog.records
        if r.getMessage().startswith("tap: vLLM answered without its per-request")
    ]
    assert len(notices) == 1


async def test_preemptions_are_counted(start_vllm):
    vllm = start_vllm(
        "tiny-pool",
        "--max-model-len",
        "1024",
        "--num-gpu-blocks-override",
        "48",
        "--enable-prompt-tokens-details",
        "--kv-cache-metrics",
        "--kv-cache-metrics-sample",
        "1.0",
    )
    exporter = await start_exporter(vllm.url)
    rng = random.Random(5)
    try:
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            before = await exporter.scrape(session)

            async def long_decode(index: int) -> int:
                # 600 distinct token ids (no shared prefix), then decode well past the pool.
                prompt = [rng.randrange(3, 4096) for _ in range(600)]
                async with session.post(
                    exporter.tap_url + "/v1/completions",
                    json={
                        "model": MODEL_NAME,
                        "prompt": prompt,
                        "max_tokens": 400,
                        "ignore_eos": True,
                        "temperature": 0.0,
                    },
                    headers={"X-Caller": f"batch-{index}"},
                ) as response:
                    answer = await response.json()
                    assert response.status == 200, answer
                    return answer["usage"]["completion_tokens"]

            completions = await asyncio.gather(*(long_decode(i) for i in range(4)))
            text = await exporter.scrape(session)
            vllm_after = await vllm_metrics(session, vllm.url)
    finally:
        await exporter.close()

    assert completions == [400] * 4  # 4 x 1,000 tokens through a 1,536-token pool
    preemptions = "vllm_cache_engine_preemptions_total"
    assert metric(before, preemptions, model_name=MODEL_NAME) == 0
    assert metric(text, preemptions, model_name=MODEL_NAME) > 0
    assert metric(text, "vllm_cache_engine_kv_pool_tokens", model_name=MODEL_NAME) == 48 * 32
    assert sorted(e.caller for e in exporter.recorded) == [f"batch-{i}" for i in range(4)]
    # Blocks were evicted to make room, and every sampled eviction vLLM reported is served,
    # bucket for bucket.
    evictions = vllm_counter(vllm_after, "vllm:kv_block_lifetime_seconds_count")
    assert evictions > 0
    for family in ("kv_block_lifetime", "kv_block_idle_before_evict", "kv_block_reuse_gap"):
        assert metric(text, "vllm_cache_engine_metric_present", signal=family) == 1
        vllm_buckets = {
            labels["le"]: number
            for labels, number in samples(vllm_after, f"vllm:{family}_seconds_bucket")
        }
        assert (
            vllm_buckets
            and {
                labels["le"]: number
                for labels, number in samples(text, f"vllm_cache_engine_{family}_seconds_bucket")
            }
            == vllm_buckets
        ), family
    assert (
        metric(
            text,
            "vllm_cache_engine_kv_block_idle_before_evict_seconds_count",
            model_name=MODEL_NAME,
        )
        == evictions
    )


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


async def test_a_vllm_restart_ends_the_conversations_it_held(start_vllm):
    """Two conversations live on a real vLLM; it restarts (the same port, a new process: its
    counters start again with a new _created). The exporter's next read ends both (their
    cache went with the process); the one that comes back counts again, alone, and its turn
    is judged as a first turn (cold: nothing cached, and not a follow-up the cache lost)."""
    vllm = start_vllm("restart", "--max-model-len", "4096", "--enable-prompt-tokens-details")
    exporter = await start_exporter(vllm.url)
    labels = {"target": vllm.url + "/metrics", "model_name": MODEL_NAME}
    try:
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            await exporter.scrape(session)  # the exporter has read this vLLM once
            alice, bob = await asyncio.gather(
                conversation(session, exporter.tap_url, "alice", 1, ["whole", "whole"]),
                conversation(session, exporter.tap_url, "bob", 2, ["whole", "whole"]),
            )
            assert alice[1].cached_tokens and bob[1].cached_tokens  # warm follow-ups
            text = await exporter.scrape(session)
            assert metric(text, "vllm_cache_engine_conversations_active", **labels) == 2
            both = metric(text, "vllm_cache_engine_conversations_demand_tokens", **labels)

            await asyncio.to_thread(vllm.stop)
            await asyncio.to_thread(vllm.start)
            await asyncio.to_thread(vllm.wait_ready)
            text = await exporter.scrape(session)  # the read that shows the restart
            assert metric(text, "vllm_cache_engine_restarts_total", target=labels["target"]) == 1
            assert metric(text, "vllm_cache_engine_conversations_active", **labels) == 0
            assert metric(text, "vllm_cache_engine_conversations_demand_tokens", **labels) == 0

            # alice comes back: her conversation's next turn, its whole history resent
            back = await conversation(session, exporter.tap_url, "alice", 1, ["whole"] * 3)
            text = await exporter.scrape(session)
    finally:
        await exporter.close()
    assert back[0].cached_tokens == 0 and back[2].cached_tokens  # cold after the restart
    assert metric(text, "vllm_cache_engine_conversations_active", **labels) == 1
    alone = metric(text, "vllm_cache_engine_conversations_demand_tokens", **labels)
    assert alone is not None and both is not None and 0 < alone < both
    series = exporter.state.usage.series[("alice", MODEL_NAME)]
    assert series.followups_cold == 0  # the restart's cold turn is no cache loss
