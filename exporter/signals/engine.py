"""Engine-side state: the last snapshot per target and restart-proof counters.

Pure: callers hand in snapshots and the time; nothing here reads a clock or a socket.
vLLM's counters fall to 0 when it restarts. Passing them through would let ``rate()`` see a
reset only when the new value is lower than the old one; a restarted vLLM that already served
more than before the scrape would read as a small increase and the lost history as nothing.
So each counter is carried forward here: a newer ``_created`` timestamp is a restart, and
so is a drop that a restart explains, and the new value is added on top. The exported
counters never go down while the exporter runs, and never jump by the old total.

Not every drop is a restart. A restart starts every counter again, with a new ``_created``
time: a counter that falls with its ``_created`` unchanged, or going back to an older one
(two vLLMs answering behind one URL in turn), or one counter family that falls alone while
another rises (where vLLM has no ``_created``), is a glitch: its reading is ignored and
counted as invalid (``fell_without_restart``, ``created_went_back``), the carried total is
left as it was, and the next honest reading continues from the last believed one. A drop
of two families or more at once, or of the only family that moved, is a restart.

Every increase is bounded too: at most MAX_INCREASE_PER_SECOND for each second since the
counter's last accepted reading (one second at least); a reading past it is ignored and
counted (``implausible_increase``), and the parser drops samples above 2**53 (exporter/
engine/parse.py, MAX_SAMPLE_VALUE). So a carried total is at most its first reading plus
the bounded increases: finite, whatever a target sends.

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

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from exporter.redaction import redact_url
from exporter.values import (
    COUNTER_SIGNALS,
    FOLD_REASONS,
    MAX_SAMPLE_VALUE,
    PARSE_INVALID_REASONS,
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

# The most a carried counter (or a histogram's count or sum) may grow per second since its
# last accepted reading: a thousand times the prompt tokens a large GPU node prefills in a
# second, and far more requests or seconds of latency than any engine observes.
MAX_INCREASE_PER_SECOND = 1e9
# The largest raw reading believed (the parser's own bound, exporter/engine/parse.py,
# checked again for snapshots that did not come from it).
MAX_RAW_VALUE = MAX_SAMPLE_VALUE  # the parser's bound, checked again here (module docstring)

# Why a sample was dropped: the parser's reasons (exporter/values.py) and the carrier's.
IMPLAUSIBLE_INCREASE, FELL_WITHOUT_RESTART, CREATED_WENT_BACK = (
    "implausible_increase",
    "fell_without_restart",
    "created_went_back",
)
INVALID_REASONS = (
    *PARSE_INVALID_REASONS,
    IMPLAUSIBLE_INCREASE,
    FELL_WITHOUT_RESTART,
    CREATED_WENT_BACK,
)

# What one reading of a track shows, before the family vote (_Carry.vote).
STEP, RESTART, FELL = "step", "restart", "fell"

TrackKey = tuple[str, str, str, str]  # (model_name, engine, signal, label value or "")
HistogramKey = tuple[str, str, str]  # (model_name, engine, signal)


def plausible_increase(since_last: float) -> float:
    return MAX_INCREASE_PER_SECOND * max(since_last, 1.0)


def _created_verdict(created: float | None, last_created: float | None) -> str | None:
    """RESTART for a newer ``_created`` time, CREATED_WENT_BACK for an older one, else None."""
    if created is None or last_created is None or created == last_created:
        return None
    return RESTART if created > last_created else CREATED_WENT_BACK


@dataclass
class CounterTrack:
    last_raw: float
    last_created: float | None
    total: float
    last_time: float = 0.0  # unix time of the last accepted reading

    def verdict(self, raw: float, created: float | None) -> str:
        """STEP, RESTART (a newer ``_created``), FELL (a drop without ``_created`` to tell,
        for the family vote), or the glitch's invalid reason."""
        by_created = _created_verdict(created, self.last_created)
        if by_created is not None:
            return by_created
        if raw < self.last_raw:
            # A _created time unchanged: the same process, whose counter cannot fall.
            known = created is not None and self.last_created is not None
            return FELL_WITHOUT_RESTART if known else FELL
        return STEP

    def apply(self, raw: float, created: float | None, restarted: bool, now: float) -> str | None:
        """Fold a believed reading in; the invalid reason when its increase is implausible
        (the reading is then ignored). A read without ``_created`` keeps the last one."""
        increase = raw if restarted else raw - self.last_raw
        if increase > plausible_increase(now - self.last_time):
            return IMPLAUSIBLE_INCREASE
        self.total += increase
        self.last_raw = raw
        self.last_time = now
        if created is not None:
            self.last_created = created
        return None

    def rose(self, raw: float) -> bool:
        return raw > self.last_raw


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
    last_time: float = 0.0  # unix time of the last accepted reading
    # The last count shown for every bound ever shown (a bound may leave with one restart
    # and come back with the next), at most MAX_REMEMBERED_BOUNDS of them.
    remembered: dict[float, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._remember()

    def verdict(self, raw: HistogramValue, created: float | None) -> str:
        """As CounterTrack.verdict; other bounds are a restart (a vLLM started with other
        --custom-histogram-buckets), any bucket, the sum or the count falling a drop."""
        by_created = _created_verdict(created, self.last_created)
        if by_created is not None:
            return by_created
        last = self.last_raw
        if raw.bounds != last.bounds:
            return RESTART
        if raw.sum < last.sum or any(
            now < before for now, before in zip(raw.cumulative, last.cumulative, strict=True)
        ):
            known = created is not None and self.last_created is not None
            return FELL_WITHOUT_RESTART if known else FELL
        return STEP

    def apply(
        self, raw: HistogramValue, created: float | None, restarted: bool, now: float
    ) -> str | None:
        """Fold a believed histogram in; the invalid reason when its count or sum grew
        implausibly (it is then ignored)."""
        last = self.last_raw
        same_bounds = raw.bounds == last.bounds
        if restarted:
            step, step_sum = raw.cumulative, raw.sum
        else:
            step = tuple(
                now - before for now, before in zip(raw.cumulative, last.cumulative, strict=True)
            )
            step_sum = raw.sum - last.sum
        bound = plausible_increase(now - self.last_time)
        if step[-1] > bound or step_sum > bound:
            return IMPLAUSIBLE_INCREASE
        base = self.total.cumulative if same_bounds else _rebased(self.remembered, raw.bounds)
        self.total = HistogramValue(
            raw.bounds,
            tuple(a + b for a, b in zip(base, step, strict=True)),
            self.total.sum + step_sum,
        )
        self.last_raw = raw
        self.last_time = now
        if created is not None:
            self.last_created = created
        self._remember()
        return None

    def rose(self, raw: HistogramValue) -> bool:
        return raw.count > self.last_raw.count

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
    # reason -> samples dropped (INVALID_REASONS at 0 from the start), or counted under
    # __other__ (FOLD_REASONS)
    invalid: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INVALID_REASONS, 0))
    folded: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FOLD_REASONS, 0))
    # engine label -> smallest KV pool (tokens) it reported since the exporter started
    smallest_pool: dict[str, int] = field(default_factory=dict)
    tracks: dict[TrackKey, CounterTrack] = field(default_factory=dict)
    histogram_tracks: dict[HistogramKey, HistogramTrack] = field(default_factory=dict)

    @property
    def invalid_samples(self) -> int:
        return sum(self.invalid.values())


def _add(counts: dict[str, int], more: Mapping[str, int]) -> None:
    for reason, count in more.items():
        if count:
            counts[reason] = counts.get(reason, 0) + count


# Told of each restart a read shows, once the read is carried: (the target, when it restarted
# by its ``_created`` time where that falls between the previous read and this one, else
# None, and this read's time). SignalsState ends the conversations that vLLM held.
RestartListener = Callable[[TargetState, float | None, float], None]


class EngineState:
    def __init__(self, targets: tuple[str, ...], on_restart: RestartListener | None = None) -> None:
        self.on_restart = on_restart
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
                target=target, shown=shown, errors=dict.fromkeys(SCRAPE_ERROR_REASONS, 0)
            )

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

    def record_success(
        self,
        target: str,
        snapshot: EngineSnapshot,
        duration: float,
        now: float,
        *,
        invalid: Mapping[str, int] | None = None,
        folded: Mapping[str, int] | None = None,
    ) -> None:
        """Carry one read forward. ``invalid`` says why the parser dropped the snapshot's
        ``invalid_samples`` (without it they are counted under ``other``), ``folded`` how
        many samples it counted under __other__, by reason."""
        state = self.targets[target]
        previous_read = state.last_success_time
        state.attempted = True
        state.up = True
        state.last_duration_seconds = duration
        state.last_error = ""
        state.last_success_time = now
        state.present = dict(snapshot.present)
        _add(state.invalid, invalid if invalid is not None else {"other": snapshot.invalid_samples})
        _add(state.folded, folded or {})
        carry = _Carry(state, snapshot, now)
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
        _add(state.invalid, carry.invalid)
        remember_smallest_pool(state.smallest_pool, snapshot)
        carry.forget_beyond_bounds()
        state.rows = rows
        if carry.restarted and self.on_restart is not None:
            created = carry.restart_created
            at = (
                created
                if created is not None
                and previous_read is not None
                and previous_read < created <= now
                else None
            )
            self.on_restart(state, at, now)


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


Reading = tuple[Any, str, Any, float | None]  # (track key, signal, raw value, _created)


def _counter_readings(values: EngineValues) -> list[Reading]:
    readings: list[Reading] = []
    for signal_name, raw in values.values.items():
        if signal_name in COUNTER_SIGNALS:
            readings.append(
                (
                    (values.model_name, values.engine, signal_name, ""),
                    signal_name,
                    raw,
                    values.created.get(signal_name),
                )
            )
    for signal_name, by_value in values.splits.items():
        if signal_name in COUNTER_SIGNALS:
            created = values.split_created.get(signal_name, {})
            readings.extend(
                (
                    (values.model_name, values.engine, signal_name, label),
                    signal_name,
                    raw,
                    created.get(label),
                )
                for label, raw in by_value.items()
            )
    return readings


def _histogram_readings(values: EngineValues) -> list[Reading]:
    return [
        (
            (values.model_name, values.engine, signal_name),
            signal_name,
            raw,
            values.created.get(signal_name),
        )
        for signal_name, raw in values.histograms.items()
    ]


def _unbelievable(raw: float) -> str | None:
    if not math.isfinite(raw):
        return "not_finite"
    if raw < 0:
        return "negative"
    return "too_large" if raw > MAX_RAW_VALUE else None


class _Carry:
    """One read's values, carried forward through the target's tracks.

    Each reading of a known track gets a verdict first (CounterTrack.verdict); the drops
    without a ``_created`` time to tell are then judged together (``vote``) before any
    track moves."""

    def __init__(self, state: TargetState, snapshot: EngineSnapshot, now: float) -> None:
        self.state = state
        self.now = now
        self.restarted = False
        self.restart_created: float | None = None  # the newest _created of a restart seen
        self.invalid: dict[str, int] = {}
        self.seen: set[TrackKey] = set()
        self.seen_histograms: set[HistogramKey] = set()
        self.verdicts: dict[Any, str] = {}
        self.vote(snapshot)

    def vote(self, snapshot: EngineSnapshot) -> None:
        """A drop is a restart when a newer ``_created`` time shows one in this read, when
        two families or more drop, or when no other family rose; else a glitch."""
        fell: set[str] = set()
        rose: set[str] = set()
        restart_shown = False
        for values in snapshot.engines.values():
            for tracks, readings in (
                (self.state.tracks, _counter_readings(values)),
                (self.state.histogram_tracks, _histogram_readings(values)),
            ):
                for key, signal_name, raw, created in readings:
                    track = tracks.get(key)
                    if track is None:
                        continue
                    verdict = self.verdicts[key] = track.verdict(raw, created)
                    restart_shown = restart_shown or verdict == RESTART
                    if verdict == FELL:
                        fell.add(signal_name)
                    elif verdict == STEP and track.rose(raw):
                        rose.add(signal_name)
        drop_is_restart = restart_shown or len(fell) >= 2 or not rose - fell
        for key, verdict in self.verdicts.items():
            if verdict == FELL:
                self.verdicts[key] = RESTART if drop_is_restart else FELL_WITHOUT_RESTART

    def count(self, reason: str) -> None:
        self.invalid[reason] = self.invalid.get(reason, 0) + 1

    def row(self, values: EngineValues) -> EngineRow:
        counters: dict[str, float] = {}
        gauges = {
            signal_name: raw
            for signal_name, raw in values.values.items()
            if signal_name not in COUNTER_SIGNALS
        }
        splits: dict[str, dict[str, float]] = {
            signal_name: dict(by_value)
            for signal_name, by_value in values.splits.items()
            if signal_name not in COUNTER_SIGNALS
        }
        for key, signal_name, raw, created in _counter_readings(values):
            total = self.counter(key, raw, created)
            if total is None:
                continue
            if signal_name in values.splits:
                splits.setdefault(signal_name, {})[key[3]] = total
            else:
                counters[signal_name] = total
        histograms: dict[str, HistogramValue] = {}
        for key, signal_name, raw, created in _histogram_readings(values):
            shown = self.histogram(key, raw, created)
            if shown is not None:
                histograms[signal_name] = shown
        return EngineRow(
            values.model_name, values.engine, counters, gauges, None, splits, histograms
        )

    def counter(self, key: TrackKey, raw: float, created: float | None) -> float | None:
        """The carried total after this reading (None: no believable reading yet)."""
        self.seen.add(key)
        tracks = self.state.tracks
        track = tracks.get(key)
        unbelievable = _unbelievable(raw)
        if unbelievable is not None:
            self.count(unbelievable)
            return track.total if track is not None else None
        if track is None:
            tracks[key] = track = CounterTrack(raw, created, raw, self.now)
            return track.total
        self.carry(track, raw, created, self.verdicts.get(key, STEP))
        return track.total

    def histogram(
        self, key: HistogramKey, raw: HistogramValue, created: float | None
    ) -> HistogramValue | None:
        self.seen_histograms.add(key)
        tracks = self.state.histogram_tracks
        track = tracks.get(key)
        unbelievable = _unbelievable(raw.count) or _unbelievable(raw.sum)
        if unbelievable is not None:
            self.count(unbelievable)
            return track.total if track is not None else None
        if track is None:
            tracks[key] = track = HistogramTrack(raw, created, raw, self.now)
            return track.total
        self.carry(track, raw, created, self.verdicts.get(key, STEP))
        return track.total

    def carry(
        self, track: CounterTrack | HistogramTrack, raw: Any, created: float | None, verdict: str
    ) -> None:
        if verdict not in (STEP, RESTART):  # a glitch: ignored, counted
            self.count(verdict)
            return
        refused = track.apply(raw, created, verdict == RESTART, self.now)
        if refused is not None:
            self.count(refused)
        elif verdict == RESTART:
            self.restarted = True
            if created is not None and (
                self.restart_created is None or created > self.restart_created
            ):
                self.restart_created = created

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
