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
run had. The test makes a pool of 48 blocks thrash and asserts, from the exporter's
/metrics, counter deltas over each phase with no tolerance (both sides are complete once
every request finished):

1. Only the tap: three callers, three concurrent conversations each. recounted = engine hits
   - engine prompt_tokens_cached = 0, bypassed = 0, and the engine's hit ratio *equals* the
   callers' (the issue expected it above them: that is what vLLM reported in #25780 and
   #43736, not what 0.32 does).
2. Beside the tap: two conversations per caller through it and two straight to vLLM.
   bypassed = engine prompt tokens - the callers' per-target prompt tokens = the direct
   requests' prompt tokens; recounted = 0 still, engine hits = the callers' cached + the
   direct requests' cached, so the engine's ratio differs from the callers' by the bypassed
   traffic alone: taken out, the two are equal.

That the thrash exercised both recount paths is counted, not inferred: ``probe/`` (a
``sitecustomize`` on the vLLM server's PYTHONPATH) logs each ``get_computed_blocks`` lookup
and each ``record_prefix_cache_stats`` call in the engine process without changing them.
Its precondition: new requests were looked up again after a failed allocation and found
hits there, and preempted requests came back with hits; then every request is recorded
once as new, every preemption once as a re-admission, and the exported hits are the new
admissions' alone. Five runs on the 2-core CI machine class (55-75 s each, 30-40 of them
booting), phase 1: 27-41 preemptions, 118-693 lookups for 36 admissions (4-19 requests
retried 82-657 times, 20,992-102,432 hits found on the failed attempts), re-admissions
finding 7,648-11,744 hits; counted at every lookup the engine's ratio would have read
0.48-0.71. Exported: hits = prompt_tokens_cached = the callers' cached every time (6,144 in
four runs, 6,176 in one), the engine's ratio and the callers' equal (0.4539, 0.4563).

Sampled mid-run (reported, not asserted): engine prompt tokens - the callers' ran up to
2,112-2,736 tokens ahead in phase 1, with nothing bypassing the tap: vLLM counts a prompt
at its first output, the tap at the answer's end. Only finished traffic balances.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from exporter.values import UsageEvent
from tests.vllm.harness import (
    Exporter,
    start_exporter,
    vllm_counter,
    vllm_metrics,
    vllm_metrics_after,
)
from tests.vllm.server import MODEL_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

PROBE = Path(__file__).resolve().parent / "probe"  # its sitecustomize.py, for vLLM

POOL_BLOCKS = 48  # of 32 tokens: 1,536; one request needs up to 22 (448 + 256 tokens)
PREFIX_TOKENS = 256  # a caller's system prompt: 8 whole blocks its conversations share
CHUNK_TOKENS = 48  # each turn adds a user message of this many tokens to the history
TURNS = 4  # prompts of 304, 352, 400 and 448 tokens
DECODE_TOKENS = 256  # with ignore_eos: every request holds its blocks while it decodes
CALLERS = ("agent-a", "agent-b", "agent-c")
CONVERSATIONS_PER_CALLER = 3
CONVERSATIONS_BESIDE = 2  # per caller, beside two direct ones
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
    """vLLM's /metrics sampled while the traffic runs (reported, not asserted: a sample
    is a moment). Requests waiting while others run are requests the scheduler found no KV
    room for, or preempted ones waiting to come back. ``max_in_flight_recount``: hits -
    prompt_tokens_cached since the phase began, at its largest: hits are counted at
    admission and cached tokens at first output, so mid-run the difference is the hits of
    admitted requests still prefilling, which a short-window recounted series would show.
    ``max_in_flight_bypassed``: the same for the exporter's engine prompt tokens - callers'
    per-target prompt tokens: vLLM counts a prompt at first output, the tap at the answer's
    end, so requests decoding through the tap read as bypassed until they finish."""

    samples: int = 0
    held_back: int = 0  # samples with requests waiting while others ran
    max_waiting: float = 0.0
    max_usage: float = 0.0
    max_in_flight_recount: float = 0.0
    max_in_flight_bypassed: float = 0.0


async def sample_queue(
    session: aiohttp.ClientSession,
    url: str,
    before: str,
    exporter: Exporter,
    exporter_before: str,
    into: QueueSamples,
) -> None:
    def since(text: str, name: str) -> float:
        return vllm_counter(text, name) - vllm_counter(before, name)

    def exported_since(text: str, name: str, **labels: str) -> float:
        return total(text, name, **labels) - total(exporter_before, name, **labels)

    target = url + "/metrics"

    while True:
        text = await vllm_metrics(session, url)
        waiting = vllm_counter(text, "vllm:num_requests_waiting")
        running = vllm_counter(text, "vllm:num_requests_running")
        into.samples += 1
        into.held_back += waiting > 0 and running > 0
        into.max_waiting = max(into.max_waiting, waiting)
        into.max_usage = max(into.max_usage, vllm_counter(text, "vllm:kv_cache_usage_perc"))
        into.max_in_flight_recount = max(
            into.max_in_flight_recount,
            since(text, "vllm:prefix_cache_hits_total")
            - since(text, "vllm:prompt_tokens_cached_total"),
        )
        exported = await exporter.scrape(session)
        into.max_in_flight_bypassed = max(
            into.max_in_flight_bypassed,
            exported_since(exported, "vllm_cache_engine_prompt_tokens_total", target=target)
            - exported_since(exported, "vllm_cache_target_prompt_tokens_total", target=target),
        )
        await asyncio.sleep(0.1)


@dataclass
class Probe:
    """What vLLM's scheduler did, from tests/vllm/probe (one JSON line per lookup and per
    counter record, in the engine process): the counts behind the counters."""

    lines: list[dict[str, Any]]

    def fresh(self, kind: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["kind"] == kind and not line["preempted"]]

    @property
    def retried_requests(self) -> int:
        """Requests looked up more than once before vLLM admitted them: the allocation
        failed and the scheduler tried again on a later step."""
        lookups = Counter(line["request"] for line in self.fresh("lookup"))
        return sum(1 for count in lookups.values() if count > 1)

    @property
    def retry_lookups(self) -> int:
        return len(self.fresh("lookup")) - len(self.fresh("record"))

    @property
    def retry_hits(self) -> int:
        """The hits vLLM would have counted again had it recorded at lookup (vllm#43736)."""
        return sum(line["hits"] for line in self.fresh("lookup")) - self.recorded_hits

    @property
    def retry_tokens(self) -> int:
        return sum(line["tokens"] for line in self.fresh("lookup")) - sum(
            line["tokens"] for line in self.fresh("record")
        )

    @property
    def recorded_hits(self) -> int:
        return sum(line["hits"] for line in self.fresh("record"))

    @property
    def readmissions(self) -> list[dict[str, Any]]:
        """Preempted requests admitted again: vLLM records them apart (vllm#25780)."""
        return [line for line in self.lines if line["kind"] == "record" and line["preempted"]]


@dataclass
class Phase:
    """One phase's counter deltas: the exporter's, vLLM's own, and what the clients got."""

    name: str
    took: float
    queue: QueueSamples
    tap_answers: list[Answer]
    direct_answers: list[Answer]
    events: list[UsageEvent]
    before: str  # the exporter's /metrics
    after: str
    vllm_before: str
    vllm_after: str
    target: str
    probe: Probe

    def delta(self, name: str, **labels: str) -> float:
        return total(self.after, name, **labels) - total(self.before, name, **labels)

    def engine(self, name: str) -> float:
        return self.delta(name, target=self.target, model_name=MODEL_NAME)

    def vllm_delta(self, name: str, **labels: str) -> float:
        return total(self.vllm_after, name, **labels) - total(self.vllm_before, name, **labels)

    @property
    def requests(self) -> int:
        return len(self.tap_answers) + len(self.direct_answers)

    @property
    def preemptions(self) -> float:
        return self.engine("vllm_cache_engine_preemptions_total")

    @property
    def engine_prompt(self) -> float:
        return self.engine("vllm_cache_engine_prompt_tokens_total")

    @property
    def engine_cached(self) -> float:
        return self.engine("vllm_cache_engine_prompt_tokens_cached_total")

    @property
    def engine_queries(self) -> float:
        return self.engine("vllm_cache_engine_prefix_cache_queries_tokens_total")

    @property
    def engine_hits(self) -> float:
        return self.engine("vllm_cache_engine_prefix_cache_hits_tokens_total")

    @property
    def callers_prompt(self) -> float:
        return self.delta("vllm_cache_target_prompt_tokens_total", target=self.target)

    @property
    def callers_cached(self) -> float:
        return self.delta("vllm_cache_target_cached_tokens_total", target=self.target)

    @property
    def direct_prompt(self) -> int:
        return sum(a.prompt_tokens for a in self.direct_answers)

    @property
    def direct_cached(self) -> int:
        return sum(a.cached_tokens for a in self.direct_answers)

    # The recording rules' two series.
    @property
    def bypassed(self) -> float:
        return max(self.engine_prompt - self.callers_prompt, 0)

    @property
    def recounted(self) -> float:
        return max(self.engine_hits - self.engine_cached, 0)

    @property
    def engine_ratio(self) -> float:
        return self.engine_hits / self.engine_queries

    @property
    def callers_ratio(self) -> float:
        return self.callers_cached / self.callers_prompt

    def report(self) -> str:
        # How often requests were preempted: vLLM's per-request histogram (cumulative; its
        # first bucket is le=1, so 0 and 1 share it).
        per_request = {
            le: self.vllm_delta("vllm:request_num_preemptions_bucket", le=le)
            for le in ("1.0", "2.0", "5.0", "+Inf")
        }
        direct_ratio = self.direct_cached / self.direct_prompt if self.direct_prompt else 0.0
        probe = self.probe
        readmit_hits = sum(line["hits"] for line in probe.readmissions)
        readmit_tokens = sum(line["tokens"] for line in probe.readmissions)
        lookups = [line for line in probe.lines if line["kind"] == "lookup"]
        # Had vLLM counted at every lookup (before #25787 and #43736 both).
        would_be = sum(line["hits"] for line in lookups) / sum(line["tokens"] for line in lookups)
        return (
            f"\n[{self.name}] {self.requests} requests in {self.took:.1f}s; "
            f"preemptions {self.preemptions:.0f}, requests by preemptions (le) {per_request}; "
            f"vLLM queue sampled {self.queue.samples}x, waiting while others ran in "
            f"{self.queue.held_back}, max waiting {self.queue.max_waiting:.0f}, max KV usage "
            f"{self.queue.max_usage:.3f}, hits - cached in flight at most "
            f"{self.queue.max_in_flight_recount:.0f}, engine - callers' prompt in flight at most "
            f"{self.queue.max_in_flight_bypassed:.0f}\n"
            f"  engine: prompt {self.engine_prompt:.0f} queries {self.engine_queries:.0f} "
            f"hits {self.engine_hits:.0f} prompt_tokens_cached {self.engine_cached:.0f}\n"
            f"  callers: prompt {self.callers_prompt:.0f} cached {self.callers_cached:.0f}; "
            f"direct: prompt {self.direct_prompt} cached {self.direct_cached}\n"
            f"  bypassed {self.bypassed:.0f} recounted {self.recounted:.0f}; hit ratios: "
            f"engine {self.engine_ratio:.4f} callers {self.callers_ratio:.4f} "
            f"direct {direct_ratio:.4f}\n"
            f"  probe: {len(probe.fresh('record'))} admissions after "
            f"{len(probe.fresh('lookup'))} lookups ({probe.retried_requests} requests retried "
            f"{probe.retry_lookups} times, {probe.retry_hits} hits / {probe.retry_tokens} "
            f"tokens found on the failed attempts), {len(probe.readmissions)} re-admissions "
            f"({readmit_hits} hits / {readmit_tokens} tokens); {len(lookups)} lookups in all: "
            f"counted at every one, the engine's ratio would read {would_be:.4f}"
        )


def probe_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


async def run_phase(
    name: str,
    session: aiohttp.ClientSession,
    exporter: Exporter,
    vllm_url: str,
    probe_path: Path,
    tapped: list[tuple[str, list[int], str]],
    direct: list[tuple[list[int], str]],
) -> Phase:
    """Run ``tapped`` (caller, prefix, seed) conversations through the tap and ``direct``
    (prefix, seed) ones straight to vLLM, all at once; return once vLLM counted them all."""
    vllm_before = await vllm_metrics(session, vllm_url)
    before = await exporter.scrape(session)
    first_event = len(exporter.recorded)
    first_line = len(probe_lines(probe_path))

    def through_tap(caller: str) -> Callable[[list[int]], Awaitable[Answer]]:
        return lambda prompt: complete(session, exporter.tap_url, prompt, caller)

    def beside_tap(prompt: list[int]) -> Awaitable[Answer]:
        return complete(session, vllm_url, prompt, None)

    queue = QueueSamples()
    sampler = asyncio.ensure_future(
        sample_queue(session, vllm_url, vllm_before, exporter, before, queue)
    )
    started = time.monotonic()
    try:
        results = await asyncio.gather(
            *(
                conversation(through_tap(caller), prefix, random.Random(seed))
                for caller, prefix, seed in tapped
            ),
            *(conversation(beside_tap, prefix, random.Random(seed)) for prefix, seed in direct),
        )
    finally:
        sampler.cancel()
    took = time.monotonic() - started
    tap_answers = [a for answers in results[: len(tapped)] for a in answers]
    direct_answers = [a for answers in results[len(tapped) :] for a in answers]
    vllm_after = await vllm_metrics_after(
        session, vllm_url, vllm_before, len(tap_answers) + len(direct_answers)
    )
    after = await exporter.scrape(session)
    phase = Phase(
        name,
        took,
        queue,
        tap_answers,
        direct_answers,
        exporter.recorded[first_event:],
        before,
        after,
        vllm_before,
        vllm_after,
        vllm_url + "/metrics",
        Probe(probe_lines(probe_path)[first_line:]),
    )
    print(phase.report())
    return phase


def check_phase(phase: Phase, callers: list[str]) -> None:
    """What holds in every phase: the precondition, the tap's own counts, recounted = 0."""
    answers = phase.tap_answers + phase.direct_answers
    assert all(a.completion_tokens == DECODE_TOKENS for a in answers)
    # Precondition: the pool thrashed. Every preemption is a failed allocation for a running
    # request and then a re-admission whose lookup vLLM files under preempted_hits and does
    # not export.
    assert phase.preemptions == phase.vllm_delta("vllm:num_preemptions_total") > 0

    # What the tap saw is what the callers' clients got, for this target.
    assert sorted(e.caller for e in phase.events) == sorted(callers)
    assert phase.callers_prompt == sum(a.prompt_tokens for a in phase.tap_answers)
    assert phase.callers_prompt == sum(e.prompt_tokens for e in phase.events)
    assert phase.callers_cached == sum(a.cached_tokens for a in phase.tap_answers)
    assert phase.callers_cached > 0  # later turns and sibling conversations found blocks

    # vLLM 0.32 recounts nothing, preemptions and allocation retries notwithstanding: each
    # request's hits are counted once, as the cached tokens its client was told, and no
    # re-admission added its tokens to the queries.
    assert phase.engine_hits == phase.engine_cached
    assert phase.recounted == 0
    assert phase.engine_hits == phase.callers_cached + phase.direct_cached
    assert phase.engine_queries == phase.engine_prompt
    # (a) Traffic beside the tap, and only it, shows up as bypassed, to the token.
    assert phase.engine_prompt - phase.callers_prompt == phase.bypassed == phase.direct_prompt

    # The probe: every request admitted once as new (its one record), every preemption
    # admitted again as a re-admission, and the exported hits are exactly the new
    # admissions' ones, whatever the failed attempts and the re-admissions found.
    probe = phase.probe
    records = Counter(line["request"] for line in probe.fresh("record"))
    assert len(records) == phase.requests and set(records.values()) == {1}
    assert len(probe.readmissions) == phase.preemptions
    assert probe.recorded_hits == phase.engine_hits

    # The exporter's engine counters are vLLM's own.
    for name, served in (
        ("vllm:prompt_tokens_total", phase.engine_prompt),
        ("vllm:prompt_tokens_cached_total", phase.engine_cached),
        ("vllm:prefix_cache_queries_total", phase.engine_queries),
        ("vllm:prefix_cache_hits_total", phase.engine_hits),
    ):
        assert phase.vllm_delta(name) == served, name


async def test_bypassed_and_recounted_tokens_with_a_thrashing_pool(
    start_vllm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    probe_path = tmp_path / "probe.jsonl"
    monkeypatch.setenv("VLLM_CACHE_EXPORTER_PROBE", str(probe_path))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(PROBE), os.environ.get("PYTHONPATH")]))
    )
    vllm = start_vllm(
        "cross-check",
        "--max-model-len",
        "1024",
        "--num-gpu-blocks-override",
        str(POOL_BLOCKS),
        "--enable-prompt-tokens-details",
        # Room for every request at once but for the KV pool (the CPU defaults are 2,048
        # tokens and 128 sequences a step): a request left waiting while others run found
        # no KV room, or a preemption that step sent it back.
        "--max-num-batched-tokens",
        "8192",
        "--max-num-seqs",
        "32",
    )
    exporter = await start_exporter(vllm.url)
    rng = random.Random(35)
    prefixes = {caller: token_ids(rng, PREFIX_TOKENS) for caller in CALLERS}
    own_prefix = token_ids(rng, PREFIX_TOKENS)
    try:
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            tap_only = await run_phase(
                "tap only",
                session,
                exporter,
                vllm.url,
                probe_path,
                [
                    (caller, prefixes[caller], f"{caller}-{i}")
                    for caller in CALLERS
                    for i in range(CONVERSATIONS_PER_CALLER)
                ],
                [],
            )
            # One direct conversation starts from agent-a's system prompt (a hit is the
            # request's that found the block, not the one's that wrote it), one from its own.
            beside = await run_phase(
                "beside the tap",
                session,
                exporter,
                vllm.url,
                probe_path,
                [
                    (caller, prefixes[caller], f"{caller}-again-{i}")
                    for caller in CALLERS
                    for i in range(CONVERSATIONS_BESIDE)
                ],
                [(prefixes[CALLERS[0]], "direct-0"), (own_prefix, "direct-1")],
            )
    finally:
        await exporter.close()

    check_phase(tap_only, [c for c in CALLERS for _ in range(CONVERSATIONS_PER_CALLER * TURNS)])
    # Precondition: new requests found no room and were tried again (what vllm#43736
    # recounted), and preempted ones came back with hits (what vllm#25780 counted).
    assert tap_only.probe.retried_requests > 0 and tap_only.probe.retry_hits > 0
    assert sum(line["hits"] for line in tap_only.probe.readmissions) > 0
    # 1. Under heavy preemption the engine's ratio is the callers', exactly: nothing is
    # bypassed and nothing recounted.
    assert tap_only.bypassed == 0
    assert tap_only.engine_ratio == tap_only.callers_ratio

    check_phase(beside, [c for c in CALLERS for _ in range(CONVERSATIONS_BESIDE * TURNS)])
    # 2. The direct requests are the bypassed tokens; the engine's ratio is the callers' and
    # theirs, mixed by prompt tokens, and without them (and the recounted part, 0) it is the
    # callers'.
    assert beside.bypassed == beside.direct_prompt > 0
    assert beside.engine_ratio == (beside.callers_cached + beside.direct_cached) / (
        beside.callers_prompt + beside.direct_prompt
    )
    assert (beside.engine_hits - beside.direct_cached - beside.recounted) / (
        beside.engine_prompt - beside.bypassed
    ) == beside.callers_ratio
