"""Engine-side state: the last snapshot per target and restart-proof counters.

Pure: callers hand in snapshots and the time; nothing here reads a clock or a socket.
vLLM's counters fall to 0 when it restarts. Passing them through would let ``rate()`` see a
reset only when the new value is lower than the old one; a restarted vLLM that already served
more than before the scrape would read as a small increase and the lost history as nothing.
So each counter is carried forward here: a drop, or a changed ``_created`` timestamp, is a
restart, and the new value is added on top. The exported counters never go down while the
exporter runs, and never jump by the old total.

The KV pool is carried the same way: its size moves from boot to boot (with whatever else
holds GPU memory when vLLM loads), and the smallest one seen is the one an admission budget
must fit under, so each target remembers the smallest pool of each engine across restarts.

A split counter (prompt tokens by source, say) is carried per label value, each on its own.
A histogram's buckets, sum and count are counters too, carried together: a restart seen in
any of them (or in the histogram's ``_created`` time) adds the whole new histogram on top.
A restarted vLLM may come back with other bucket bounds (``--custom-histogram-buckets``);
then the carried totals are re-based onto the new bounds, each new bound taking the largest
count ever shown for a bound at or below it. Every exported bucket still never goes down
(even a bound that leaves with one restart and comes back with another), the buckets still
grow with the bound, the count is still every observation, and ``rate()`` over a window
after the change sees exactly the new observations; only observations from before the
change that fell between two old bounds are counted in a higher bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from exporter.redaction import redact_url
from exporter.values import (
    COUNTER_SIGNALS,
    SCRAPE_ERROR_REASONS,
    CacheConfig,
    EngineSnapshot,
    EngineValues,
    HistogramValue,
)

# Counter tracks kept per target: (model_name, engine, signal, label value) ever seen. vLLM
# has one engine label per data-parallel rank and one model_name per served model, and about
# 20 counters per engine (split ones included), so this is far above any real engine; it
# bounds a target whose labels churn.
MAX_TRACKS = 1024
# Engines whose smallest pool is remembered, per target (least recently seen first out).
MAX_POOL_ENGINES = 64
# Histogram tracks kept per target: (model_name, engine, signal). Seven histograms per
# engine: room for 36 engines' worth.
MAX_HISTOGRAM_TRACKS = 256
# Bounds one histogram track remembers across changes of vLLM's buckets: four times the
# buckets one histogram may have, i.e. three changes of every bound before any is forgotten.
MAX_REMEMBERED_BOUNDS = 256

TrackKey = tuple[str, str, str, str]  # (model_name, engine, signal, label value or "")
HistogramKey = tuple[str, str, str]  # (model_name, engine, signal)


@dataclass
class CounterTrack:
    last_raw: float
    last_created: float | None
    total: float

    def update(self, raw: float, created: float | None) -> bool:
        """Fold a new raw reading in; return True when it shows a restart.

        The total only ever grows: a drop, or a new ``_created`` time, is a restart whose
        count is added on top. A read without a ``_created`` time keeps the last one known.
        """
        restarted = raw < self.last_raw or (
            created is not None and self.last_created is not None
            and created != self.last_created)
        self.total += raw if restarted else raw - self.last_raw
        self.last_raw = raw
        if created is not None:
            self.last_created = created
        return restarted


def _rebased(remembered: dict[float, float], bounds: tuple[float, ...]) -> tuple[float, ...]:
    """Carried counts for new bounds: each takes the largest count ever shown for a bound at
    or below it (0 below them all). So no bound shown before comes back lower, and the counts
    still grow with the bound."""
    known = sorted(remembered.items())
    base = []
    index = 0
    carried = 0.0
    for bound in bounds:
        while index < len(known) and known[index][0] <= bound:
            carried = max(carried, known[index][1])
            index += 1
        base.append(carried)
    return tuple(base)


@dataclass
class HistogramTrack:
    last_raw: HistogramValue
    last_created: float | None
    total: HistogramValue
    # The last count shown for every bound ever shown (a bound may leave with one restart
    # and come back with the next), at most MAX_REMEMBERED_BOUNDS of them.
    remembered: dict[float, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._remember()

    def update(self, raw: HistogramValue, created: float | None) -> bool:
        """Fold a new raw histogram in; return True when it shows a restart (any bucket, the
        sum or the count fell, the ``_created`` time changed, or the bounds changed)."""
        last = self.last_raw
        same_bounds = raw.bounds == last.bounds
        restarted = (
            not same_bounds or raw.sum < last.sum
            or any(now < before
                   for now, before in zip(raw.cumulative, last.cumulative, strict=True))
            or (created is not None and self.last_created is not None
                and created != self.last_created))
        base = (self.total.cumulative if same_bounds
                else _rebased(self.remembered, raw.bounds))
        if restarted:
            step, step_sum = raw.cumulative, raw.sum
        else:
            step = tuple(now - before
                         for now, before in zip(raw.cumulative, last.cumulative, strict=True))
            step_sum = raw.sum - last.sum
        self.total = HistogramValue(
            raw.bounds, tuple(a + b for a, b in zip(base, step, strict=True)),
            self.total.sum + step_sum)
        self.last_raw = raw
        if created is not None:
            self.last_created = created
        self._remember()
        return restarted

    def _remember(self) -> None:
        self.remembered.update(zip(self.total.bounds, self.total.cumulative, strict=True))
        while len(self.remembered) > MAX_REMEMBERED_BOUNDS:
            # Forget the lowest count, which is the least likely to be undercut.
            del self.remembered[min(self.remembered, key=self.remembered.__getitem__)]


@dataclass
class EngineRow:
    """What the exporter shows for one (target, model_name, engine)."""

    model_name: str
    engine: str
    counters: dict[str, float]  # signal name -> carried-forward total
    gauges: dict[str, float]  # signal name -> current value
    cache_config: CacheConfig | None
    # split signal -> label value -> carried-forward total (counters) or current value
    splits: dict[str, dict[str, float]] = field(default_factory=dict)
    histograms: dict[str, HistogramValue] = field(default_factory=dict)  # carried forward


@dataclass
class TargetState:
    target: str
    shown: str = ""  # the target as labels and pages show it: credentials redacted
    attempted: bool = False
    up: bool = False
    last_duration_seconds: float = 0.0
    last_error: str = ""
    last_success_time: float | None = None
    present: dict[str, bool] = field(default_factory=dict)
    rows: list[EngineRow] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)  # reason -> count
    restarts: int = 0
    invalid_samples: int = 0
    # engine label -> smallest KV pool (tokens) it reported since the exporter started
    smallest_pool: dict[str, int] = field(default_factory=dict)
    tracks: dict[TrackKey, CounterTrack] = field(default_factory=dict)
    histogram_tracks: dict[HistogramKey, HistogramTrack] = field(default_factory=dict)


class EngineState:
    def __init__(self, targets: tuple[str, ...]) -> None:
        self.targets: dict[str, TargetState] = {}
        shown_already: set[str] = set()
        for target in targets:
            shown = redact_url(target)
            number = 1
            while shown in shown_already:  # two URLs that differ only in their credentials
                number += 1
                shown = f"{redact_url(target)}#{number}"
            shown_already.add(shown)
            self.targets[target] = TargetState(
                target=target, shown=shown, errors=dict.fromkeys(SCRAPE_ERROR_REASONS, 0))

    @property
    def ready(self) -> bool:
        return all(t.attempted for t in self.targets.values())

    def record_failure(self, target: str, reason: str, message: str, duration: float) -> None:
        state = self.targets[target]
        state.attempted = True
        state.up = False
        state.last_duration_seconds = duration
        state.last_error = message
        state.errors[reason] = state.errors.get(reason, 0) + 1
        state.rows = []
        state.present = {}

    def record_success(self, target: str, snapshot: EngineSnapshot, duration: float,
                       now: float) -> None:
        state = self.targets[target]
        state.attempted = True
        state.up = True
        state.last_duration_seconds = duration
        state.last_error = ""
        state.last_success_time = now
        state.present = dict(snapshot.present)
        state.invalid_samples += snapshot.invalid_samples
        carry = _Carry(state)
        rows = [carry.row(values) for _key, values in sorted(snapshot.engines.items())]
        for row in rows:
            row.cache_config = snapshot.cache_config_for(row.engine)
        # Engines with no model-labelled series still have a config (e.g. before traffic).
        known_engines = {row.engine for row in rows}
        for engine, config in sorted(snapshot.cache_configs.items()):
            if engine not in known_engines:
                rows.append(EngineRow("", engine, {}, {}, config))
        if carry.restarted:
            state.restarts += 1
        remember_smallest_pool(state.smallest_pool, snapshot)
        carry.forget_beyond_bounds()
        state.rows = rows


def remember_smallest_pool(smallest: dict[str, int], snapshot: EngineSnapshot) -> None:
    """Fold each engine's pool into the smallest seen; bounded by ``MAX_POOL_ENGINES``."""
    for engine, config in snapshot.cache_configs.items():
        pool = config.pool_tokens
        if not pool:
            continue
        known = smallest.pop(engine, None)
        smallest[engine] = pool if known is None else min(known, pool)
    while len(smallest) > MAX_POOL_ENGINES:
        del smallest[next(iter(smallest))]


class _Carry:
    """One read's values, carried forward through the target's tracks."""

    def __init__(self, state: TargetState) -> None:
        self.state = state
        self.restarted = False
        self.seen: set[TrackKey] = set()
        self.seen_histograms: set[HistogramKey] = set()

    def row(self, values: EngineValues) -> EngineRow:
        counters: dict[str, float] = {}
        gauges: dict[str, float] = {}
        for signal_name, raw in values.values.items():
            if signal_name in COUNTER_SIGNALS:
                counters[signal_name] = self.counter(
                    values, signal_name, "", raw, values.created.get(signal_name))
            else:
                gauges[signal_name] = raw
        splits: dict[str, dict[str, float]] = {}
        for signal_name, by_value in values.splits.items():
            if signal_name not in COUNTER_SIGNALS:
                splits[signal_name] = dict(by_value)
                continue
            created = values.split_created.get(signal_name, {})
            splits[signal_name] = {
                label: self.counter(values, signal_name, label, raw, created.get(label))
                for label, raw in by_value.items()}
        histograms = {signal_name: self.histogram(values, signal_name, raw)
                      for signal_name, raw in values.histograms.items()}
        return EngineRow(values.model_name, values.engine, counters, gauges, None, splits,
                         histograms)

    def counter(self, values: EngineValues, signal_name: str, label: str, raw: float,
                created: float | None) -> float:
        key = (values.model_name, values.engine, signal_name, label)
        self.seen.add(key)
        tracks = self.state.tracks
        track = tracks.get(key)
        if track is None:
            tracks[key] = track = CounterTrack(raw, created, raw)
        elif track.update(raw, created):
            self.restarted = True
        return track.total

    def histogram(self, values: EngineValues, signal_name: str,
                  raw: HistogramValue) -> HistogramValue:
        key = (values.model_name, values.engine, signal_name)
        self.seen_histograms.add(key)
        tracks = self.state.histogram_tracks
        created = values.created.get(signal_name)
        track = tracks.get(key)
        if track is None:
            tracks[key] = track = HistogramTrack(raw, created, raw)
        elif track.update(raw, created):
            self.restarted = True
        return track.total

    def forget_beyond_bounds(self) -> None:
        """A counter missing from one read (NaN, absent, a partial exposition) keeps its
        track: forgetting it would restart its total from the next raw value, and Prometheus
        would see the exported counter go back. Tracks of rows gone for good are let go only
        past the bounds, least recently seen first."""
        _keep_recent(self.state.tracks, self.seen, MAX_TRACKS)
        _keep_recent(self.state.histogram_tracks, self.seen_histograms, MAX_HISTOGRAM_TRACKS)


def _keep_recent(tracks: dict[Any, Any], seen: set[Any], bound: int) -> None:
    for key in seen:
        tracks[key] = tracks.pop(key)  # most recently seen last
    while len(tracks) > bound:
        del tracks[next(iter(tracks))]
