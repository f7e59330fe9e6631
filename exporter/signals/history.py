"""The exporter's own memory of the alerts' windows, for the status page, ``check`` and the
demo: per (caller, model) pair and per vLLM target, the totals at every slot boundary of the
long window (a slot is a tenth of the short window: 30 s of the default 5 minutes, over the
last hour), and the long-window hit ratios over the baseline window (a day by default).

Prometheus keeps history for those who run one; the page is for those who do not, and says
what the alerts would: so it reads the same windows (``Windows``, from the monitoring config
the rules were generated from) and the same baseline, the ``quantile_over_time`` of the
long-window ratio over the baseline window (``quantile``), as the recorded series do.

Sampling is lazy and exact. The totals only change when an event is recorded (or a vLLM is
read), so the owner calls ``due`` before applying each change and, when a boundary has passed,
hands in the totals as they stood: those are the totals at that boundary. A quiet stretch
leaves a gap, and a gap means "nothing changed": the totals at a boundary are those of the
first sample at or after it (``Timeline.at``); the long-window ratios of the instants in a gap
are known as well and filled in with the next sample.

Bounded whatever the traffic: at most ``Windows.samples`` samples per key (121 by default),
one key per (caller, model) pair the series budget admits (``max_callers``), per vLLM
target and per model_name the targets serve, and at most ``BASELINE_SAMPLES`` long-window
ratios per caller or target key. A sample is an ``array("d")`` of ``CALLER_FIELDS`` doubles:
about 300 bytes with its share of the deque, and a ratio 12 bytes, so about 38 KB per pair
(docs/limits.md; tests/test_history.py fills it and measures).

Pure: times are handed in; nothing here reads a clock.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The defaults: the alerts' 5-minute window read to a tenth of itself, and the long window.
SLOT_SECONDS = 30.0
HOUR_SECONDS = 3600.0
SLOTS = int(HOUR_SECONDS // SLOT_SECONDS)
# The boundaries of an hour of slots: both ends of each (the live totals end the current one).
SAMPLES = SLOTS + 1
# Slots per short window: a window is read to within a tenth of itself.
SHORT_SLOTS = 10
# Long-window ratios kept per key for the baseline (one every baseline window / this, at
# most one per slot): 288 over a day, one every 5 minutes.
BASELINE_SAMPLES = 288
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
    # prompt tokens missed because their prefix had been evicted (the pair's own miss
    # counters; 0 where it has none): the prefill time evictions cost it (signals/prefill.py)
    "evicted_tokens",
)
FIELD = {name: index for index, name in enumerate(CALLER_FIELDS)}
# The fields of a vLLM target sample.
TARGET_FIELDS = ("time", "preemptions", "queries", "hits")
TARGET_FIELD = {name: index for index, name in enumerate(TARGET_FIELDS)}
# The fields of a model's sample (per vLLM ``model_name``, summed over the targets serving
# it): the prompt tokens its engines computed (prompt less prompt_tokens_cached, of the rows
# that have both) and the seconds their requests spent in prefill (signals/prefill.py).
MODEL_FIELDS = ("time", "computed_prompt_tokens", "prefill_seconds")
MODEL_FIELD = {name: index for index, name in enumerate(MODEL_FIELDS)}


@dataclass(frozen=True)
class Windows:
    """The alerts' windows (the monitoring config's short, long and baseline windows): what
    the page calls "now", "the last hour" and "the baseline", read from this history."""

    short_seconds: float = 300.0
    long_seconds: float = HOUR_SECONDS
    baseline_seconds: float = 86_400.0

    @property
    def slot_seconds(self) -> float:
        return self.short_seconds / SHORT_SLOTS

    @property
    def span_seconds(self) -> float:
        """How far back the totals are kept: the long window, and two short ones (the
        alerts' traffic floor looks one short window back)."""
        return max(self.long_seconds, 2 * self.short_seconds)

    @property
    def samples(self) -> int:
        return math.ceil(self.span_seconds / self.slot_seconds - 1e-9) + 1

    @property
    def baseline_interval(self) -> float:
        """Time between the baseline's instants, in whole milliseconds: the step of the
        baseline rule's subquery (exporter/monitoring/config.py), whose instants are these."""
        return round(max(self.slot_seconds, self.baseline_seconds / BASELINE_SAMPLES), 3)


DEFAULT_WINDOWS = Windows()


def slot_start(now: float, slot_seconds: float = SLOT_SECONDS) -> float:
    """The slot boundary at or before ``now``."""
    return math.floor(now / slot_seconds) * slot_seconds


class Timeline:
    """Samples of one key (oldest first), each an array whose field 0 is its time, and the
    key's long-window hit ratios for its baseline."""

    __slots__ = ("samples", "first_seen", "baseline")

    def __init__(self, first_seen: float, samples: int = SAMPLES) -> None:
        self.samples: deque[array[float]] = deque(maxlen=samples)
        # Before this time every total was 0 (the key did not exist yet).
        self.first_seen = first_seen
        self.baseline = Ratios()

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


class Ratios:
    """One key's long-window hit ratios, one every ``Windows.baseline_interval``, over the
    baseline window: what ``quantile_over_time`` reads in the baseline rule. Times as doubles,
    ratios as floats (12 bytes a sample, at most ``BASELINE_SAMPLES`` + 1 of them)."""

    __slots__ = ("times", "values", "checked")

    def __init__(self) -> None:
        self.times = array("d")
        self.values = array("f")
        self.checked = -math.inf  # the last instant looked at (it may have had no traffic)

    @property
    def last(self) -> float:
        return self.times[-1] if self.times else -math.inf

    def add(self, when: float, value: float, cutoff: float) -> None:
        self.times.append(when)
        self.values.append(value)
        drop = 0
        while drop < len(self.times) - 1 and self.times[drop] < cutoff:
            drop += 1
        if drop:
            del self.times[:drop]
            del self.values[:drop]

    def since(self, cutoff: float) -> list[float]:
        pairs = zip(self.times, self.values, strict=True)
        return [value for when, value in pairs if when >= cutoff]


def quantile(q: float, values: Sequence[float]) -> float | None:
    """Prometheus' ``quantile_over_time``: the q-quantile of the values, interpolated linearly
    between the closest ranks (rank q * (n - 1)); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    lower = max(0, math.floor(rank))
    upper = min(len(ordered) - 1, lower + 1)
    weight = rank - lower
    return ordered[lower] * (1 - weight) + ordered[upper] * weight


# (field of the cached or hit tokens, field of the prompt or looked-up tokens) of each kind of
# key, for its long-window hit ratio.
CALLER_RATIO = (FIELD["cached_tokens"], FIELD["prompt_tokens"])
TARGET_RATIO = (TARGET_FIELD["hits"], TARGET_FIELD["queries"])


class History:
    """Timelines of every (caller, model) pair, every vLLM target and every model_name the
    targets serve, sampled at slot boundaries; the pairs' and targets' with their long-window
    ratios over the baseline window."""

    def __init__(self, max_callers: int, windows: Windows = DEFAULT_WINDOWS) -> None:
        self.max_callers = max(1, max_callers)
        self.windows = windows
        self.callers: dict[Any, Timeline] = {}
        self.targets: dict[Any, Timeline] = {}
        self.models: dict[Any, Timeline] = {}
        self.next_due = -sys.float_info.max  # the first sample is due at once

    def due(self, now: float) -> bool:
        """A boundary has passed since the last sample (never for an infinite or NaN time)."""
        return self.next_due <= now < math.inf

    def record(
        self,
        now: float,
        callers: Mapping[Any, Sequence[float]],
        targets: Mapping[Any, Sequence[float]],
        first_seen: Mapping[Any, float],
        models: Mapping[Any, Sequence[float]] | None = None,
    ) -> None:
        """Store the totals as they stood at the last boundary before ``now`` (each sequence
        without its time field, in ``CALLER_FIELDS`` / ``TARGET_FIELDS`` / ``MODEL_FIELDS``
        order)."""
        windows = self.windows
        boundary = slot_start(now, windows.slot_seconds)
        if not math.isfinite(boundary):  # a clock at the float's edge rounds past it
            return
        self.next_due = boundary + windows.slot_seconds
        cutoff = boundary - windows.span_seconds
        self._store(
            self.callers, callers, boundary, cutoff, first_seen, self.max_callers, CALLER_RATIO
        )
        self._store(self.targets, targets, boundary, cutoff, {}, len(targets), TARGET_RATIO)
        models = models or {}
        self._store(self.models, models, boundary, cutoff, {}, len(models), None)

    def _store(
        self,
        timelines: dict[Any, Timeline],
        totals: Mapping[Any, Sequence[float]],
        boundary: float,
        cutoff: float,
        first_seen: Mapping[Any, float],
        limit: int,
        fields: tuple[int, int] | None,
    ) -> None:
        samples = self.windows.samples
        for key, values in totals.items():
            timeline = timelines.get(key)
            if timeline is None:
                timeline = timelines[key] = Timeline(first_seen.get(key, boundary), samples)
            else:  # most recently sampled last, so the bound lets go of the stalest
                timelines[key] = timelines.pop(key)
            sample = array("d", (boundary, *values))
            if fields is not None:
                self._ratios(timeline, sample, fields)
            timeline.append(sample)
            timeline.forget_before(cutoff)
        while len(timelines) > limit:
            del timelines[next(iter(timelines))]

    def _ratios(self, timeline: Timeline, sample: array[float], fields: tuple[int, int]) -> None:
        """The long-window ratio at each baseline instant from the last one kept up to this
        boundary (a gap in the samples is a stretch without change, so every instant in it
        is known): as the baseline rule records it, one sample per instant with traffic."""
        windows = self.windows
        interval, long = windows.baseline_interval, windows.long_seconds
        ratios = timeline.baseline
        boundary = sample[0]
        latest = math.floor(boundary / interval) * interval
        if not latest > ratios.checked:
            return
        # the instants since the last one looked at (a new key: this one), at most a baseline
        # window of them; counted, not stepped, so a clock far out (where adding an interval
        # changes nothing) still ends the loop
        count = 1
        if ratios.checked > -math.inf:
            most = math.ceil(windows.baseline_seconds / interval)
            gap = (latest - ratios.checked) / interval  # inf for a clock at the float's edge
            count = max(1, math.floor(gap + 1e-9)) if gap < most else most
        ratios.checked = latest
        cached, prompt = fields
        for back in range(count - 1, -1, -1):
            when = latest - back * interval
            end = sample if when >= boundary else timeline.at(when, sample)
            start = timeline.at(when - long, sample)
            looked_up = end[prompt] - start[prompt]
            if looked_up > 0:
                ratios.add(
                    when, (end[cached] - start[cached]) / looked_up, when - windows.baseline_seconds
                )

    def forget(self, which: Callable[[Any], bool]) -> None:
        """Drop the timelines of the (caller, model) keys ``which`` picks (a caller gone)."""
        for key in [key for key in self.callers if which(key)]:
            del self.callers[key]

    def caller(self, key: Hashable) -> Timeline | None:
        return self.callers.get(key)

    def target(self, name: Hashable) -> Timeline | None:
        return self.targets.get(name)

    def model(self, name: Hashable) -> Timeline | None:
        return self.models.get(name)

    def baseline(self, timeline: Timeline | None, now: float, q: float) -> float | None:
        """The q-quantile of the key's long-window ratios over the baseline window."""
        if timeline is None:
            return None
        return quantile(q, timeline.baseline.since(now - self.windows.baseline_seconds))


def at(timeline: Timeline | None, when: float, current: Sequence[float]) -> Sequence[float]:
    """``Timeline.at``; a key without a timeline yet (first seen in the current slot) was at
    zero before now."""
    if timeline is None:
        return current if when >= current[0] else [when] + [0.0] * (len(current) - 1)
    return timeline.at(when, current)


def slot_starts(now: float, slots: int = SLOTS, slot_seconds: float = SLOT_SECONDS) -> list[float]:
    """The starts of the last ``slots`` slots, oldest first; the last holds now."""
    current = slot_start(now, slot_seconds)
    return [current - index * slot_seconds for index in range(slots - 1, -1, -1)]


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
