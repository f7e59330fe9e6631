"""The counters of the day-long promtool scenarios, built from turns instead of typed by hand.

A day of one-minute samples is 1,440 numbers per series; nobody can review that. Here a
scenario is a list of turns (minute, caller, prompt and cached tokens, state, engine-side
TTFT), and the exporter's counters follow from them exactly as the exporter would count:
per caller (prompt, cached, requests by state, TTFT histogram by state) and per vLLM
(prefix-cache queries and hits). The result is written into ``alerts/tests/*.yaml`` in
promtool's compact notation, and ``test_workloads.py`` fails if the committed input series
and these builders ever disagree, so the comments in the YAML describe the data it holds.

``python -m tests.monitoring.workloads`` rewrites the ``input_series`` of those files.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ALERTS_TESTS = Path(__file__).resolve().parent.parent.parent / "alerts" / "tests"
JOB = 'job="vllm-cache-exporter", instance="exporter:10123"'
MODEL = "qwen3.8-27b"
TARGET = 'target="http://vllm:8000/metrics"'
CLASSIFIED = ("warm", "partial", "cold")
TTFT_BOUNDS = (10.0, 60.0, 120.0, 300.0)  # a subset of the exporter's buckets, then +Inf
STEP_MINUTES = 1  # the tests' `interval: 1m`


@dataclass(frozen=True)
class Turn:
    minute: int
    caller: str
    prompt_tokens: int
    cached_tokens: int
    state: str  # warm, partial, cold, short
    ttft_seconds: float


# --- promtool's expanding notation ----------------------------------------------------------


def encode(samples: Sequence[int | None]) -> str:
    """Samples (None: no sample) as promtool input: ``a+bxn`` is n+1 values a, a+b, ...,
    ``axn`` n+1 copies of a, ``_xn`` n missing samples."""
    parts: list[str] = []
    index = 0
    while index < len(samples):
        value = samples[index]
        if value is None:
            end = index
            while end < len(samples) and samples[end] is None:
                end += 1
            gap = end - index
            parts.append("_" if gap == 1 else f"_x{gap}")
            index = end
            continue
        end = index
        following = samples[index + 1] if index + 1 < len(samples) else None
        if following is not None:
            step = following - value
            end = index + 1
            while (
                end + 1 < len(samples)
                and samples[end + 1] is not None
                and samples[end + 1] - samples[end] == step
            ):  # type: ignore[operator]
                end += 1
            repeats = end - index
            if step == 0:
                parts.append(f"{value}x{repeats}")
            else:
                parts.append(f"{value}{'+' if step > 0 else '-'}{abs(step)}x{repeats}")
        else:
            parts.append(str(value))
        index = end + 1
    return " ".join(parts)


def decode(text: str) -> list[int | None]:
    """The inverse of :func:`encode`, for its own test (promtool is the real reader)."""
    samples: list[int | None] = []
    for part in text.split():
        if part == "_":
            samples.append(None)
        elif match := re.fullmatch(r"_x(\d+)", part):
            samples.extend([None] * int(match.group(1)))
        elif match := re.fullmatch(r"(-?\d+)(?:([+-])(\d+))?x(\d+)", part):
            start, sign, step, repeats = match.groups()
            delta = int(step or 0) * (-1 if sign == "-" else 1)
            samples.extend(int(start) + delta * count for count in range(int(repeats) + 1))
        else:
            samples.append(int(part))
    return samples


# --- turns -> counters ----------------------------------------------------------------------


class _Counters:
    """Per-minute increments of each series, and the minute each series appears (at 0: the
    exporter serves a new series from zero before its first increment)."""

    def __init__(self) -> None:
        self.increments: dict[str, dict[int, int]] = {}
        self.appears: dict[str, int] = {}

    def add(self, series: str, minute: int, amount: int, appears: int) -> None:
        per_minute = self.increments.setdefault(series, {})
        per_minute[minute] = per_minute.get(minute, 0) + amount
        self.appears[series] = min(self.appears.get(series, appears), appears)

    def samples(self, series: str, minutes: int) -> list[int | None]:
        samples: list[int | None] = []
        total = 0
        for minute in range(minutes + 1):
            if minute < self.appears[series]:
                samples.append(None)
                continue
            total += self.increments[series].get(minute, 0)
            samples.append(total)
        return samples


def _count_caller(counters: _Counters, caller: str, turns: list[Turn]) -> None:
    """Prompt and cached tokens, requests by state, and the TTFT histogram of the states
    that classify the cache (not ``short``), every state the caller ever uses from its start."""
    appears = turns[0].minute - STEP_MINUTES
    labels = f'{JOB}, caller="{caller}", model="{MODEL}"'
    states = sorted({turn.state for turn in turns})
    bounds = [(f"{bound:g}", bound) for bound in TTFT_BOUNDS] + [("+Inf", float("inf"))]
    for turn in turns:
        counters.add(
            f"vllm_cache_prompt_tokens_total{{{labels}}}", turn.minute, turn.prompt_tokens, appears
        )
        counters.add(
            f"vllm_cache_cached_tokens_total{{{labels}}}", turn.minute, turn.cached_tokens, appears
        )
        for state in states:
            this_state = turn.state == state
            counters.add(
                f'vllm_cache_requests_total{{{labels}, state="{state}"}}',
                turn.minute,
                int(this_state),
                appears,
            )
            if state not in CLASSIFIED:
                continue
            for le, bound in bounds:
                counters.add(
                    f'vllm_cache_ttft_seconds_bucket{{{labels}, state="{state}", le="{le}"}}',
                    turn.minute,
                    int(this_state and turn.ttft_seconds <= bound),
                    appears,
                )


def _count_engine(counters: _Counters, turns: list[Turn]) -> None:
    """vLLM's prefix-cache counters: every caller's turns on the one engine."""
    labels = f'{JOB}, {TARGET}, model_name="{MODEL}", engine="0"'
    appears = turns[0].minute - STEP_MINUTES
    for turn in turns:
        counters.add(
            f"vllm_cache_engine_prefix_cache_queries_tokens_total{{{labels}}}",
            turn.minute,
            turn.prompt_tokens,
            appears,
        )
        counters.add(
            f"vllm_cache_engine_prefix_cache_hits_tokens_total{{{labels}}}",
            turn.minute,
            turn.cached_tokens,
            appears,
        )


def counters(turns: Iterable[Turn], minutes: int) -> dict[str, str]:
    """``{series: values}`` for every counter the exporter would serve, minute 0..minutes;
    vLLM's first, then each caller's, in a stable order."""
    ordered = sorted(turns, key=lambda turn: (turn.minute, turn.caller))
    counted = _Counters()
    _count_engine(counted, ordered)
    callers = sorted({turn.caller for turn in ordered})
    for caller in callers:
        _count_caller(counted, caller, [turn for turn in ordered if turn.caller == caller])
    served = {series: encode(counted.samples(series, minutes)) for series in counted.increments}
    # Prometheus scraped the exporter throughout (VllmCacheExporterAbsent stays silent).
    return {f"up{{{JOB}}}": f"1x{minutes}", **served}


# --- the scenarios --------------------------------------------------------------------------

WARM_TTFT = 6.0
COLD_TTFT = 74.0  # report 001: a ~90k cold turn
COLLAPSED_TTFT = 150.0  # prompt reading slowed by the other stream's decoding (report 000)


LULL = range(200, 208)  # agent B waits on a long tool call


def long_collapse() -> tuple[list[Turn], int]:
    """Agent A alone for two hours, one ~60k turn a minute, 93% cached. At 120m agent B
    arrives; the two no longer fit the KV pool and evict each other for three hours: every
    turn of both is cold, slow, and only one every two minutes each. For eight minutes from
    200m B waits on a tool call: A re-reads its prompt once, then has three warm turns, until
    B is back and the eviction goes on. At 300m B leaves; A's next turn re-reads its evicted
    prompt (cold, 74 s), then A is warm again."""
    turns = [Turn(1, "agent-a", 60_000, 0, "cold", COLD_TTFT)]
    turns += [
        Turn(minute, "agent-a", 60_000, 55_800, "warm", WARM_TTFT) for minute in range(2, 120)
    ]
    for minute in range(120, 300, 2):
        if minute == LULL.start:
            turns.append(Turn(minute, "agent-a", 62_000, 0, "cold", COLD_TTFT))
        elif minute in LULL:
            turns.append(Turn(minute, "agent-a", 62_000, 57_344, "warm", WARM_TTFT))
        else:
            turns.append(Turn(minute, "agent-a", 62_000, 0, "cold", COLLAPSED_TTFT))
        if minute not in LULL:
            turns.append(Turn(minute + 1, "agent-b", 35_000, 0, "cold", 100.0))
    turns.append(Turn(300, "agent-a", 62_000, 0, "cold", COLD_TTFT))
    turns += [
        Turn(minute, "agent-a", 62_000, 57_344, "warm", WARM_TTFT) for minute in range(301, 331)
    ]
    return turns, 330


DECLINE_START, DECLINE_MINUTES, DECLINE_STEP_MINUTES = 120, 1440, 10
DECLINE_PROMPT = 72_000


def decline_cached_tokens(minute: int) -> int:
    """90% of a 72k prompt cached until 120m, then 350 tokens fewer every ten minutes: 20%
    after 24 h (144 steps of 0.486 percentage points), and 20% from then on."""
    step = min(
        max(minute - DECLINE_START, 0) // DECLINE_STEP_MINUTES,
        DECLINE_MINUTES // DECLINE_STEP_MINUTES,
    )
    return 64_800 - 350 * step


def slow_decline() -> tuple[list[Turn], int]:
    """One caller, one 72k turn a minute, for 26.5 hours; its cached share slides from 90%
    to 20% over the middle 24 hours (see :func:`decline_cached_tokens`)."""
    minutes = DECLINE_START + DECLINE_MINUTES + 30
    turns = []
    for minute in range(1, minutes + 1):
        cached = decline_cached_tokens(minute)
        # Below 85% a turn is partial, and reads its uncached part at report 001's pace.
        state = "warm" if cached >= 0.85 * DECLINE_PROMPT else "partial"
        ttft = WARM_TTFT if state == "warm" else 2 + (DECLINE_PROMPT - cached) / 1_300
        turns.append(Turn(minute, "agent-a", DECLINE_PROMPT, cached, state, ttft))
    return turns, minutes


HYBRID_SHARES = (0.89, 0.94, 0.91, 0.93, 0.92, 0.90)  # report 001's warm turns, cycled
GRANULE = 2_048
FANOUT_SHARES = (0.63, 0.55, 0.71, 0.50, 0.66, 0.75, 0.58, 0.62)  # report 002's 62.9%, wobbling


def _agent_a_day(minutes: Iterable[int], fresh_at: set[int]) -> list[Turn]:
    """Report 001's agent: conversations start cold at 20k tokens and grow 2,300 a turn;
    warm turns cache 89-94% (whole 2,048-token granules); every 17th turn edits earlier
    context and only half of it is cached (partial, 25 s); a conversation ends after 35
    turns and the next one starts cold (30 s)."""
    turns: list[Turn] = []
    turn_in_conversation = 0
    for count, minute in enumerate(minutes):
        if minute in fresh_at or turn_in_conversation == 35:
            turn_in_conversation = 0
        prompt = 20_000 + 2_300 * turn_in_conversation
        if turn_in_conversation == 0:
            turns.append(Turn(minute, "agent-a", prompt, 0, "cold", 30.0))
        elif count % 17 == 16:
            cached = (prompt // 2 // GRANULE) * GRANULE
            turns.append(Turn(minute, "agent-a", prompt, cached, "partial", 25.0))
        else:
            share = HYBRID_SHARES[count % len(HYBRID_SHARES)]
            cached = int(prompt * share) // GRANULE * GRANULE
            turns.append(Turn(minute, "agent-a", prompt, cached, "warm", WARM_TTFT))
        turn_in_conversation += 1
    return turns


def healthy_day() -> tuple[list[Turn], int]:
    """26 hours from 06:00 (minute 0) on one vLLM:

    - agent-a, report 001's agent: a turn a minute 06:00-10:00 and 11:00-17:00 (lunch off),
      one every three minutes 17:00-19:00, then nothing until 06:00 the next morning, when
      it starts a fresh conversation (its first turn cold) until 08:00;
    - fanout, sub-agents sharing a 20k prefix (report 002: 62.9%): 32k tokens a minute
      07:00-16:00, its cached share moving between 50% and 75% every quarter of an hour;
    - batch, a summariser that never reuses anything (one granule at most): 20k tokens a
      minute 08:00-09:00 and 13:00-14:00, beside the others;
    - monitor, a 1,500-token health check every ten minutes, day and night (below the
      traffic floor, and too short for one granule)."""
    minutes = 26 * 60
    agent_minutes = [
        *range(1, 240),
        *range(300, 660),
        *range(660, 780, 3),
        *range(1440, minutes + 1),
    ]
    turns = _agent_a_day(agent_minutes, fresh_at={1, 300, 1440})
    for minute in range(60, 600):
        share = FANOUT_SHARES[(minute // 15) % len(FANOUT_SHARES)]
        turns.append(Turn(minute, "fanout", 32_000, int(32_000 * share), "partial", 12.0))
    for minute in (*range(120, 180), *range(420, 480)):
        turns.append(Turn(minute, "batch", 20_000, GRANULE * (minute % 2), "cold", 25.0))
    for minute in range(5, minutes + 1, 10):
        turns.append(Turn(minute, "monitor", 1_500, 0, "short", 0.4))
    return turns, minutes


SCENARIOS: dict[str, Callable[[], tuple[list[Turn], int]]] = {
    "long_collapse.yaml": long_collapse,
    "slow_decline.yaml": slow_decline,
    "healthy_day.yaml": healthy_day,
}


# --- writing them into the promtool test files ----------------------------------------------

_INPUT_BLOCK = re.compile(r"(?m)^    input_series:\n(?:      .*\n)+")


def input_block(series: dict[str, str]) -> str:
    lines = ["    input_series:"]
    for name, values in series.items():
        lines.append(f"      - series: '{name}'")
        lines.append(f"        values: '{values}'")
    return "\n".join(lines) + "\n"


def render(filename: str, text: str) -> str:
    """The file's text with its one ``input_series`` block rebuilt from the scenario."""
    turns, minutes = SCENARIOS[filename]()
    blocks = _INPUT_BLOCK.findall(text)
    if len(blocks) != 1:
        raise ValueError(f"{filename}: expected one input_series block, found {len(blocks)}")
    return _INPUT_BLOCK.sub(lambda _match: input_block(counters(turns, minutes)), text)


def main() -> int:
    for filename in SCENARIOS:
        path = ALERTS_TESTS / filename
        text = path.read_text(encoding="utf-8")
        rendered = render(filename, text)
        if rendered != text:
            path.write_text(rendered, encoding="utf-8")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
