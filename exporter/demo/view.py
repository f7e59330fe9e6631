"""The demo's live view, computed from the exporter's own /metrics.

It parses exactly what Prometheus would scrape (prometheus_client's parser), so the numbers
on screen are the exporter's numbers, not the simulator's. The hit ratio now, the warm share
and the baseline are the status page's (``signals.status``, the alerts' windows and baseline
read from the exporter's history), handed in with its problems, so the table, the story, the
page and ``check`` say the same figure at the same moment; the ratio since start is read here
from the counters; TTFT p50 is interpolated from the exporter's histogram buckets the way
``histogram_quantile`` does, since start per state and over the window for all turns. Every
time here is scenario time (the window too), like the TTFTs the simulator reports. What is
wrong is not computed here: the demo hands in the status page's problems, in its words.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from exporter.engine.parse import Samples
from exporter.monitoring.config import MonitoringConfig
from exporter.signals import advice, prefill
from exporter.signals.status import CallerView, Status

STATES = ("warm", "partial", "cold", "short", "unknown", "error")


@dataclass
class CallerStats:
    requests: dict[str, float] = field(default_factory=dict)  # by state
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    unreported_tokens: float = 0.0
    # (state, source) -> le -> count; source is who measured it, vLLM ("engine") or the
    # proxy ("proxy"): never added up, the engine's is shown where there is one.
    ttft_buckets: dict[tuple[str, str], dict[float, float]] = field(default_factory=dict)

    def ttft_p50(self, state: str) -> float | None:
        engine = self.ttft_buckets.get((state, "engine"), {})
        if engine and max(engine.values()) > 0:
            return quantile(0.5, engine)
        return quantile(0.5, self.ttft_buckets.get((state, "proxy"), {}))

    @property
    def total(self) -> float:
        return sum(self.requests.values())


@dataclass
class Snapshot:
    """One scrape of the exporter, reduced to what the view shows."""

    time: float
    callers: dict[str, CallerStats] = field(default_factory=dict)
    engine_up: bool | None = None
    prefix_caching: bool | None = None
    kv_used_tokens: float | None = None
    kv_pool_tokens: float | None = None
    preemptions: float = 0.0
    running: float | None = None
    waiting: float | None = None
    engine_queries: float = 0.0
    engine_hits: float = 0.0
    # KV residency (vLLM with --kv-cache-metrics): sampled evictions, their idle and life time
    evicted: float | None = None
    evicted_idle_seconds: float = 0.0
    evicted_lifetime_seconds: float = 0.0


RESIDENCY = {
    "vllm_cache_engine_kv_block_idle_before_evict_seconds_count": "evicted",
    "vllm_cache_engine_kv_block_idle_before_evict_seconds_sum": "evicted_idle_seconds",
    "vllm_cache_engine_kv_block_lifetime_seconds_sum": "evicted_lifetime_seconds",
}
# The evicted blocks sat idle for more than this share of their life, over at least
# EVICTED_UNUSED_MIN_SAMPLES of them: evicted before any turn came back to them.
EVICTED_UNUSED_SHARE = 0.8
EVICTED_UNUSED_MIN_SAMPLES = 10


def parse_snapshot(text: str, time: float) -> Snapshot:
    snap = Snapshot(time)
    for name, labels, value in Samples(text):
        caller = labels.get("caller")
        if caller is not None:
            _caller_sample(snap.callers.setdefault(caller, CallerStats()), name, labels, value)
        else:
            _engine_sample(snap, name, value)
    return snap


def _caller_sample(stats: CallerStats, name: str, labels: dict[str, str], value: float) -> None:
    if name == "vllm_cache_requests_total":
        state = labels.get("state", "")
        stats.requests[state] = stats.requests.get(state, 0.0) + value
    elif name == "vllm_cache_prompt_tokens_total":
        stats.prompt_tokens += value
    elif name == "vllm_cache_cached_tokens_total":
        stats.cached_tokens += value
    elif name == "vllm_cache_unreported_prompt_tokens_total":
        stats.unreported_tokens += value
    elif name == "vllm_cache_ttft_seconds_bucket":
        buckets = stats.ttft_buckets.setdefault(
            (labels.get("state", ""), labels.get("source", "proxy")), {}
        )
        bound = float(labels["le"])
        buckets[bound] = buckets.get(bound, 0.0) + value


# Engine series summed over the engines into the snapshot attribute of the same meaning.
_ENGINE_SUMS = {
    "vllm_cache_engine_kv_used_tokens": "kv_used_tokens",
    "vllm_cache_engine_kv_pool_tokens": "kv_pool_tokens",
    "vllm_cache_engine_preemptions_total": "preemptions",
    "vllm_cache_engine_requests_running": "running",
    "vllm_cache_engine_requests_waiting": "waiting",
    "vllm_cache_engine_prefix_cache_queries_tokens_total": "engine_queries",
    "vllm_cache_engine_prefix_cache_hits_tokens_total": "engine_hits",
}
# Engine gauges that hold only if they hold on every engine.
_ENGINE_ALL = {
    "vllm_cache_engine_up": "engine_up",
    "vllm_cache_engine_prefix_caching_enabled": "prefix_caching",
}


def _engine_sample(snap: Snapshot, name: str, value: float) -> None:
    attribute = _ENGINE_SUMS.get(name) or RESIDENCY.get(name)
    if attribute is not None:
        setattr(snap, attribute, (getattr(snap, attribute) or 0.0) + value)
        return
    attribute = _ENGINE_ALL.get(name)
    if attribute is not None:
        held = getattr(snap, attribute)
        setattr(snap, attribute, bool(value) if held is None else held and bool(value))


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """``histogram_quantile`` over cumulative buckets {le: count}; None without observations."""
    value = advice.histogram_quantile(q, list(buckets.items()))
    return None if math.isnan(value) else value


def ratio(cached: float, prompt: float) -> float | None:
    return cached / prompt if prompt > 0 else None


@dataclass(frozen=True)
class CallerRow:
    caller: str
    requests: int
    ratio_window: float | None  # the status page's, over the alerts' short window
    ratio_total: float | None
    baseline: float | None  # the status page's (one model: the pair's baseline)
    warm: int
    partial: int
    cold: int
    other: int  # unknown (cached tokens not reported), short, error
    ttft_warm_p50: float | None
    ttft_cold_p50: float | None
    ttft_window_p50: float | None  # every timed turn over the window
    # the status page's prefill seconds saved and lost to evictions over the long window
    # (one model: the pair's; signals/prefill.py)
    prefill_saved: float | None = None
    prefill_lost: float | None = None


@dataclass(frozen=True)
class Summary:
    rows: list[CallerRow]
    engine_up: bool | None
    prefix_caching: bool | None
    kv_used_tokens: float | None
    kv_pool_tokens: float | None
    preemptions: int
    preemptions_window: int
    running: float | None
    waiting: float | None
    engine_ratio_window: float | None
    warnings: list[str]
    evicted_window: int | None = None  # sampled blocks; None: vLLM without --kv-cache-metrics
    evicted_idle_share_window: float | None = None


class DemoView:
    """Keeps a window of snapshots and turns them into a Summary, a rich view or plain text."""

    def __init__(self, title: str, page_url: str, window_seconds: float = 300.0) -> None:
        self.title = title
        self.page_url = page_url
        self.window_seconds = window_seconds  # scenario seconds
        self.history: deque[Snapshot] = deque()
        self.scenario_seconds = 0.0
        self.error: str | None = None
        self.problems: list[str] = []
        self.status: Status | None = None

    def update(
        self,
        text: str,
        scenario_seconds: float,
        problems: list[str] | None = None,
        status: Status | None = None,
    ) -> Summary:
        """One scrape of the exporter, at ``scenario_seconds``; ``problems``: what the status
        page says is wrong at the same moment, and ``status`` its model (the figures over the
        alerts' windows)."""
        self.history.append(parse_snapshot(text, scenario_seconds))
        while (
            len(self.history) > 2 and self.history[1].time <= scenario_seconds - self.window_seconds
        ):
            self.history.popleft()
        self.scenario_seconds = scenario_seconds
        self.error = None
        self.problems = list(problems or [])
        self.status = status
        return self.summary()

    def summary(self) -> Summary:
        if not self.history:
            return Summary(
                [],
                None,
                None,
                None,
                None,
                0,
                0,
                None,
                None,
                None,
                ["waiting for the first scrape of the exporter"],
            )
        now, first = self.history[-1], self.history[0]
        rows = []
        shown = {view.caller: view for view in self.status.callers} if self.status else {}
        for caller in sorted(now.callers):
            stats = now.callers[caller]
            before = first.callers.get(caller, CallerStats())
            page = shown.get(caller)
            requests = stats.requests
            other = sum(requests.get(state, 0.0) for state in ("short", "unknown", "error"))
            rows.append(
                CallerRow(
                    caller,
                    int(stats.total),
                    page.ratio_window if page else None,
                    ratio(stats.cached_tokens, stats.prompt_tokens),
                    page.baseline if page else None,
                    int(requests.get("warm", 0)),
                    int(requests.get("partial", 0)),
                    int(requests.get("cold", 0)),
                    int(other),
                    stats.ttft_p50("warm"),
                    stats.ttft_p50("cold"),
                    _window_ttft_p50(stats, before),
                    *_prefill(page),
                )
            )
        evicted = None if now.evicted is None else int(now.evicted - (first.evicted or 0.0))
        idle_share = ratio(
            now.evicted_idle_seconds - first.evicted_idle_seconds,
            now.evicted_lifetime_seconds - first.evicted_lifetime_seconds,
        )
        return Summary(
            rows,
            now.engine_up,
            now.prefix_caching,
            now.kv_used_tokens,
            now.kv_pool_tokens,
            int(now.preemptions),
            int(now.preemptions - first.preemptions),
            now.running,
            now.waiting,
            self.status.engines[0].ratio_window if self.status and self.status.engines else None,
            self._warnings(now, evicted, idle_share),
            evicted,
            idle_share,
        )

    def _warnings(self, now: Snapshot, evicted: int | None, idle_share: float | None) -> list[str]:
        warnings = []
        if self.error:
            warnings.append(self.error)
        if now.engine_up is False:
            warnings.append("vLLM's /metrics cannot be read: engine series are missing")
        warnings.extend(self.problems)
        # vLLM's sampled residency (--kv-cache-metrics): seen from inside the engine, which
        # the status page's problems (from the usage and the pool) do not read.
        if (
            evicted is not None
            and evicted >= EVICTED_UNUSED_MIN_SAMPLES
            and idle_share is not None
            and idle_share > EVICTED_UNUSED_SHARE
        ):
            warnings.append(
                "KV blocks are evicted before any turn comes back to them: the "
                "conversations no longer fit the KV pool together"
            )
        return warnings

    # ---- rendering ---------------------------------------------------------------------

    def render_plain(self, summary: Summary | None = None) -> str:
        summary = summary or self.summary()
        lines = [f"[{_clock(self.scenario_seconds)} scenario time] {self.title}"]
        window = _window(self.window_seconds)
        long = advice.duration(self.status.long_seconds) if self.status else "-"
        for row in summary.rows:
            lines.append(
                f"  {row.caller}: {row.requests} req, hit ratio {_pct(row.ratio_window)} over "
                f"the last {window} (baseline {_pct(row.baseline)}, since start "
                f"{_pct(row.ratio_total)}), warm/partial/cold "
                f"{row.warm}/{row.partial}/{row.cold}, TTFT p50 {_secs(row.ttft_window_p50)} "
                f"over the last {window} (since start: warm {_secs(row.ttft_warm_p50)}, cold "
                f"{_secs(row.ttft_cold_p50)})"
                + (
                    f", prefill saved {prefill.minutes(row.prefill_saved)} / lost to "
                    f"evictions {prefill.minutes(row.prefill_lost)} over the last {long}"
                    if row.prefill_saved is not None
                    else ""
                )
            )
        lines.append(
            f"  engine: KV {_tokens(summary.kv_used_tokens)}/{_tokens(summary.kv_pool_tokens)}"
            f" tokens, preemptions {summary.preemptions}, prefix caching "
            f"{_onoff(summary.prefix_caching)}, running {_num(summary.running)}, waiting "
            f"{_num(summary.waiting)}"
            + (
                f", evicted blocks {_evictions(summary)}"
                if summary.evicted_window is not None
                else ""
            )
        )
        lines.extend(f"  ! {warning}" for warning in summary.warnings)
        return "\n".join(lines)

    def render(self, summary: Summary | None = None) -> RenderableType:
        summary = summary or self.summary()
        window = _window(self.window_seconds)
        table = Table(
            box=box.SIMPLE_HEAD,
            padding=(0, 1),
            title=f"Per caller, from /metrics (now: the last {window}; TTFT p50, "
            "warm and cold since start; prefill saved/lost to evictions over the long "
            "window, the status page's; scenario time)",
            title_justify="left",
        )
        table.add_column("caller", no_wrap=True, overflow="ellipsis", min_width=8)
        for column, width in (
            ("req", 4),
            ("hit now", 7),
            ("base", 5),
            ("hit all", 7),
            ("w/p/c/u", 7),
            ("TTFT now", 8),
            ("warm", 5),
            ("cold", 5),
            ("saved/lost", 10),
        ):
            table.add_column(column, justify="right", no_wrap=True, min_width=width)
        for row in summary.rows:
            states = Text()
            states.append(str(row.warm), style="green")
            states.append("/")
            states.append(str(row.partial), style="yellow")
            states.append("/")
            states.append(str(row.cold), style="red")
            states.append(f"/{row.other}")
            table.add_row(
                row.caller,
                str(row.requests),
                _ratio_text(row.ratio_window),
                _pct(row.baseline),
                _pct(row.ratio_total),
                states,
                _secs(row.ttft_window_p50),
                _secs(row.ttft_warm_p50),
                _secs(row.ttft_cold_p50),
                f"{prefill.minutes(row.prefill_saved)}/{prefill.minutes(row.prefill_lost)}",
            )
        if not summary.rows:
            table.add_row("(no requests yet)", "", "", "", "", "", "", "", "", "")
        engine = Text()
        engine.append("KV used/pool ")
        engine.append(
            f"{_tokens(summary.kv_used_tokens)} / {_tokens(summary.kv_pool_tokens)} tokens",
            style="bold",
        )
        engine.append("   preemptions ")
        engine.append(
            str(summary.preemptions), style="bold red" if summary.preemptions_window else "bold"
        )
        engine.append("   prefix caching ")
        engine.append(
            _onoff(summary.prefix_caching),
            style="bold green" if summary.prefix_caching else "bold red",
        )
        engine.append(
            f"\nrunning {_num(summary.running)}, waiting {_num(summary.waiting)}"
            "   engine hit ratio (window) "
        )
        engine.append_text(_ratio_text(summary.engine_ratio_window))
        if summary.evicted_window is not None:
            engine.append(f"\nKV blocks evicted (window, sampled) {_evictions(summary)}")
        parts: list[RenderableType] = [
            Text(f"{self.title}    scenario time {_clock(self.scenario_seconds)}", style="bold"),
            Text(f"Status page: {self.page_url}", style="cyan"),
            table,
            Panel(engine, title="vLLM engine", title_align="left"),
        ]
        for warning in summary.warnings:
            parts.append(Text(f"! {warning}", style="bold yellow"))
        parts.append(Text("Ctrl-C to stop", style="dim"))
        return Group(*parts)


def _prefill(page: CallerView | None) -> tuple[float | None, float | None]:
    """The page's prefill seconds saved and lost of a caller on one model (a figure is per
    pair), else none."""
    if page is None or len(page.pairs) != 1:
        return None, None
    return page.pairs[0].prefill_seconds_saved, page.pairs[0].prefill_seconds_lost


def _evictions(summary: Summary) -> str:
    """ "12 (idle 93.0% of their life)": vLLM's sampled KV residency over the window."""
    idle = summary.evicted_idle_share_window
    share = f" (idle {_pct(idle)} of their life)" if idle is not None else ""
    return f"{summary.evicted_window}{share}"


def _window_ttft_p50(now: CallerStats, before: CallerStats) -> float | None:
    """The median TTFT of every timed turn over the window: vLLM's own where it measured
    turns in the window, else the proxy's (the two are never added up)."""
    for source in ("engine", "proxy"):
        grown: dict[float, float] = {}
        for (_state, measured_by), buckets in now.ttft_buckets.items():
            if measured_by != source:
                continue
            earlier = before.ttft_buckets.get((_state, measured_by), {})
            for bound, count in buckets.items():
                grown[bound] = grown.get(bound, 0.0) + count - earlier.get(bound, 0.0)
        if grown and max(grown.values()) > 0:
            return quantile(0.5, grown)
    return None


# The hit ratio's colour bands: the dashboards' (hit_ratio_fair, hit_ratio_good of the
# monitoring config), so the demo and Grafana colour a ratio alike.
_BANDS = MonitoringConfig()


def _ratio_text(value: float | None) -> Text:
    if value is None:
        return Text("-")
    style = (
        "green"
        if value >= _BANDS.hit_ratio_good
        else "yellow"
        if value >= _BANDS.hit_ratio_fair
        else "red"
    )
    return Text(_pct(value), style=style)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}s" if value < 100 else f"{value:.0f}s"


def _tokens(value: float | None) -> str:
    return "-" if value is None else f"{int(value):,}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{int(value)}"


def _onoff(value: bool | None) -> str:
    return "unknown" if value is None else ("on" if value else "off")


def _window(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:d}:{secs:02d}"
