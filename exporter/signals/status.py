"""What the status page and the demo show: the state now, the last hour, and what is wrong, in
plain words (``advice``), problems first.

One model for both surfaces, so they say the same thing at the same moment. Built from the
live state (counts as they are, not held back for Prometheus by the new-series hold) and the
history of the last hour (``signals.history``). Pure: the time is handed in, and so are the
collapse thresholds (the top takes them from the alerts' configuration, so that the page and
the pager agree on what a collapse is).

A caller's cache has collapsed now when the condition of the VllmCachePrefixCollapse alert
holds for one of its (caller, model) pairs, read from the exporter's own history
(``signals.history``) over the same windows the rules were generated with: its hit ratio over
the short window under ``drop_factor`` times its baseline (the 0.9-quantile of its long-window
ratio over the baseline window, as ``caller_model:vllm_cache_hit_ratio:p90_1d_rate1h``
records it), the baseline above ``min_baseline``, and prompt traffic above the floor over the
short window and over the one before it. The alert pages once the condition has held for its
``for:``; the page says it from the first moment, with the time it started: the start of the
earliest slot of the unbroken run of slots whose own ratio is under the same bar. A vLLM's own
prefix-cache counters follow the same condition (the engine form of the alert), which says it
when no proxy reports usage; when callers' collapse is said, the engine's would repeat it.

Where the page and Prometheus differ, it is by their samples: a window here starts at the
first slot boundary inside it (a tenth of the short window), Prometheus' at the first scrape
inside it; the baseline here has one long-window ratio every ``baseline_interval`` (5 minutes
of a day), the recorded one every rule evaluation; and the page knows only what the exporter
has seen since it started.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from exporter.signals import advice, foresight, prefill, timing
from exporter.signals.callers import OTHER
from exporter.signals.classify import STATES
from exporter.signals.engine import EngineState, TargetState
from exporter.signals.history import (
    FIELD,
    MODEL_FIELD,
    SHORT_SLOTS,
    TARGET_FIELD,
    Timeline,
    Windows,
    at_times,
    slot_starts,
)
from exporter.signals.usage import ENGINE, PROXY, UsageState
from exporter.values import (
    CACHE_CONFIG_INFO,
    KV_CACHE_USAGE,
    PREEMPTIONS,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
)

# The baseline: this quantile of the long-window ratio over the baseline window (the
# rules' BASELINE_QUANTILE, which tests/test_status_windows.py holds equal).
BASELINE_QUANTILE = 0.9
COLLAPSE_ALERT = "VllmCachePrefixCollapse"
# Engine signals whose absence breaks the cache signals (as ``check`` says).
REQUIRED_SIGNALS = (
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    PREEMPTIONS,
    KV_CACHE_USAGE,
    CACHE_CONFIG_INFO,
)

PROBLEM = "problem"
ADVICE = "advice"


@dataclass(frozen=True)
class CollapseRule:
    """When a hit ratio counts as collapsed (the top fills it from the alerts' config)."""

    window_seconds: float
    drop_factor: float
    min_baseline: float
    caller_min_tokens_per_second: float
    engine_min_tokens_per_second: float
    # VllmCachePrefixCollapse's severity is critical: its condition pages
    pages: bool = True


@dataclass(frozen=True)
class Item:
    """One thing to say, problems first. ``key`` tells the same item apart over time."""

    kind: str
    severity: str
    sentence: str
    where: str = ""
    since: float | None = None
    callers: tuple[str, ...] = ()
    # the alert whose condition this is, and whether it pages (its severity is critical)
    alert: str = ""
    pages: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.where


@dataclass(frozen=True)
class PairView:
    """One (caller, model) pair over the alerts' windows: what the caller rules record."""

    model: str
    ratio_window: float | None  # caller_model:vllm_cache_hit_ratio:rate5m
    ratio_long: float | None  # caller_model:vllm_cache_hit_ratio:rate1h
    baseline: float | None  # caller_model:vllm_cache_hit_ratio:p90_1d_rate1h
    warm_share_window: float | None  # caller_model:vllm_cache_warm_request_share:rate5m
    prompt_tokens_per_second: float | None  # caller_model:vllm_cache_prompt_tokens:rate5m
    collapse: advice.Collapse | None
    # seconds of its model's prefill the cache saved it, and evictions cost it, over the long
    # window (signals/prefill.py): caller_model:vllm_cache_prefill_seconds_saved:rate1h and
    # ..._lost:rate1h times the window. None without a measured prefill rate; lost None too
    # for a caller without its own miss counters (its misses are __other__'s).
    prefill_seconds_saved: float | None = None
    prefill_seconds_lost: float | None = None


@dataclass(frozen=True)
class CallerView:
    caller: str
    models: tuple[str, ...]
    first_seen: float
    requests: dict[str, int]
    prompt_tokens: int
    cached_tokens: int
    unreported_prompt_tokens: int
    # over all of its models: the short and long windows, and since the exporter started
    ratio_window: float | None
    ratio_long: float | None
    ratio_total: float | None
    warm_share_window: float | None
    # median TTFT of warm and cold turns since the exporter started, and whose it is
    # (signals/timing.py: vLLM's own where it timed any, else the proxy's)
    ttft_warm_p50: float | None
    ttft_cold_p50: float | None
    ttft_source: str | None
    # mean TTFT of the warm and cold turns over the window, and whose it is (chosen alike,
    # over the window's turns)
    ttft_window_mean: float | None
    ttft_window_source: str | None
    # the hit ratio over the short window ending at each slot of the long window
    sparkline: tuple[float | None, ...]
    pairs: tuple[PairView, ...]

    @property
    def collapse(self) -> advice.Collapse | None:
        """The first of its pairs whose cache collapsed, if any."""
        return next((pair.collapse for pair in self.pairs if pair.collapse is not None), None)

    @property
    def baseline(self) -> float | None:
        """Its baseline, when it has one model (a baseline is per pair)."""
        return self.pairs[0].baseline if len(self.pairs) == 1 else None


@dataclass(frozen=True)
class RowView:
    model_name: str
    engine: str
    prefix_caching: bool | None
    block_size: int | None
    pool_tokens: int | None
    smallest_pool_tokens: int | None
    budget_tokens: int | None
    kv_used_tokens: int | None
    kv_ratio: float | None
    running: float | None
    waiting: float | None
    pool_sentence: str


@dataclass(frozen=True)
class FitView:
    model_name: str
    fit: advice.Fit
    sentence: str


@dataclass(frozen=True)
class EngineView:
    target: str
    state: str  # up, down, not read yet
    error: str
    rows: tuple[RowView, ...]
    fits: tuple[FitView, ...]
    ratio_window: float | None
    ratio_long: float | None
    baseline: float | None
    preemptions: float
    preemptions_window: float
    sparkline: tuple[float | None, ...]


@dataclass(frozen=True)
class Status:
    now: float
    window_seconds: float
    long_seconds: float = 3600.0
    baseline_seconds: float = 86_400.0
    problems: list[Item] = field(default_factory=list)
    advice: list[Item] = field(default_factory=list)
    engines: list[EngineView] = field(default_factory=list)
    callers: list[CallerView] = field(default_factory=list)
    # Named callers not shown (outside --callers.detailed and --callers.allow): Prometheus
    # has every caller's ratio; the page keeps a history for the detailed ones.
    callers_not_shown: int = 0

    def problem(self, kind: str) -> Item | None:
        return next((item for item in self.problems if item.kind == kind), None)

    def as_json(self) -> dict[str, object]:
        """The model as GET /api/v1/status serves it (``check --exporter.url`` reads it):
        every figure the page shows, sparklines left out. Plain types only."""
        data = dataclasses.asdict(self)
        for view in (*data["engines"], *data["callers"]):
            view.pop("sparkline", None)
        data["paging"] = [item.alert for item in self.problems if item.pages]
        return data


def ratio(cached: float, prompt: float) -> float | None:
    return cached / prompt if prompt > 0 else None


class Slots:
    """One key's totals at every slot boundary of the long window and now, read in one pass;
    every window is read from them, to the slot: "the last 5 minutes" starts at the boundary
    of the tenth slot back (270 to 300 s ago), "the last hour" at the oldest one."""

    def __init__(
        self, timeline: Timeline | None, current: Sequence[float], now: float, windows: Windows
    ) -> None:
        self.now = now
        self.starts = slot_starts(now, windows.samples - 1, windows.slot_seconds)
        self.values = at_times(timeline, current, [*self.starts, now])
        self.window_slots = SHORT_SLOTS

    @classmethod
    def summed(cls, parts: Sequence[Slots]) -> Slots:
        """The totals of several keys added up (a caller over its models)."""
        first = parts[0]
        total = object.__new__(cls)
        total.now, total.starts, total.window_slots = first.now, first.starts, first.window_slots
        total.values = []
        for index, head in enumerate(first.values):
            row = [head[0], *([0.0] * (len(head) - 1))]
            for part in parts:
                for column, value in enumerate(part.values[index][1:], start=1):
                    row[column] += value
            total.values.append(row)
        return total

    def grew(self, slot: int, field: int) -> float:
        return self.values[slot + 1][field] - self.values[slot][field]

    def window(self, field: int, back: int = 0) -> float:
        """Growth over the short window that ends now (``back`` windows earlier)."""
        end = -1 - back * self.window_slots
        return self.values[end][field] - self.values[end - self.window_slots][field]

    def window_seconds(self, back: int = 0) -> float:
        """How long that window is, as read: from its first boundary to its end."""
        end = self.now if back == 0 else self.starts[-back * self.window_slots]
        return end - self.starts[-(back + 1) * self.window_slots]

    def long(self, field: int) -> float:
        return self.values[-1][field] - self.values[0][field]

    @property
    def window_start(self) -> float:
        return self.starts[-self.window_slots]

    def ratios(self, prompt: int, cached: int) -> tuple[float | None, ...]:
        """The hit ratio over the window ending with each slot (None where nothing was looked
        up): the "hit ratio now" of every moment of the long window."""
        values = self.values
        out = []
        for end in range(1, len(values)):
            start = max(0, end - self.window_slots)
            out.append(
                ratio(
                    values[end][cached] - values[start][cached],
                    values[end][prompt] - values[start][prompt],
                )
            )
        return tuple(out)


def build(engine: EngineState, usage: UsageState, now: float, rule: CollapseRule) -> Status:
    """Everything the page shows, as of ``now`` (call ``usage.catch_up(now)`` first, so that
    the history holds the last boundary)."""
    windows = usage.history.windows
    named = {caller for caller, _model in usage.series}
    shown = {caller for (caller, _model), _series in usage.tracked_series()}
    status = Status(
        now,
        windows.short_seconds,
        windows.long_seconds,
        windows.baseline_seconds,
        callers_not_shown=len(named - shown),
    )
    caching_off = _engines(status, engine, usage, now, rule)
    _callers(status, usage, now, rule, all_caching_off=caching_off)
    if status.problem("collapse") is not None:  # the callers' collapse says it, and who
        status.problems[:] = [item for item in status.problems if item.kind != "engine_collapse"]
    _unattributed(status, engine, usage, now)
    _completions(status, usage)
    _prompt_order(status, usage, now)
    order = {
        "unreadable": 0,
        "collapse": 1,
        "engine_collapse": 2,
        "overflow": 3,
        "caching_off": 4,
        "not_reported": 5,
        "preemptions": 6,
        "absent": 7,
    }
    status.problems.sort(key=lambda item: order.get(item.kind, 99))
    return status


# ---- engines --------------------------------------------------------------------------------


def _engines(
    status: Status, engine: EngineState, usage: UsageState, now: float, rule: CollapseRule
) -> bool:
    """Fill the engine views and their problems; True when every engine read has prefix
    caching off (then a collapse says nothing new: there never was a cache)."""
    headroom = usage.conversations.settings.admission_headroom_tokens
    fits = foresight.by_target(usage.conversations, engine, now)
    idle = usage.conversations.idle_seconds
    caching: list[bool] = []
    target_totals = usage.target_totals()
    for target in sorted(engine.targets.values(), key=lambda target: target.shown):
        current = [now, *target_totals.get(target.shown, [0.0, 0.0, 0.0])]
        rows = tuple(_row(target, row_index, headroom) for row_index in range(len(target.rows)))
        caching.extend(row.prefix_caching for row in rows if row.prefix_caching is not None)
        target_fits = []
        for (where, model_name), demand in sorted(fits.items()):
            if where != target.shown:
                continue
            pool = sum(row.pool_tokens or 0 for row in rows if row.model_name == model_name)
            if not pool:
                continue
            fit = advice.Fit(demand.conversations, demand.tokens, pool, headroom)
            sentence = f"{target.shown} ({model_name}): {advice.fit_sentence(fit, idle)}"
            target_fits.append(FitView(model_name, fit, sentence))
            if fit.overflows:
                status.problems.append(
                    Item("overflow", PROBLEM, sentence, f"{target.shown} {model_name}")
                )
        timeline = usage.history.target(target.shown)
        slots = Slots(timeline, current, now, usage.history.windows)
        queries, hits = TARGET_FIELD["queries"], TARGET_FIELD["hits"]
        view = EngineView(
            target.shown,
            _target_state(target),
            target.last_error,
            rows,
            tuple(target_fits),
            ratio(slots.window(hits), slots.window(queries)),
            ratio(slots.long(hits), slots.long(queries)),
            usage.history.baseline(timeline, now, BASELINE_QUANTILE),
            current[TARGET_FIELD["preemptions"]],
            slots.window(TARGET_FIELD["preemptions"]),
            slots.ratios(queries, hits),
        )
        status.engines.append(view)
        _engine_problems(status, target, view, slots, rule)
    return bool(caching) and not any(caching)


def _target_state(target: TargetState) -> str:
    if target.up:
        return "up"
    return "down" if target.attempted else "not read yet"


def _engine_problems(
    status: Status, target: TargetState, view: EngineView, slots: Slots, rule: CollapseRule
) -> None:
    where = target.shown
    if target.attempted and not target.up:
        status.problems.append(
            Item(
                "unreadable",
                PROBLEM,
                advice.unreadable_sentence(where, target.last_error or "no answer"),
                where,
            )
        )
        return
    for row in view.rows:
        if row.prefix_caching is False:
            label = f"{where} ({row.model_name or 'no model_name'}, engine {row.engine or '-'})"
            status.problems.append(
                Item("caching_off", PROBLEM, advice.prefix_caching_off_sentence(label), label)
            )
    if view.preemptions_window > 0:
        status.problems.append(
            Item(
                "preemptions",
                PROBLEM,
                advice.preemptions_sentence(
                    where,
                    view.preemptions_window,
                    f"in the last {advice.duration(rule.window_seconds)}",
                ),
                where,
            )
        )
    if target.up:
        for signal in REQUIRED_SIGNALS:
            if not target.present.get(signal):
                status.problems.append(
                    Item(
                        "absent",
                        PROBLEM,
                        advice.absent_sentence(f"vLLM {where}", signal),
                        f"{where} {signal}",
                    )
                )
    queries, hits = TARGET_FIELD["queries"], TARGET_FIELD["hits"]
    if view.baseline is not None and collapsed(
        slots, rule, queries, hits, view.baseline, rule.engine_min_tokens_per_second
    ):
        status.problems.append(
            Item(
                "engine_collapse",
                PROBLEM,
                advice.engine_collapse_sentence(
                    where,
                    view.ratio_window or 0.0,
                    view.baseline,
                    status.window_seconds,
                    status.baseline_seconds,
                ),
                where,
                _since(slots, rule, queries, hits, view.baseline),
                alert=COLLAPSE_ALERT,
                pages=rule.pages,
            )
        )


def _row(target: TargetState, index: int, headroom: int) -> RowView:
    row = target.rows[index]
    config = row.cache_config
    pool = config.pool_tokens if config is not None else None
    usage_ratio = row.gauges.get(KV_CACHE_USAGE)
    smallest = target.smallest_pool.get(row.engine)
    budget = foresight.admission_budget(smallest, headroom) if smallest else None
    sentence = ""
    if pool and smallest and budget is not None:
        sentence = advice.pool_sentence(
            pool, min(pool, smallest), "by the exporter since it started", headroom, budget
        )
    return RowView(
        row.model_name,
        row.engine,
        config.enable_prefix_caching if config else None,
        config.block_size if config else None,
        pool,
        smallest,
        budget,
        round(usage_ratio * pool) if usage_ratio is not None and pool else None,
        usage_ratio,
        row.gauges.get(REQUESTS_RUNNING),
        row.gauges.get(REQUESTS_WAITING),
        sentence,
    )


# ---- callers --------------------------------------------------------------------------------


def _callers(
    status: Status, usage: UsageState, now: float, rule: CollapseRule, all_caching_off: bool
) -> None:
    totals = usage.pair_totals()
    first_seen = usage.first_seen()
    pairs: dict[str, list[tuple[str, str]]] = {}
    for pair in sorted(totals):
        if pair[0] == OTHER and not any(totals[pair][FIELD[state] - 1] for state in STATES):
            continue  # only the costly families of callers outside the detailed set
        pairs.setdefault(pair[0], []).append(pair)
    medians = _ttft_medians(usage)
    rates = _prefill_rates(usage, now)
    prompt, cached = FIELD["prompt_tokens"], FIELD["cached_tokens"]
    unreported: list[str] = []
    collapses: list[advice.Collapse] = []
    for caller, keys in pairs.items():
        views, parts = [], []
        for key in keys:
            timeline = usage.history.caller(key)
            slots = Slots(timeline, [now, *totals[key]], now, usage.history.windows)
            parts.append(slots)
            view = _pair(key, slots, usage, status, rule, all_caching_off, rates.get(key[1]))
            views.append(view)
            if view.collapse is not None:
                collapses.append(view.collapse)
        slots = parts[0] if len(parts) == 1 else Slots.summed(parts)
        current = slots.values[-1]
        window_source, window_mean = _window_ttft(slots)
        caller_medians = medians.get(caller, timing.Medians(None, None, None))
        if slots.long(FIELD["unreported_prompt_tokens"]) > 0:
            unreported.append(caller)
        status.callers.append(
            CallerView(
                caller,
                tuple(model for _caller, model in keys),
                min(first_seen.get(key, now) for key in keys),
                {state: int(current[FIELD[state]]) for state in STATES},
                int(current[prompt]),
                int(current[cached]),
                int(current[FIELD["unreported_prompt_tokens"]]),
                ratio(slots.window(cached), slots.window(prompt)),
                ratio(slots.long(cached), slots.long(prompt)),
                ratio(current[cached], current[prompt]),
                _warm_share(slots),
                caller_medians.warm,
                caller_medians.cold,
                caller_medians.source,
                window_mean,
                window_source,
                slots.ratios(prompt, cached),
                tuple(views),
            )
        )
    if collapses:
        status.problems.append(
            Item(
                "collapse",
                PROBLEM,
                advice.collapse_sentence(collapses),
                "callers",
                min(collapse.since for collapse in collapses),
                tuple(dict.fromkeys(collapse.caller for collapse in collapses)),
                alert=COLLAPSE_ALERT,
                pages=rule.pages,
            )
        )
    if unreported:
        status.problems.append(
            Item(
                "not_reported",
                PROBLEM,
                advice.not_reported_sentence(unreported),
                "callers",
                callers=tuple(unreported),
            )
        )


def _pair(
    key: tuple[str, str],
    slots: Slots,
    usage: UsageState,
    status: Status,
    rule: CollapseRule,
    all_caching_off: bool,
    prefill_rate: float | None = None,
) -> PairView:
    """One pair's figures over the alerts' windows, and its collapse when the alert's
    condition holds (never where every engine has prefix caching off: there was no cache)."""
    prompt, cached = FIELD["prompt_tokens"], FIELD["cached_tokens"]
    baseline = usage.history.baseline(usage.history.caller(key), status.now, BASELINE_QUANTILE)
    ratio_now = ratio(slots.window(cached), slots.window(prompt))
    collapse = None
    if (
        not all_caching_off
        and baseline is not None
        and collapsed(slots, rule, prompt, cached, baseline, rule.caller_min_tokens_per_second)
    ):
        collapse = advice.Collapse(
            key[0],
            key[1],
            _since(slots, rule, prompt, cached, baseline),
            status.window_seconds,
            ratio_now or 0.0,
            baseline,
            status.baseline_seconds,
        )
    seconds = slots.window_seconds()
    series = usage.series.get(key)
    has_misses = series is not None and series.miss is not None
    return PairView(
        key[1],
        ratio_now,
        ratio(slots.long(cached), slots.long(prompt)),
        baseline,
        _warm_share(slots),
        slots.window(prompt) / seconds if seconds > 0 else None,
        collapse,
        prefill.seconds(slots.long(cached), prefill_rate),
        prefill.seconds(slots.long(FIELD["evicted_tokens"]), prefill_rate) if has_misses else None,
    )


def _prefill_rates(usage: UsageState, now: float) -> dict[str, float | None]:
    """Each model_name's measured prefill rate over the long window (``prefill.rate``), read
    from the history at the same slot boundaries as the pairs' long-window figures. A pair's
    model label matches the model_name as the rules join them: the same string."""
    rates: dict[str, float | None] = {}
    for model_name, totals in usage.model_totals().items():
        slots = Slots(usage.history.model(model_name), [now, *totals], now, usage.history.windows)
        rates[model_name] = prefill.rate(
            slots.long(MODEL_FIELD["computed_prompt_tokens"]),
            slots.long(MODEL_FIELD["prefill_seconds"]),
        )
    return rates


def _warm_share(slots: Slots) -> float | None:
    """Warm turns among the classified ones (warm, partial, cold) over the short window."""
    classified = sum(slots.window(FIELD[state]) for state in ("warm", "partial", "cold"))
    return slots.window(FIELD["warm"]) / classified if classified > 0 else None


def _ttft_medians(usage: UsageState) -> dict[str, timing.Medians]:
    """caller -> its median TTFT of warm and cold turns since the exporter started, over all
    of its models, vLLM's own where it timed any, else the proxy's (``timing.medians``)."""
    buckets: dict[str, dict[tuple[str, str], list[tuple[float, float]]]] = {}
    for (caller, _model), series in usage.series.items():
        mine = buckets.setdefault(caller, {})
        for source, timed in ((ENGINE, series.engine_ttft), (PROXY, series.ttft)):
            for state, hist in timed.items():
                timing.add(mine, (state, source), timing.cumulative(hist.bounds, hist.counts))
    return {caller: timing.medians(mine) for caller, mine in buckets.items()}


def _window_ttft(slots: Slots) -> tuple[str | None, float | None]:
    """(source, mean TTFT) of the warm and cold turns over the window, from the source
    ``timing.pick`` chooses over the window's turns."""
    totals = {}
    for measured_by in (ENGINE, PROXY):
        count = slots.window(FIELD[f"ttft_{measured_by}_warm_count"]) + slots.window(
            FIELD[f"ttft_{measured_by}_cold_count"]
        )
        total = slots.window(FIELD[f"ttft_{measured_by}_warm_sum"]) + slots.window(
            FIELD[f"ttft_{measured_by}_cold_sum"]
        )
        totals[measured_by] = (count, total)
    source = timing.pick({key: count for key, (count, _total) in totals.items()})
    if source is None:
        return None, None
    count, total = totals[source]
    return source, total / count


def collapsed(
    slots: Slots,
    rule: CollapseRule,
    prompt: int,
    cached: int,
    baseline: float,
    min_tokens_per_second: float,
) -> bool:
    """The VllmCachePrefixCollapse alert's condition (exporter/monitoring/alerts.py): the
    ratio over the short window under ``drop_factor`` times the baseline, the baseline above
    ``min_baseline``, and prompt traffic above the floor over this short window and the one
    before it (a collapse happens while traffic continues)."""
    if baseline <= rule.min_baseline:
        return False
    for back in (0, 1):
        seconds = slots.window_seconds(back)
        if seconds <= 0 or slots.window(prompt, back) / seconds <= min_tokens_per_second:
            return False
    now_ratio = slots.window(cached) / slots.window(prompt)
    return now_ratio < rule.drop_factor * baseline


def _since(slots: Slots, rule: CollapseRule, prompt: int, cached: int, baseline: float) -> float:
    """The start of the earliest slot of the unbroken run of slots under the bar that ends
    now (a slot without traffic neither breaks nor extends the run)."""
    since = slots.window_start
    for slot in range(len(slots.starts) - 1, -1, -1):
        slot_ratio = ratio(slots.grew(slot, cached), slots.grew(slot, prompt))
        if slot_ratio is None:
            continue
        if slot_ratio >= rule.drop_factor * baseline:
            break
        since = slots.starts[slot]
    return since


# ---- foresight the engines cannot take --------------------------------------------------------


def _unattributed(status: Status, engine: EngineState, usage: UsageState, now: float) -> None:
    """Models whose live conversations no single vLLM's pool can be named for."""
    served = foresight.served_models(engine)
    tracker = usage.conversations
    labels = {
        conversation.model
        for conversation in tracker.active(now)
        if foresight.attribute(conversation.model_name, served) is None
    }
    live = foresight.live_demand(tracker, engine, now)
    for model, demand in sorted(tracker.by_model(now, live).items()):
        if model in labels and demand.conversations:
            status.advice.append(
                Item(
                    "unattributed",
                    ADVICE,
                    advice.unattributed_sentence(model, demand.conversations, demand.tokens),
                    model,
                )
            )


def _completions(status: Status, usage: UsageState) -> None:
    """Declared against used completion tokens per pair, from exact sums and counts; the
    charge bounded by the largest used and declared (``advice.completions``)."""
    for (caller, model), series in sorted(usage.costly.items()):
        hist = series.completion
        if hist is None:
            continue
        cumulative, running = [], 0
        for bound, count in zip((*hist.bounds, float("inf")), hist.counts, strict=True):
            running += count
            cumulative.append((bound, float(running)))
        figures = advice.completions(
            caller,
            model,
            cumulative,
            hist.total,
            series.declared_completion_tokens,
            series.completion_largest,
            series.declared_largest,
        )
        if figures is not None and figures.overstatement >= advice.OVERSTATEMENT_WORTH_SAYING:
            status.advice.append(
                Item(
                    "completions",
                    ADVICE,
                    advice.completion_sentence(figures),
                    f"{caller} {model}",
                    callers=(caller,),
                )
            )


def _prompt_order(status: Status, usage: UsageState, now: float) -> None:
    """Callers whose recent requests share text but not its beginning (the tap's prints):
    said while the latest such request is within the prompt-order window."""
    recent = now - usage.order.window_seconds
    for (caller, model), series in sorted(usage.costly.items()):
        counts = series.order
        if counts is None or counts.last_variable_top is None:
            continue
        if counts.last_variable_top < recent or counts.variable_top <= 0:
            continue
        figures = advice.PromptOrder(
            caller,
            model,
            counts.compared,
            counts.variable_top,
            counts.shared_bytes / counts.variable_top,
            counts.first_difference_bytes / counts.variable_top,
        )
        if figures.worth_saying:
            status.advice.append(
                Item(
                    "prompt_order",
                    ADVICE,
                    advice.prompt_order_sentence(figures),
                    f"{caller} {model}",
                    counts.last_variable_top,
                    callers=(caller,),
                )
            )
