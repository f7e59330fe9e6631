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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exporter.redaction import redact_url
from exporter.values import (
    COUNTER_SIGNALS,
    SCRAPE_ERROR_REASONS,
    CacheConfig,
    EngineSnapshot,
)

# Counter tracks kept per target: (model_name, engine, signal) triples ever seen. vLLM has
# one engine label per data-parallel rank and one model_name per served model, so this is
# far above any real engine; it bounds a target whose labels churn.
MAX_TRACKS = 1024
# Engines whose smallest pool is remembered, per target (least recently seen first out).
MAX_POOL_ENGINES = 64


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


@dataclass
class EngineRow:
    """What the exporter shows for one (target, model_name, engine)."""

    model_name: str
    engine: str
    counters: dict[str, float]  # signal name -> carried-forward total
    gauges: dict[str, float]  # signal name -> current value
    cache_config: CacheConfig | None


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
    tracks: dict[tuple[str, str, str], CounterTrack] = field(default_factory=dict)
    # engine label -> smallest KV pool (tokens) it reported since the exporter started
    smallest_pool: dict[str, int] = field(default_factory=dict)


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
        rows: list[EngineRow] = []
        seen: set[tuple[str, str, str]] = set()
        restarted = False
        for (model_name, engine), values in sorted(snapshot.engines.items()):
            counters: dict[str, float] = {}
            gauges: dict[str, float] = {}
            for signal_name, raw in values.values.items():
                if signal_name not in COUNTER_SIGNALS:
                    gauges[signal_name] = raw
                    continue
                key = (model_name, engine, signal_name)
                seen.add(key)
                created = values.created.get(signal_name)
                track = state.tracks.get(key)
                if track is None:
                    state.tracks[key] = track = CounterTrack(raw, created, raw)
                elif track.update(raw, created):
                    restarted = True
                counters[signal_name] = track.total
            rows.append(EngineRow(model_name, engine, counters, gauges,
                                  snapshot.cache_config_for(engine)))
        # Engines with no model-labelled series still have a config (e.g. before traffic).
        known_engines = {row.engine for row in rows}
        for engine, config in sorted(snapshot.cache_configs.items()):
            if engine not in known_engines:
                rows.append(EngineRow("", engine, {}, {}, config))
        if restarted:
            state.restarts += 1
        remember_smallest_pool(state.smallest_pool, snapshot)
        # A counter missing from one read (NaN, absent, a partial exposition) keeps its track:
        # forgetting it would restart its total from the next raw value, and Prometheus would
        # see the exported counter go back. Tracks of rows gone for good are let go only past
        # the bound, least recently seen first.
        for key in seen:
            state.tracks[key] = state.tracks.pop(key)  # most recently seen last
        while len(state.tracks) > MAX_TRACKS:
            del state.tracks[next(iter(state.tracks))]
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
