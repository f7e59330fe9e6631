"""The last hour, for the status page: per-caller and per-vLLM totals every 30 seconds.

Prometheus keeps history for those who run one; the status page is for those who do not, so
the exporter keeps just enough to say "since when" and draw a sparkline: the cumulative
totals of each caller (and of each vLLM target) at every 30-second boundary of the last hour.

Sampling is lazy and exact. The totals only change when an event is recorded (or a vLLM is
read), so the owner calls ``due`` before applying each change and, when a boundary has passed,
hands in the totals as they stood: those are the totals at that boundary. A quiet stretch
leaves a gap, and a gap means "nothing changed": the totals at a boundary are those of the
first sample at or after it (``CallerTimeline.at``).

Bounded whatever the traffic: at most ``SAMPLES`` samples per key, one key per caller label
(itself capped by the caller cap, and here by ``max_callers``) and per vLLM target. A sample is
an ``array("d")`` of ``CALLER_FIELDS`` doubles: about 290 bytes with its share of the deque, so
about 35 KB per caller and 3.5 MB at the default cap of 100 callers and __other__ (docs/limits.md;
tests/test_history.py fills it and measures).

Pure: times are handed in; nothing here reads a clock.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections import deque
from collections.abc import Mapping, Sequence

SLOT_SECONDS = 30.0
HOUR_SECONDS = 3600.0
SLOTS = int(HOUR_SECONDS // SLOT_SECONDS)
# The boundaries of an hour of slots: both ends of each (the live totals end the current one).
SAMPLES = SLOTS + 1

# The fields of a caller sample, in order (all cumulative since the exporter started).
CALLER_FIELDS = (
    "time",
    "prompt_tokens",
    "cached_tokens",
    "unreported_prompt_tokens",
    "warm",
    "partial",
    "cold",
    "short",
    "unknown",
    "error",
    "followups",
    "followups_cold",
    # TTFT of warm and cold turns, vLLM's own (--enable-per-request-metrics) and the proxy's
    "ttft_engine_warm_sum",
    "ttft_engine_warm_count",
    "ttft_engine_cold_sum",
    "ttft_engine_cold_count",
    "ttft_proxy_warm_sum",
    "ttft_proxy_warm_count",
    "ttft_proxy_cold_sum",
    "ttft_proxy_cold_count",
)
FIELD = {name: index for index, name in enumerate(CALLER_FIELDS)}
# The fields of a vLLM target sample.
TARGET_FIELDS = ("time", "preemptions", "queries", "hits")
TARGET_FIELD = {name: index for index, name in enumerate(TARGET_FIELDS)}


def slot_start(now: float) -> float:
    """The 30-second boundary at or before ``now``."""
    return math.floor(now / SLOT_SECONDS) * SLOT_SECONDS


class Timeline:
    """Samples of one key (oldest first), each an array whose field 0 is its time."""

    __slots__ = ("samples", "first_seen")

    def __init__(self, first_seen: float) -> None:
        self.samples: deque[array[float]] = deque(maxlen=SAMPLES)
        # Before this time every total was 0 (the key did not exist yet).
        self.first_seen = first_seen

    def append(self, sample: array[float]) -> None:
        samples = self.samples
        if samples and samples[-1][0] >= sample[0]:
            samples[-1] = sample  # the same boundary again: the later totals win
        else:
            samples.append(sample)

    def forget_before(self, cutoff: float) -> None:
        """Drop samples older than ``cutoff``, keeping the first one at or after it."""
        samples = self.samples
        while len(samples) > 1 and samples[1][0] <= cutoff:
            samples.popleft()

    def at(self, when: float, current: Sequence[float]) -> Sequence[float]:
        """The totals at time ``when``: zeros before the key existed, else the first sample at
        or after ``when`` (nothing changed in a gap), else ``current`` (the live totals)."""
        if when <= self.first_seen:
            return [when] + [0.0] * (len(current) - 1)
        for sample in self.samples:
            if sample[0] >= when:
                return sample
        return current


class History:
    """Timelines of every caller and every vLLM target, sampled at 30-second boundaries."""

    def __init__(self, max_callers: int) -> None:
        self.max_callers = max(1, max_callers)
        self.callers: dict[str, Timeline] = {}
        self.targets: dict[str, Timeline] = {}
        self.next_due = -sys.float_info.max  # the first sample is due at once

    def due(self, now: float) -> bool:
        """A boundary has passed since the last sample (never for an infinite or NaN time)."""
        return self.next_due <= now < math.inf

    def record(
        self,
        now: float,
        callers: Mapping[str, Sequence[float]],
        targets: Mapping[str, Sequence[float]],
        first_seen: Mapping[str, float],
    ) -> None:
        """Store the totals as they stood at the last boundary before ``now`` (each sequence
        without its time field, in ``CALLER_FIELDS`` / ``TARGET_FIELDS`` order)."""
        boundary = slot_start(now)
        self.next_due = boundary + SLOT_SECONDS
        cutoff = boundary - HOUR_SECONDS
        self._store(self.callers, callers, boundary, cutoff, first_seen, self.max_callers)
        self._store(self.targets, targets, boundary, cutoff, {}, len(targets))

    @staticmethod
    def _store(
        timelines: dict[str, Timeline],
        totals: Mapping[str, Sequence[float]],
        boundary: float,
        cutoff: float,
        first_seen: Mapping[str, float],
        limit: int,
    ) -> None:
        for key, values in totals.items():
            timeline = timelines.get(key)
            if timeline is None:
                timeline = timelines[key] = Timeline(first_seen.get(key, boundary))
            else:  # most recently sampled last, so the bound lets go of the stalest
                timelines[key] = timelines.pop(key)
            sample = array("d", (boundary, *values))
            timeline.append(sample)
            timeline.forget_before(cutoff)
        while len(timelines) > limit:
            del timelines[next(iter(timelines))]

    def caller(self, name: str) -> Timeline | None:
        return self.callers.get(name)

    def target(self, name: str) -> Timeline | None:
        return self.targets.get(name)


def at(timeline: Timeline | None, when: float, current: Sequence[float]) -> Sequence[float]:
    """``Timeline.at``; a key without a timeline yet (first seen in the current slot) was at
    zero before now."""
    if timeline is None:
        return current if when >= current[0] else [when] + [0.0] * (len(current) - 1)
    return timeline.at(when, current)


def slot_starts(now: float, slots: int = SLOTS) -> list[float]:
    """The starts of the last ``slots`` 30-second slots, oldest first; the last holds now."""
    current = slot_start(now)
    return [current - index * SLOT_SECONDS for index in range(slots - 1, -1, -1)]


def at_times(
    timeline: Timeline | None, current: Sequence[float], times: Sequence[float]
) -> list[Sequence[float]]:
    """``at`` for each of ``times`` (ascending), in one pass over the samples."""
    if timeline is None:
        return [at(None, when, current) for when in times]
    samples = timeline.samples
    count = len(samples)
    index = 0
    out: list[Sequence[float]] = []
    for when in times:
        if when <= timeline.first_seen:
            out.append([when] + [0.0] * (len(current) - 1))
            continue
        while index < count and samples[index][0] < when:
            index += 1
        out.append(samples[index] if index < count else current)
    return out
